"""Switching from Flower gives the same numbers: fastagg's optimizers against Flower 1.42's own strategies
(``flwr.server.strategy``), driven with the same client models and example counts over several rounds.

Flower turns the model into float64 after its first Adam-family round (its bias-corrected rate is a numpy
float64), while fastagg keeps float32 params with float32 math: models agree to float32 precision (rtol 1e-5).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import strategy as fl

from fastagg import server
from fastagg.testing import assert_close, cpu_backends

SHAPES = [(20, 7), (13,)]
PARTICIPANTS = [3, 2, 4, 3, 4]

# (flower strategy, its kwargs, fastagg optimizer, its kwargs) with the same settings
CASES = {
    "FedAvgM": (fl.FedAvgM, dict(server_learning_rate=0.7, server_momentum=0.9),
                server.FedAvgM, dict(lr=0.7, momentum=0.9)),
    "FedAdam": (fl.FedAdam, dict(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3),
                server.FedAdam, dict(lr=0.1, betas=(0.9, 0.99), tau=1e-3)),
    "FedYogi": (fl.FedYogi, dict(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3),
                server.FedYogi, dict(lr=0.01, betas=(0.9, 0.99), tau=1e-3)),
    "FedAdagrad": (fl.FedAdagrad, dict(eta=0.1, tau=1e-3), server.FedAdagrad, dict(lr=0.1, tau=1e-3)),
}


def fit_res(arrays, n):
    return (None, FitRes(status=Status(code=Code.OK, message=""), parameters=ndarrays_to_parameters(arrays),
                         num_examples=n, metrics={}))


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("case", list(CASES))
def test_same_models_as_flower_round_after_round(case, backend):
    fl_cls, fl_kw, fa_cls, fa_kw = CASES[case]
    rng = np.random.default_rng(0)
    w0 = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    strategy = fl_cls(initial_parameters=ndarrays_to_parameters(w0), **fl_kw)
    params = [torch.from_numpy(a.copy()) for a in w0]
    opt = fa_cls(params, backend=backend, **fa_kw)
    flower_w = w0
    for t, m in enumerate(PARTICIPANTS, start=1):
        current = [p.numpy().copy() for p in params]
        models = [[(c + 0.05 * rng.standard_normal(c.shape) + 0.01).astype(np.float32) for c in current]
                  for _ in range(m)]
        counts = rng.integers(5, 100, size=m).tolist()
        fl_params, _ = strategy.aggregate_fit(t, [fit_res(mod, n) for mod, n in zip(models, counts)], [])
        flower_w = parameters_to_ndarrays(fl_params)
        deltas = [[torch.from_numpy(a - c) for a, c in zip(mod, current)] for mod in models]
        opt.step(deltas, weights=counts)
        for k, (ours, theirs) in enumerate(zip(params, flower_w)):
            assert_close(ours, theirs, rtol=1e-5, atol=1e-6, name=f"{case} layer {k} after round {t}")
