"""A robust round's model buffers (issue 42 estimates them in one sort per group instead of one per buffer): against
an oracle written from the rule -- each buffer element's median (TrimmedMean's trimmed mean) over the clients the
rule keeps, taken as sent (floating statistics of full models), as advances over the model's counter (integer
buffers of full models), or as sent changes (updates) -- with mixed buffer dtypes and an even client count."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastagg import robust, server


def _model(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=g), "bn.running_mean": torch.randn(4, generator=g),
            "bn.running_var": torch.rand(4, generator=g) + 0.5, "bn.num_batches_tracked": torch.tensor(100),
            "h.running_mean": torch.randn(3, generator=g).half(), "c.num_batches_tracked": torch.tensor(7)}


def _oracle_median(values: list, trim: float | None) -> np.ndarray:
    x = np.sort(np.stack([np.asarray(v, dtype=np.float64).reshape(-1) for v in values]), axis=0)
    m = x.shape[0]
    if trim is not None:
        k = int(trim * m)
        return x[k:m - k].mean(0)
    return x[m // 2] if m % 2 else 0.5 * (x[m // 2 - 1] + x[m // 2])


@pytest.mark.parametrize("m", [4, 5])
@pytest.mark.parametrize("rule, trim", [(robust.Median(), None), (robust.TrimmedMean(0.25), 0.25)])
def test_buffers_of_full_models_follow_the_oracle(m, rule, trim):
    glob = _model(0)
    g = torch.Generator().manual_seed(m)
    clients = []
    for i in range(m):
        c = {}
        for n, t in glob.items():
            if t.is_floating_point():
                c[n] = (t.double() + torch.randn(t.shape, generator=g, dtype=torch.float64)).abs().to(t.dtype) \
                    if n.endswith("running_var") else (t.double() + torch.randn(t.shape, generator=g,
                                                                                 dtype=torch.float64)).to(t.dtype)
            else:
                c[n] = t + int(torch.randint(0, 20, (), generator=g))
        clients.append(c)
    model = {k: v.clone() for k, v in glob.items()}
    server.FedAvg(model, aggregate=rule, backend="cpu").step(clients, base={k: v.clone() for k, v in glob.items()})
    for n, t in glob.items():
        if n == "a.weight":
            continue
        if t.is_floating_point():
            want = torch.from_numpy(_oracle_median([c[n].double() for c in clients], trim)).reshape(t.shape)
            assert torch.equal(model[n], want.to(t.dtype)), n
        else:
            adv = _oracle_median([(c[n] - t).double() for c in clients], trim)
            assert model[n].item() == t.item() + int(np.round(adv[0])), n


def test_buffer_validity_over_mixed_dtypes_and_devices_of_one_buffer():
    """Clients sending one buffer in different dtypes are checked in float64 (an integer stays finite, its sign
    kept): a negative float16 variance, an Inf in a float64 mean and a negative integer variance are each invalid."""
    from fastagg.rows import client_rows

    base = {"w": torch.zeros(2), "bn.running_mean": torch.zeros(3), "bn.running_var": torch.ones(3)}
    clients = [{k: v.clone() for k, v in base.items()} for _ in range(5)]
    clients[1]["bn.running_var"] = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float16)
    clients[2]["bn.running_mean"] = torch.tensor([0.0, float("inf"), 1.0], dtype=torch.float64)
    clients[3]["bn.running_var"] = torch.tensor([1, -1, 3])
    clients[4]["bn.running_var"] = torch.tensor([1, 2, 3])
    rows = client_rows(clients, name="models")
    assert robust._buffers_valid(rows).tolist() == [True, False, False, False, True]
