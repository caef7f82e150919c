"""Defaults pinned to the source each one claims: Flower 1.42's strategies (read from the installed flwr, not
copied from fastagg), Flower's adaptive-clipping noise parameters, and FedBuff's staleness weight. A default that
drifts (FedAdam's tau back to Flower's legacy 1e-9: a 100x larger first step on small updates) changes every
user's run silently, and fastagg's own oracle tests pass explicit values, so they cannot see it."""
from __future__ import annotations

import inspect

import pytest
import torch

from fastagg import server
from fastagg.asynchronous import AsyncServer
from fastagg.privacy.mechanisms import adaptive_noise_params
from fastagg.robust import Median, TrimmedMean

from flwr.serverapp import strategy  # noqa: E402  # a test requirement ([test]): a missing one fails, never skips


def _flower_defaults(cls) -> dict:
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


# fastagg optimizer, the Flower 1.42 strategy its docstring names as the source of its defaults, and how the
# hyperparameters are spelled there
ADAM_LIKE = [
    (server.FedAdam, strategy.FedAdam, True),
    (server.FedYogi, strategy.FedYogi, True),
    (server.FedAdagrad, strategy.FedAdagrad, False),
]


@pytest.mark.parametrize("ours, flower, has_betas", ADAM_LIKE, ids=lambda x: getattr(x, "__name__", ""))
def test_adaptive_optimizer_defaults_are_flowers(ours, flower, has_betas):
    want = _flower_defaults(flower)
    opt = ours(torch.zeros(3), backend="reference")
    assert opt.lr == want["eta"], f"{ours.__name__} default lr {opt.lr} != Flower {flower.__name__} eta {want['eta']}"
    assert opt.tau == want["tau"], f"{ours.__name__} default tau {opt.tau} != Flower {flower.__name__} tau {want['tau']}"
    if has_betas:
        assert opt.betas == (want["beta_1"], want["beta_2"]), \
            f"{ours.__name__} default betas {opt.betas} != Flower's {(want['beta_1'], want['beta_2'])}"
    # the values themselves (Flower 1.42; a flwr upgrade that moves them must be a decision, not a drift)
    assert want["tau"] == 1e-3


def test_fedavgm_defaults_are_flowers():
    want = _flower_defaults(strategy.FedAvgM)
    opt = server.FedAvgM(torch.zeros(3), backend="reference")
    assert (opt.lr, opt.momentum) == (want["server_learning_rate"], want["server_momentum"]) == (1.0, 0.0)


def test_fedadam_default_first_step_is_flowers_first_round():
    """One FedAdam round with every default on small updates (where tau dominates sqrt(v)), against Flower 1.42's
    aggregate_train written out (flwr/serverapp/strategy/fedadam.py, server_round = 1):
    m = (1 - b1) delta, v = (1 - b2) delta^2, w += eta sqrt(1 - b2^2) / (1 - b1^2) m / (sqrt(v) + tau)."""
    fl = _flower_defaults(strategy.FedAdam)
    eta, b1, b2, tau = fl["eta"], fl["beta_1"], fl["beta_2"], fl["tau"]
    delta = torch.tensor([1e-4, -3e-3, 0.5, 0.0, -2e-6], dtype=torch.float64)
    w0 = torch.tensor([0.1, -0.2, 0.3, 0.4, 0.5], dtype=torch.float64)
    m = (1 - b1) * delta
    v = (1 - b2) * delta * delta
    want = w0 + eta * (1 - b2 ** 2) ** 0.5 / (1 - b1 ** 2) * m / (v.sqrt() + tau)
    w = w0.clone()
    server.FedAdam(w, backend="reference").step(delta[None, :])
    torch.testing.assert_close(w, want, rtol=1e-12, atol=1e-15)
    # two-sided: the step on the 1e-4 coordinate is ~1e-2 of eta (tau = 1e-3 dominates); tau = 1e-9 would give ~eta
    step = float(w[0] - w0[0])
    assert 0.005 * eta < step < 0.02 * eta, step


def test_trimmed_mean_and_median_defaults_are_flowers():
    assert TrimmedMean().beta == _flower_defaults(strategy.FedTrimmedAvg)["beta"] == 0.2
    # Flower's FedMedian takes numpy's median: the mean of the two middle values for an even count
    assert Median().even == "mean"


@pytest.mark.parametrize("z, n, std", [(0.5, 100, None), (1.0, 200, None), (0.3, 10, 2.0), (1.2, 40, None)])
def test_adaptive_noise_params_are_flowers(z, n, std):
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    want = compute_adaptive_noise_params(z, n, std)
    got = adaptive_noise_params(z, n, std)
    assert got == pytest.approx(want, rel=1e-12), f"z={z}, n={n}, clipped_count_stddev={std}: {got} != Flower {want}"


def test_async_default_staleness_is_fedbuffs_inverse_square_root():
    """FedBuff (Nguyen et al., AISTATS 2022, Sec. 5): an update s versions stale weighs 1 / sqrt(1 + s)."""
    srv = AsyncServer(server.FedAvg(torch.zeros(3), backend="reference"), buffer_size=2)
    for s in range(6):
        assert srv.staleness(s) == pytest.approx((1 + s) ** -0.5, rel=1e-15), s
