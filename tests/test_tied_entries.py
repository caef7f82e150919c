"""Tied entries (issue 42, the shapes users federate: GPT-2's ``lm_head.weight`` is its ``transformer.wte.weight``):
one tensor under two names in the global model is one parameter -- stepped once, its update counted once in the
norms, written once -- and a client's value under the alias name is not read. Before, a module's tied weights
refused every client state_dict ("has parameter entries 'lm_head.weight' not in params") and a state_dict's were
refused as two written entries that overlap. Oracles: float64 formulas over the model's distinct parameters."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastagg
from fastagg import server


class TinyLM(torch.nn.Module):
    """GPT-2's shape in miniature: token embedding, a block with LayerNorm, an LM head tied to the embedding."""

    def __init__(self, vocab: int = 11, d: int = 4):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight


def _model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().double()


def _clients(model: TinyLM, m: int = 3) -> list:
    """Client state_dicts as a tied client sends them: the alias entry holds the same values."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(m):
        sd = {k: v.detach() + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in model.state_dict().items()}
        sd["lm_head.weight"] = sd["wte.weight"].clone()
        out.append(sd)
    return out


def _distinct(sd: dict) -> dict:
    return {k: v for k, v in sd.items() if k != "lm_head.weight"}


def _mean_delta(model_sd: dict, clients: list, weights: list) -> dict:
    p = [w / sum(weights) for w in weights]
    return {k: sum(pi * (c[k].double() - model_sd[k].double()) for pi, c in zip(p, clients)) for k in _distinct(model_sd)}


@pytest.mark.parametrize("form", ["module", "state_dict", "state_dict keep_vars", "named_parameters"])
def test_fedavg_steps_a_tied_parameter_once(form):
    """``state_dict(keep_vars=True)`` and ``named_parameters(remove_duplicate=False)`` hold nn.Parameter objects, not
    plain tensors: they were refused as two overlapping entries (a reviewer's find)."""
    model = _model()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    clients, weights = _clients(model), [1.0, 2.0, 5.0]
    params = {"module": lambda: model, "state_dict": model.state_dict,
              "state_dict keep_vars": lambda: model.state_dict(keep_vars=True),
              "named_parameters": lambda: dict(model.named_parameters(remove_duplicate=False))}[form]()
    if form == "named_parameters":  # (no buffers: the clients' are not read against any)
        clients = [{k: v for k, v in c.items() if k in params} for c in clients]
    server.FedAvg(params).step(clients, weights, base={k: v.clone() for k, v in before.items()})
    want = {k: before[k] + d for k, d in _mean_delta(before, clients, weights).items()}
    got = model.state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-12, atol=1e-12, msg=k)
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()  # still tied
    assert torch.equal(got["lm_head.weight"], got["wte.weight"])


def test_fedexp_counts_a_tied_update_once_in_its_norms():
    """FedExP (Jhunjhunwala et al. 2023): eta = max(1, sum_i p_i ||d_i||^2 / (2 (||dbar||^2 + eps))) over the model's
    parameters -- the tied embedding once, not twice."""
    model, eps = _model(1), 1e-3
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    clients, weights = _clients(model), [1.0, 1.0, 2.0]
    p = [w / sum(weights) for w in weights]
    flat = [torch.cat([(c[k] - before[k]).reshape(-1) for k in _distinct(before)]) for c in clients]
    dbar = sum(pi * d for pi, d in zip(p, flat))
    eta = max(1.0, float(sum(pi * d.dot(d) for pi, d in zip(p, flat)) / (2 * (dbar.dot(dbar) + eps))))
    server.FedExP(model, eps=eps).step(clients, weights, base={k: v.clone() for k, v in before.items()})
    got = torch.cat([model.state_dict()[k].reshape(-1) - before[k].reshape(-1) for k in _distinct(before)])
    torch.testing.assert_close(got, eta * dbar, rtol=1e-10, atol=1e-12)


def test_a_clients_alias_value_is_not_read():
    """A client whose alias entry differs from its embedding (untied on its side): the model's tied parameter takes
    the embedding's update (the alias name is not a parameter of the model)."""
    model = _model(2)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    clients = _clients(model, 2)
    clients[1]["lm_head.weight"] = clients[1]["lm_head.weight"] + 100.0
    server.FedAvg(model).step(clients, base={k: v.clone() for k, v in before.items()})
    want = before["wte.weight"] + _mean_delta(before, clients, [1.0, 1.0])["wte.weight"]
    torch.testing.assert_close(model.wte.weight.detach(), want, rtol=1e-12, atol=1e-12)


def test_the_functional_step_and_the_accumulator_take_tied_models():
    model = _model(3)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    clients, weights = _clients(model), [3.0, 1.0, 1.0]
    want = {k: before[k] + d for k, d in _mean_delta(before, clients, weights).items()}
    params = {k: v.clone() for k, v in before.items()}
    params["lm_head.weight"] = params["wte.weight"]  # tied in the state_dict given
    fastagg.fedavg_step(models=clients, weights=weights, params=params)
    for k, v in want.items():
        torch.testing.assert_close(params[k], v, rtol=1e-12, atol=1e-12, msg=k)
    acc = fastagg.Accumulator(like=model)
    for c, w in zip(clients, weights):
        acc.add(c, weight=w, base=before)
    server.FedAvg(model).step(acc)
    for k, v in want.items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-12, atol=1e-12, msg=k)


def test_entries_that_overlap_without_being_the_same_tensor_are_still_refused():
    w = torch.zeros(6, 4, dtype=torch.float64)
    params = {"a": w, "b": w[:3]}  # b is part of a, not a: writing both would depend on the order
    clients = [{"a": torch.ones(6, 4, dtype=torch.float64), "b": torch.ones(3, 4, dtype=torch.float64)}]
    with pytest.raises(ValueError, match="overlaps"):
        server.FedAvg(params).step(clients)


def test_numpy_state_dicts_have_no_tied_entries():
    """Arrays from another framework (Flower's, FLARE's) are separate copies: both names are entries."""
    a = np.ones((3, 2))
    params = {"wte.weight": a.copy(), "lm_head.weight": a.copy()}
    clients = [{k: v + 1.0 for k, v in params.items()} for _ in range(2)]
    fastagg.fedavg_step(models=clients, params=params)
    assert np.allclose(params["wte.weight"], 2.0) and np.allclose(params["lm_head.weight"], 2.0)


def test_a_tied_state_dict_lines_up_grads_and_state_with_its_parameters():
    """The review: param_groups held the alias tensor too, so `.grad` (torch's outer-optimizer loop, `opt.step()`
    without clients) and `opt.state[p]` paired with the entries after it one place off (T5's order: shared, the tied
    embedding, then fc)."""
    shared = torch.zeros(3, 2, dtype=torch.float64)
    params = {"shared.weight": shared, "encoder.embed_tokens.weight": shared, "fc.weight": torch.zeros(4, dtype=torch.float64)}
    opt = server.FedAvg(params)
    assert [t.data_ptr() for t in opt.param_groups[0]["params"]] == [shared.data_ptr(), params["fc.weight"].data_ptr()]
    shared.grad = -torch.ones_like(shared)
    params["fc.weight"].grad = -5 * torch.ones(4, dtype=torch.float64)
    opt.step()
    assert torch.equal(shared, torch.ones_like(shared)) and torch.equal(params["fc.weight"], torch.full((4,), 5.0,
                                                                                                        dtype=torch.float64))
    s2 = shared.clone()
    adam = server.FedAdam({"shared.weight": s2, "encoder.embed_tokens.weight": s2,
                           "fc.weight": torch.zeros(4, dtype=torch.float64)}, lr=0.1)
    assert len(adam.param_groups[0]["params"]) == 2
    adam.step([{"shared.weight": torch.ones(3, 2, dtype=torch.float64),
                "encoder.embed_tokens.weight": torch.ones(3, 2, dtype=torch.float64),
                "fc.weight": torch.full((4,), 2.0, dtype=torch.float64)}])
    first, fc = adam.param_groups[0]["params"]
    assert adam.state[first]["m"].shape == (3, 2) and adam.state[fc]["m"].shape == (4,)


@pytest.mark.parametrize("rule", ["fedacg", "fedexp"])
def test_a_tied_state_dicts_broadcast_gives_the_alias_the_entrys_value(rule):
    """FedACG's look-ahead broadcast / FedExP's eval model: the alias name carried the params' old value."""
    model = _model(4)
    params = model.state_dict()
    opt = server.FedACG(params, lam=0.85) if rule == "fedacg" else server.FedExP(params, eps=1e-3)
    for _ in range(2):
        sent = opt.broadcast() if rule == "fedacg" else opt.eval_params()
        opt.step(_clients(model), base={k: v.clone() for k, v in (opt.broadcast() if rule == "fedacg" else params).items()})
        sent = opt.broadcast() if rule == "fedacg" else opt.eval_params()
        assert torch.equal(sent["lm_head.weight"], sent["wte.weight"])


def test_an_accumulator_like_a_tied_broadcast_steps_the_optimizer():
    """README's `Accumulator(like=opt.broadcast())` with a tied model: the alias was a separate entry of the
    accumulator (116 elements against the optimizer's 72)."""
    model = _model(5)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = server.FedAvg(model)
    clients, weights = _clients(model), [1.0, 2.0, 1.0]
    acc = fastagg.Accumulator(like=opt.broadcast())
    for c, w in zip(clients, weights):
        acc.add(c, weight=w, base=before)
    opt.step(acc)
    want = {k: before[k] + d for k, d in _mean_delta(before, clients, weights).items()}
    for k, v in want.items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-12, atol=1e-12, msg=k)


def test_flatten_of_a_tied_state_dict_keeps_every_entry():
    """fastagg.flatten copies what it is given (a tied state_dict's both names), so unflatten gives a state_dict
    load_state_dict takes, as a numpy copy of it would."""
    model = _model(6)
    flat, layout = fastagg.flatten(model.state_dict())
    back = layout.unflatten(flat)
    assert set(back) == set(model.state_dict()) - {"ln.running_mean"}
    fresh = TinyLM().double()
    fresh.load_state_dict(back)
    assert torch.equal(fresh.wte.weight, model.wte.weight)


def test_client_side_clipping_scales_a_tied_tensor_once():
    """fastagg.client.clip_updates on tied clients (each client's lm_head is its embedding): the norm counted the
    tensor twice and the in-place clip scaled it twice (s^2). Oracle: x <- base + min(1, C/||u||) u over each
    client's distinct tensors; an untied client's alias is its own entry (counted and clipped)."""
    from fastagg import client
    model = _model(8)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    tied = [TinyLM().double() for _ in range(2)]
    for t, shift in zip(tied, (0.3, 0.1)):
        t.load_state_dict({k: v + shift for k, v in base.items()})
    n_distinct = sum(base[k].numel() for k in _distinct(base))
    want = [0.3 * n_distinct ** 0.5, 0.1 * n_distinct ** 0.5]
    c = 0.5 * want[0]
    norms, clipped = client.clip_updates([t.state_dict() for t in tied], base, c)
    assert norms.tolist() == pytest.approx(want, rel=1e-12) and clipped.tolist() == [True, False]
    for k in _distinct(base):  # the first scaled by 1/2 once (not 1/4), the second untouched
        torch.testing.assert_close(tied[0].state_dict()[k], base[k] + 0.15, rtol=0, atol=1e-12, msg=k)
        torch.testing.assert_close(tied[1].state_dict()[k], base[k] + 0.1, rtol=0, atol=1e-12, msg=k)
    untied = {k: v + 0.3 for k, v in base.items()}  # the alias a copy of its own: an entry, counted and clipped
    n_all = sum(v.numel() for k, v in base.items() if v.is_floating_point() and "running" not in k)
    norms, _ = client.clip_updates([untied], base, c)
    assert float(norms[0]) == pytest.approx(0.3 * n_all ** 0.5, rel=1e-12)
    torch.testing.assert_close(untied["lm_head.weight"], base["lm_head.weight"] + 0.3 * c / float(norms[0]),
                               rtol=0, atol=1e-12)
