"""One simulator round on the CPU: 100 clients, digits-sized inputs (64 features, 10 classes, 18 samples each),
5 full-batch local steps, then FedAvg. Batched (fastagg: all clients as rows of one [M, d] buffer, closed-form
batched gradients, one fused local-step call per step, one server step) against a Python loop over clients with
plain torch (nn.Module + autograd + torch.optim.SGD per client, then a stacked average) -- what per-client
simulators do. Models: softmax regression and the one-hidden-layer MLP (64 units).
"""
from __future__ import annotations

import pytest
import torch

from fastagg import client, server
from fastagg.sim.data import FederatedData
from fastagg.sim.models import MLP, Softmax

M, N_PER, F, C, STEPS, LR = 100, 18, 64, 10, 5, 0.05


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(M, N_PER, F, generator=g)
    y = torch.randint(0, C, (M, N_PER), generator=g)
    return FederatedData("bench", x, y, torch.full((M,), N_PER), "classification", num_classes=C)


def _model(kind, data):
    return Softmax(data) if kind == "softmax" else MLP(data)


def _torch_module(kind):
    if kind == "softmax":
        return torch.nn.Linear(F, C)
    return torch.nn.Sequential(torch.nn.Linear(F, 64), torch.nn.ReLU(), torch.nn.Linear(64, C))


@pytest.mark.parametrize("kind", ["softmax", "mlp"])
def test_round_batched(benchmark, data, kind):
    model = _model(kind, data)
    w = model.init(torch.float32, "cpu") if hasattr(model, "init") else torch.zeros(model.dim)
    opt = server.FedAvg(w)
    mask = torch.ones(M, N_PER)
    benchmark.group = f"one round, {M} clients, {kind}, {STEPS} local steps (CPU)"

    def round_():
        x = w.expand(M, -1).clone()
        for _ in range(STEPS):
            _, grads = model.loss_grad(x, data.x, data.y, mask)
            client.local_step(params=x, grads=grads, lr=LR, backend="cpu")
        opt.step(x - w, weights=data.counts)

    benchmark(round_)


@pytest.mark.parametrize("kind", ["softmax", "mlp"])
def test_round_python_loop(benchmark, data, kind):
    global_model = _torch_module(kind)
    benchmark.group = f"one round, {M} clients, {kind}, {STEPS} local steps (CPU)"

    def round_():
        states = []
        for i in range(M):
            local = _torch_module(kind)
            local.load_state_dict(global_model.state_dict())
            sgd = torch.optim.SGD(local.parameters(), lr=LR)
            for _ in range(STEPS):
                sgd.zero_grad()
                torch.nn.functional.cross_entropy(local(data.x[i]), data.y[i]).backward()
                sgd.step()
            states.append(local.state_dict())
        global_model.load_state_dict({k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]})

    benchmark.pedantic(round_, rounds=3, iterations=1)
