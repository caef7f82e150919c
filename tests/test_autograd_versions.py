"""fastagg writes params in place through raw pointers; autograd must still learn of it (version counters), so a
graph saved from the old values cannot silently differentiate at the new ones -- the same error torch.optim's
in-place ``p.add_()`` gives (a reviewer's find: backward ran and returned gradients at the new values)."""
from __future__ import annotations

import pytest
import torch

import fastagg
from fastagg import server


def _graph_then_round(step):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    loss = (model[0].weight ** 2).sum()  # pow saves the weight as it is now
    version = model[0].weight._version
    step(model)
    assert model[0].weight._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _clients(model):
    return [{k: v.detach() + 1.0 if v.is_floating_point() else v for k, v in model.state_dict().items()}
            for _ in range(2)]


@pytest.mark.parametrize("rule", [lambda m: server.FedAvg(m), lambda m: server.FedAdam(m, lr=0.1),
                                  lambda m: server.FedExP(m, eps=1e-3), lambda m: server.FedAvgM(m, momentum=0.9)])
def test_a_server_step_bumps_the_written_params_versions(rule):
    def step(model):
        rule(model).step(_clients(model), base=model.state_dict())

    _graph_then_round(step)


def test_the_functional_step_bumps_them_too():
    _graph_then_round(lambda model: fastagg.fedavg_step(models=_clients(model), params=model.state_dict()))


def test_torch_optim_gives_the_same_error():
    """The behaviour matched: torch's own SGD step on a saved graph."""
    def step(model):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        torch.optim.SGD(model.parameters(), lr=0.1).step()

    _graph_then_round(step)
