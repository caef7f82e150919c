"""The global model's buffers after a round, against an oracle written from the rule (ALGORITHMS.md, "buffers"):
a floating buffer becomes the clients' weighted average computed in float64 (``sum_i p_i b_i``, then the buffer's
dtype); an integer counter advances by the weighted average of the clients' advances, rounded to the nearest integer.
Many buffers of mixed dtypes in one model (what the batched averaging of issue 42 groups), clients sending other
integer widths, full models and updates."""
from __future__ import annotations

import pytest
import torch

import fastagg
from fastagg import server


def _model(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, (c, dt) in enumerate([(3, torch.float32), (5, torch.float16), (1, torch.float32), (4, torch.bfloat16),
                                 (7, torch.float64)]):
        sd[f"l{k}.weight"] = torch.randn(c, 2, generator=g)
        sd[f"l{k}.running_mean"] = torch.randn(c, generator=g).to(dt)
        sd[f"l{k}.running_var"] = (torch.rand(c, generator=g) + 0.5).to(dt)
        sd[f"l{k}.num_batches_tracked"] = torch.tensor(1000 * k + 7, dtype=torch.int64)
    sd["steps32"] = torch.arange(6, dtype=torch.int32).reshape(2, 3) * 11
    sd["flags"] = torch.tensor([3, 250, 0], dtype=torch.uint8)
    return sd


def _clients(glob: dict, m: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(m):
        c = {}
        for n, t in glob.items():
            if t.is_floating_point():
                c[n] = (t.double() + torch.randn(t.shape, generator=g, dtype=torch.float64)).to(t.dtype)
            else:  # counters: advances of 0..9, sent as int64 by some clients (another width than the model's)
                adv = torch.randint(0, 10, t.shape, generator=g)
                c[n] = (t.to(torch.int64) + adv).to(torch.int64 if i % 2 else t.dtype)
        out.append(c)
    return out


def _oracle(glob: dict, clients: list, weights: list, models: bool) -> dict:
    p = [w / sum(weights) for w in weights]
    out = {}
    for n, g in glob.items():
        if n.endswith("weight"):
            continue
        if g.is_floating_point():
            avg = sum(pi * c[n].double() for pi, c in zip(p, clients))
            out[n] = (avg if models else g.double() + avg).to(g.dtype)
        else:
            adv = sum(pi * (c[n].to(torch.int64) - (g.to(torch.int64) if models else 0)).double()
                      for pi, c in zip(p, clients))
            new = g.to(torch.int64) + torch.round(adv).to(torch.int64)
            info = torch.iinfo(g.dtype)
            out[n] = torch.where((new >= info.min) & (new <= info.max), new, g.to(torch.int64)).to(g.dtype)
    return out


def _same(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Bit for bit in the buffer's dtype; a float64 buffer within 4 ulp (the oracle's p_i are Python floats, the
    library's a float64 tensor division: the last bit of a p_i may differ)."""
    if got.dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-15, atol=0.0, msg=name)
    else:
        assert torch.equal(got, want), (name, got, want)


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_optimizer_buffers_match_oracle(m, backend):
    glob = _model(0)
    clients = _clients(glob, m, seed=m)
    weights = [float(3 + 2 * i) for i in range(m)]
    model = {n: t.clone() for n, t in glob.items()}
    server.FedAvg(model, backend=backend).step(clients, weights, base={n: t.clone() for n, t in glob.items()})
    want = _oracle(glob, clients, weights, models=True)
    for n, w in want.items():
        assert model[n].dtype == glob[n].dtype, n
        _same(model[n], w, n)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_functional_buffers_match_oracle_updates(backend):
    glob = _model(1)
    m = 4
    clients = _clients(glob, m, seed=9)
    deltas = [{n: (c[n].double() - glob[n].double()).to(glob[n].dtype) if glob[n].is_floating_point()
               else c[n].to(torch.int64) - glob[n].to(torch.int64) for n in glob} for c in clients]
    weights = [1.0, 2.0, 3.0, 5.0]
    params = {n: t.clone() for n, t in glob.items()}
    fastagg.fedavg_step(deltas, weights=weights, params=params, backend=backend)
    want = _oracle(glob, deltas, weights, models=False)
    for n, w in want.items():
        _same(params[n], w, n)


def test_counter_that_would_overflow_keeps_its_value_others_advance():
    glob = _model(2)
    glob["flags"] = torch.tensor([3, 250, 0], dtype=torch.uint8)
    clients = _clients(glob, 2, seed=3)
    for c in clients:
        c["flags"] = torch.tensor([4, 255 + 9, 1], dtype=torch.int64)  # element 1 would pass 255
    model = {n: t.clone() for n, t in glob.items()}
    server.FedAvg(model, backend="cpu").step(clients, [1.0, 1.0], base={n: t.clone() for n, t in glob.items()})
    assert model["flags"].tolist() == [4, 250, 1]
    assert torch.equal(model["l2.running_mean"], _oracle(glob, clients, [1.0, 1.0], True)["l2.running_mean"])
