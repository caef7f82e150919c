"""Server optimizer steps on the CPU: M = 16 clients, d = 10^7 float32 (FASTAGG_BENCH_D to change d).

Each step is compared, in the same run, with a plain pass over its unavoidable traffic -- one read of the M x d
updates plus one read and one write of the params and of each state vector (``X.sum()`` followed by
``v.mul_(1.0)`` on each of those vectors) -- and, where Flower has the rule, with Flower 1.42's own strategy
(``aggregate_fit`` on the same client models; its parameter (de)serialization is part of its code path, the
serialization of the inputs is done before timing).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from fastagg import server

M = 16
D = int(float(os.environ.get("FASTAGG_BENCH_D", "1e7")))
LAYERS = 4

# optimizer name -> (kwargs, state vectors its apply pass reads and writes besides params; extra written vector)
RULES = {
    "FedAvg": (dict(lr=1.0), 0, 0),
    "FedAvgM": (dict(lr=1.0, momentum=0.9), 1, 0),
    "FedExP": (dict(eps=1e-3), 0, 1),
    "FedExPM": (dict(eps=1e-3, beta=0.9), 1, 1),
    "FedACG": (dict(lam=0.85), 1, 1),
    "FedAdam": (dict(), 2, 0),
    "FedYogi": (dict(), 2, 0),
    "FedAdagrad": (dict(), 1, 0),
    "FedAMS": (dict(), 3, 0),
}


@pytest.fixture(scope="module")
def updates():
    g = torch.Generator().manual_seed(0)
    x = 0.01 * torch.randn(M, D, generator=g)
    return x, list(range(1, M + 1))


def _traffic(n_state: int, n_extra: int) -> int:
    """Bytes: M*d read, params and each state vector read + written, extra outputs written, the mean written
    by the stats pass and read by the apply pass."""
    return 4 * D * (M + 2 * (1 + n_state) + n_extra + 2)


@pytest.mark.parametrize("rule", list(RULES))
def test_step(benchmark, updates, rule):
    kwargs, n_state, n_extra = RULES[rule]
    x, n = updates
    w = torch.zeros(D)
    opt = getattr(server, rule)(w, backend="cpu", **kwargs)
    opt.step(x, weights=n)  # state buffers exist from here on
    benchmark.group = f"server step {rule} M={M} d={D:.0e} (CPU)"
    benchmark.extra_info["bytes"] = _traffic(n_state, n_extra)
    benchmark(lambda: opt.step(x, weights=n))


@pytest.mark.parametrize("rule", list(RULES))
def test_read_traffic(benchmark, updates, rule):
    """The plain pass over the same bytes: X.sum() plus a read-modify-write of each vector the step writes."""
    kwargs, n_state, n_extra = RULES[rule]
    x, _ = updates
    vectors = [torch.zeros(D) for _ in range(2 + n_state + n_extra)]  # params, mean, state..., extra

    def plain():
        x.sum()
        for v in vectors:
            v.mul_(1.0)

    benchmark.group = f"server step {rule} M={M} d={D:.0e} (CPU)"
    benchmark.extra_info["bytes"] = _traffic(n_state, n_extra)
    benchmark(plain)


FLOWER = {"FedAvgM": ("FedAvgM", dict(server_learning_rate=1.0, server_momentum=0.9)),
          "FedAdam": ("FedAdam", dict()), "FedYogi": ("FedYogi", dict()), "FedAdagrad": ("FedAdagrad", dict())}


@pytest.mark.parametrize("rule", list(FLOWER))
def test_flower_strategy(benchmark, updates, rule):
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.server import strategy as fl

    x, n = updates
    cuts = np.linspace(0, D, LAYERS + 1).astype(int)
    w0 = [np.zeros(b - a, np.float32) for a, b in zip(cuts[:-1], cuts[1:])]
    xn = x.numpy()
    results = [(None, FitRes(status=Status(code=Code.OK, message=""),
                             parameters=ndarrays_to_parameters([xn[i, a:b] for a, b in zip(cuts[:-1], cuts[1:])]),
                             num_examples=n[i], metrics={})) for i in range(M)]
    name, kwargs = FLOWER[rule]
    strategy = getattr(fl, name)(initial_parameters=ndarrays_to_parameters(w0), **kwargs)
    strategy.aggregate_fit(1, results, [])
    kwargs_, n_state, n_extra = RULES[rule]
    benchmark.group = f"server step {rule} M={M} d={D:.0e} (CPU)"
    benchmark.extra_info["bytes"] = _traffic(n_state, n_extra)
    rounds = iter(range(2, 10**6))
    benchmark.pedantic(lambda: strategy.aggregate_fit(next(rounds), results, []), rounds=3, iterations=1)
