"""A NaN / Inf in a client's floating buffer (BatchNorm's running statistics) makes that client non-finite, as one
in its parameters does: ``on_nonfinite="raise"`` names it and nothing is written, ``"skip"`` flags the round and
nothing is written -- what the README promises and what ``Accumulator.add`` already did. Before, the round went on:
the params stepped and each poisoned buffer element silently kept its old value (a reviewer's find)."""
from __future__ import annotations

import pytest
import torch

import fastagg
from fastagg import server


def _setup(bad_value, entry="1.running_mean", client=1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    clients = [{k: (v + 0.5 * (i + 1) if v.is_floating_point() else v + 2) for k, v in sd.items()} for i in range(3)]
    clients[client][entry] = clients[client][entry].clone()
    clients[client][entry][0] = bad_value
    return model, sd, clients


RULES = {"FedAvg": lambda m: server.FedAvg(m), "FedAdam": lambda m: server.FedAdam(m, lr=0.1),
         "FedExP": lambda m: server.FedExP(m, eps=1e-3)}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("entry", ["1.running_mean", "1.running_var"])
@pytest.mark.parametrize("rule", list(RULES))
def test_a_server_step_refuses_the_client_and_writes_nothing(rule, entry, bad):
    model, sd, clients = _setup(bad, entry)
    opt = RULES[rule](model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"models\[1\] contain NaN or Inf; nothing was updated"):
        opt.step(clients, base=sd)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_skip_flags_the_round_and_names_the_client_in_its_stats():
    model, sd, clients = _setup(float("nan"), client=2)
    opt = server.FedAvg(model, on_nonfinite="skip")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = opt.step(clients, base=sd)
    assert not bool(stats.finite)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert opt.step([c for j, c in enumerate(clients) if j != 2], base=sd).finite  # without it, the round steps


@pytest.mark.parametrize("fn", ["fedavg_step", "fedexp_step"])
def test_the_functional_api_refuses_it_too(fn):
    _, sd, clients = _setup(float("nan"), "1.running_var", client=0)
    params = {k: v.clone() for k, v in sd.items()}
    kw = {"eps": 1e-3} if fn == "fedexp_step" else {}
    with pytest.raises(ValueError, match=r"models\[0\] contain NaN or Inf"):
        getattr(fastagg, fn)(models=clients, params=params, **kw)
    assert all(torch.equal(v, sd[k]) for k, v in params.items())


def test_the_accumulator_agrees():
    model, sd, clients = _setup(float("inf"))
    acc = fastagg.Accumulator(like=model)
    acc.add(clients[0], base=sd)
    with pytest.raises(ValueError, match="NaN or Inf"):
        acc.add(clients[1], base=sd)


def test_finite_buffers_still_average_exactly():
    """The oracle: the weighted mean of the clients' running statistics in float64."""
    model, sd, clients = _setup(0.25)
    w = [1.0, 2.0, 5.0]
    server.FedAvg(model).step(clients, w, base=sd)
    for k in ("1.running_mean", "1.running_var"):
        want = sum(wi * c[k].double() for wi, c in zip(w, clients)) / sum(w)
        torch.testing.assert_close(model.state_dict()[k].double(), want, rtol=1e-6, atol=1e-7)
