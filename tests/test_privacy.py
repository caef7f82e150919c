"""fastagg.privacy's mechanisms against float64 oracles written here from the formulas: the clipped mean plus
``sigma`` times the reference noise, on every backend and client form; composition with the server optimizers;
adaptive clipping's trajectory; the accountant against the exact Gaussian-DP curve; hostile arguments."""
from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from scipy import stats

from fastagg import privacy, server
from fastagg.backends import reference
from fastagg.testing import cpu_backends

BACKENDS = cpu_backends()  # reference, cpu (and triton under TRITON_INTERPRET=1)


def _clients(m=8, d=1000, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 3.0, m, dtype=torch.float64)[:, None] / math.sqrt(d)
    return (torch.randn(m, d, generator=g, dtype=torch.float64) * scale).to(dtype)


def _clipped_mean(x, c, p=None):
    x = x.double()
    norms = x.norm(dim=1)
    s = torch.where(norms > c, c / norms, torch.ones_like(norms))
    p = torch.full((x.shape[0],), 1 / x.shape[0], dtype=torch.float64) if p is None else p
    return (p[:, None] * s[:, None] * x).sum(0), norms > c


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["matrix", "layers", "models"])
def test_server_side_fixed_clipping_is_the_clipped_mean_plus_the_reference_noise(backend, form):
    m, d = 6, 999 if backend == "triton" else 100_003
    x = _clients(m, d)
    c, z, n = 0.8, 1.3, 10
    mech = privacy.ServerSideFixedClipping(z, c, n, seed=1234)
    base = torch.randn(d)
    with pytest.warns(RuntimeWarning, match="num_sampled_clients"):
        if form == "matrix":
            r = privacy.release(x, mech, backend=backend)
        elif form == "layers":
            cut = [d // 3, d - d // 3]
            r = privacy.release([list(row.split(cut)) for row in x], mech, backend=backend)
        else:
            r = privacy.release(x + base, mech, base=base, backend=backend)
    want, clipped = _clipped_mean((x + base).double() - base.double() if form == "models" else x, c)
    sigma = z * c / n
    assert r.noise_std == pytest.approx(sigma) and r.clipping_norm == c and r.round == 0
    assert r.clipped.tolist() == clipped.tolist() and 0 < int(clipped.sum()) < m
    noise = (r.estimate.double() - want) / sigma
    ref = reference.gaussian(d, seed=1234, round=0).double()
    assert float((noise - ref).abs().max()) < 1e-3  # float32 sums over M rows, divided by sigma = 0.16
    assert mech.rounds == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_client_side_fixed_clipping_reads_once_and_reclips_a_client_over_the_bound(backend):
    m, d = 5, 777 if backend == "triton" else 20_000
    x = _clients(m, d, seed=2)
    c = float(x.double().norm(dim=1).max()) * 1.01  # every client within C: one pass, no clipping
    mech = privacy.ClientSideFixedClipping(1.0, c, m, seed=5)
    r = privacy.release(x, mech, backend=backend)
    want = x.double().mean(0) + (c / m) * reference.gaussian(d, seed=5, round=0).double()
    assert float((r.estimate.double() - want).abs().max()) < 1e-5 * c
    assert not r.clipped.any()
    hostile = x.clone()
    hostile[3] *= 1000  # a client that did not clip
    r = privacy.release(hostile, mech, backend=backend)
    want, clipped = _clipped_mean(hostile, c)
    assert clipped.tolist() == [False, False, False, True, False] and r.clipped.tolist() == clipped.tolist()
    want = want + (c / m) * reference.gaussian(d, seed=5, round=1).double()
    assert float((r.estimate.double() - want).abs().max()) < 1e-5 * c


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_and_huge_clients_cannot_break_the_bound(backend):
    m, d = 6, 500
    x = _clients(m, d, seed=3)
    x[1, 7] = float("nan")
    x[4] = 3e38  # finite, with a norm past float32's range
    mech = privacy.ServerSideFixedClipping(0.0, 0.5, m)
    r = privacy.release(x, mech, backend=backend)
    assert r.excluded.tolist() == [False, True, False, False, False, False]
    assert r.clipped[4]
    keep = torch.tensor([0, 2, 3, 4, 5])
    want, _ = _clipped_mean(x[keep], 0.5)
    want = want * 5 / 6  # the excluded client counts as a zero update (clipped to nothing)
    assert torch.isfinite(r.estimate).all()
    np.testing.assert_allclose(r.estimate.double().numpy(), want.numpy(), atol=1e-6)
    x[:] = float("inf")
    with pytest.raises(ValueError, match="every one"):
        privacy.release(x, privacy.ServerSideFixedClipping(1.0, 0.5, m), backend=backend)


def test_same_seed_same_release_next_round_new_noise_and_restore_continues():
    x = _clients(4, 3000)
    a = privacy.ServerSideFixedClipping(1.0, 0.5, 4, seed=77)
    b = privacy.ServerSideFixedClipping(1.0, 0.5, 4, seed=77)
    r0 = privacy.release(x, a, backend="cpu").estimate.clone()
    assert torch.equal(r0, privacy.release(x, b, backend="cpu").estimate)
    r1 = privacy.release(x, a, backend="cpu").estimate.clone()
    assert not torch.equal(r0, r1)
    c = privacy.ServerSideFixedClipping(1.0, 0.5, 4)
    c.load_state_dict(a.state_dict())  # a checkpoint taken after two releases continues with the third
    assert torch.equal(privacy.release(x, c, backend="cpu").estimate, privacy.release(x, a, backend="cpu").estimate)
    fresh = [privacy.ServerSideFixedClipping(1.0, 0.5, 4) for _ in range(2)]  # seed=None: from the secrets module
    assert fresh[0].seed != fresh[1].seed


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt", ["FedAvg", "FedAvgM", "FedAdam", "FedExP"])
def test_every_server_optimizer_steps_on_the_noised_mean(backend, opt):
    m, d = 5, 300
    x = _clients(m, d, seed=4)
    kw = {"FedAvg": {}, "FedAvgM": {"lr": 1.0, "momentum": 0.9}, "FedAdam": {"lr": 0.1}, "FedExP": {"eps": 1e-3}}[opt]
    p0 = torch.randn(d, dtype=torch.float64)
    params, twin = p0.clone(), p0.clone()
    dp = getattr(server, opt)(params, aggregate=privacy.ServerSideFixedClipping(0.7, 0.3, m, seed=9), backend=backend,
                              **kw)
    plain = server.FedAvg(twin, backend="reference") if opt == "FedExP" else \
        getattr(server, opt)(twin, backend="reference", **kw)
    for _ in range(2):
        st = dp.step(x)
        est = dp.last_stats.robust.estimate.clone().double()
        if opt == "FedExP":  # eta from the clipped norms (<= C^2) and the noised mean; the step eta * est
            clipped_sq = x.double().norm(dim=1).clamp(max=0.3) ** 2
            assert float(st.avg_sq_norm) == pytest.approx(float(clipped_sq.mean()), rel=1e-5)
            assert float(st.mean_sq_norm) == pytest.approx(float(est @ est), rel=1e-6)
            eta = max(1.0, float(clipped_sq.mean()) / (2 * (float(est @ est) + 1e-3)))
            assert float(st.eta) == pytest.approx(eta, rel=1e-6)
            est = est * eta
        # the same optimizer stepped on the release as if it were one client's update
        plain.step(est[None, :])
        np.testing.assert_allclose(params.numpy(), twin.numpy(), rtol=1e-9, atol=1e-12)


def test_adaptive_clipping_moves_towards_the_target_quantile_and_flower_direction_does_not():
    x = _clients(20, 2000, seed=5)
    norms = x.double().norm(dim=1)
    for direction, expect in (("paper", "converges"), ("flower", "diverges")):
        mech = privacy.ServerSideAdaptiveClipping(0.0, 20, initial_clipping_norm=0.01, target_clipped_quantile=0.5,
                                                  clip_norm_lr=0.2, direction=direction)
        for _ in range(150):
            privacy.release(x, mech, backend="cpu")
        frac = float((norms > mech.clipping_norm).double().mean())
        if expect == "converges":
            assert 0.3 <= frac <= 0.7, (mech.clipping_norm, frac)
        else:  # Flower 1.42's sign: with every update clipped, C keeps shrinking
            assert mech.clipping_norm < 1e-3 and frac == 1.0


def test_adaptive_noise_is_calibrated_to_the_norm_the_round_clipped_with():
    x = _clients(10, 50_000, seed=6)
    mech = privacy.ServerSideAdaptiveClipping(1.0, 10, initial_clipping_norm=0.05, clipped_count_stddev=2.0, seed=3)
    z_u = (1.0 ** -2 - (2 * 2.0) ** -2) ** -0.5
    r = privacy.release(x, mech, backend="cpu")
    assert r.noise_std == pytest.approx(z_u * 0.05 / 10)
    want, _ = _clipped_mean(x, 0.05)
    resid = (r.estimate.double() - want) / r.noise_std
    assert abs(float(resid.std()) - 1) < 0.02
    assert r.next_clipping_norm == mech.clipping_norm != 0.05


def test_client_side_adaptive_counts_the_reported_bits():
    x = _clients(4, 100)
    mech = privacy.ClientSideAdaptiveClipping(0.0, 4, initial_clipping_norm=1.0, clip_norm_lr=0.2)
    mech.set_norm_bits([1, 1, 1, 0])
    r = privacy.release(x, mech, backend="cpu")
    assert r.noisy_clipped_fraction == 0.75
    assert mech.clipping_norm == pytest.approx(math.exp(0.2 * (0.75 - 0.5)))
    mech.set_norm_bits([1, 0])
    with pytest.raises(ValueError, match="2 reports for 4 clients"):
        privacy.release(x, mech, backend="cpu")


class SecureNoise:
    def __init__(self):
        self.calls = []

    def __call__(self, numel, round, dtype, device):
        self.calls.append((numel, round))
        return torch.ones(numel, dtype=dtype, device=device)


def test_noise_source_hook_replaces_the_generator():
    x = _clients(4, 100)
    src = SecureNoise()
    mech = privacy.ServerSideFixedClipping(2.0, 0.5, 4, noise_source=src)
    r = privacy.release(x, mech, backend="cpu")
    want, _ = _clipped_mean(x, 0.5)
    np.testing.assert_allclose(r.estimate.double().numpy(), (want + 0.25).numpy(), atol=1e-6)
    assert src.calls == [(100, 0)]


@pytest.mark.parametrize("make,match", [
    (lambda: privacy.ServerSideFixedClipping(-1.0, 1.0, 4), "noise_multiplier"),
    (lambda: privacy.ServerSideFixedClipping(float("nan"), 1.0, 4), "noise_multiplier"),
    (lambda: privacy.ServerSideFixedClipping(1.0, 0.0, 4), "clipping_norm"),
    (lambda: privacy.ServerSideFixedClipping(1.0, float("nan"), 4), "clipping_norm"),
    (lambda: privacy.ServerSideFixedClipping(1.0, 1.0, 0), "num_sampled_clients"),
    (lambda: privacy.ServerSideFixedClipping(1.0, 1.0, 4, seed=-3), "seed"),
    (lambda: privacy.ServerSideAdaptiveClipping(1.0, 4, target_clipped_quantile=1.5), "target_clipped_quantile"),
    (lambda: privacy.ServerSideAdaptiveClipping(1.0, 4, target_clipped_quantile=-0.1), "target_clipped_quantile"),
    (lambda: privacy.ServerSideAdaptiveClipping(1.0, 4, clip_norm_lr=0.0), "clip_norm_lr"),
    (lambda: privacy.ServerSideAdaptiveClipping(1.0, 4), "clipped_count_stddev"),  # 4/20 = 0.2 < z / 2
    (lambda: privacy.ServerSideAdaptiveClipping(1.0, 40, direction="up"), "direction"),
])
def test_hostile_mechanism_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_release_changes_nothing():
    x = _clients(4, 50)
    params = torch.zeros(50)
    mech = privacy.ServerSideFixedClipping(1.0, 0.5, 4, seed=1)
    opt = server.FedAvg(params, aggregate=mech, backend="cpu")
    with pytest.raises(TypeError, match="weights"):
        opt.step(x, weights=[1, 2, 3, 4])
    with pytest.raises(ValueError):
        opt.step(x[:, :40])
    assert params.abs().sum() == 0 and mech.rounds == 0
    with pytest.raises(TypeError, match="aggregate"):
        server.FedAvg(torch.zeros(3), aggregate="dp")
    mech.clipping_norm = -1.0  # set after construction: checked again at the release, never a silent no-noise round
    with pytest.raises(ValueError, match="clipping_norm"):
        opt.step(x)
    assert params.abs().sum() == 0 and mech.rounds == 0 and "_z" not in repr(mech)


def test_accountant_matches_the_exact_gaussian_dp_curve():
    z, t, delta = 2.0, 50, 1e-5
    mu = math.sqrt(t) / z  # t compositions of the Gaussian mechanism = one of multiplier z / sqrt(t) (Dong et al.)

    def delta_of(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    exact = hi
    pld = privacy.PrivacyAccountant(z, method="pld", delta=delta)
    rdp = privacy.PrivacyAccountant(z, method="rdp", delta=delta)
    pld.step(t)
    rdp.step(t)
    assert pld.epsilon() == pytest.approx(exact, rel=2e-2)
    assert exact <= rdp.epsilon() <= 1.5 * exact  # RDP is an upper bound
    poisson = privacy.PrivacyAccountant(z, sampling="poisson", population_size=1000, num_sampled=10, delta=delta)
    poisson.step(t)
    assert poisson.epsilon() < 0.2 * rdp.epsilon()  # amplification by sampling
    again = privacy.PrivacyAccountant(z, sampling="poisson", population_size=1000, num_sampled=10, delta=delta)
    again.load_state_dict(poisson.state_dict())
    assert again.epsilon() == poisson.epsilon()


def test_mechanism_reports_epsilon_after_each_release():
    acc = privacy.PrivacyAccountant(1.0, sampling="without-replacement", population_size=100, num_sampled=4)
    mech = privacy.ServerSideFixedClipping(1.0, 0.5, 4, accountant=acc)
    eps = [privacy.release(_clients(4, 64), mech, backend="cpu").epsilon for _ in range(3)]
    assert 0 < eps[0] < eps[1] < eps[2] and acc.releases == 3


@pytest.mark.parametrize("bad,match", [
    (dict(noise_multiplier=0.0), "noise_multiplier"), (dict(sampling="random"), "sampling"),
    (dict(sampling="poisson"), "population_size"), (dict(delta=1.0), "delta"), (dict(method="gdp"), "method"),
    (dict(sampling="without-replacement", population_size=10, num_sampled=4, method="pld"), "rdp"),
    (dict(sampling="poisson", population_size=3, num_sampled=4), "exceeds"),
])
def test_hostile_accountant_arguments(bad, match):
    kw = {"noise_multiplier": 1.0, **bad}
    with pytest.raises(ValueError, match=match):
        privacy.PrivacyAccountant(kw.pop("noise_multiplier"), **kw)


def test_batchnorm_statistics_are_not_averaged_unnoised():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    updates = [{k: (torch.randn_like(v) if v.is_floating_point() else v + 1) for k, v in model.state_dict().items()}
               for _ in range(4)]
    opt = server.FedAvg(model, aggregate=privacy.ServerSideFixedClipping(1.0, 0.5, 4, seed=2), backend="cpu")
    with pytest.warns(RuntimeWarning, match="not private"):
        opt.step(updates)
    assert torch.equal(model[1].running_mean, before["1.running_mean"])
    assert torch.equal(model[1].num_batches_tracked, before["1.num_batches_tracked"])
    assert not torch.equal(model[0].weight, before["0.weight"])
    opt = server.FedAvg(model, aggregate=privacy.ServerSideFixedClipping(1.0, 0.5, 4, seed=2), backend="cpu",
                        buffers="optimizer")
    with pytest.warns(RuntimeWarning, match="num_batches_tracked"):  # (the integer counter alone is kept)
        opt.step(updates)  # the running statistics are parameters now: clipped and noised with them
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])


ALL_OPTIMIZERS = {"FedAvg": {}, "FedAvgM": dict(lr=0.5, momentum=0.9), "FedExP": dict(eps=1e-3),
                  "FedExPM": dict(eps=1e-3, beta=0.9), "FedACG": dict(lam=0.85), "FedAdam": dict(lr=0.1),
                  "FedYogi": dict(lr=0.01), "FedAdagrad": dict(lr=0.1), "FedAMS": dict(lr=0.1),
                  "Scaffold": dict(num_clients=8), "ScaffoldExP": dict(num_clients=8, eps=1e-3)}


@pytest.mark.parametrize("name", list(ALL_OPTIMIZERS))
@pytest.mark.parametrize("make", [lambda m: privacy.ServerSideFixedClipping(1.0, 0.05, m, seed=1),
                                  lambda m: privacy.ServerSideAdaptiveClipping(0.5, m, 0.05, clipped_count_stddev=1.0, seed=1),
                                  lambda m: privacy.ClientSideFixedClipping(1.0, 0.05, m, seed=1),
                                  lambda m: privacy.ClientSideAdaptiveClipping(0.5, m, 0.05, clipped_count_stddev=1.0, seed=1)],
                         ids=["server-fixed", "server-adaptive", "client-fixed", "client-adaptive"])
def test_every_mechanism_composes_with_every_server_optimizer(name, make):
    m, d = 4, 200
    params = torch.zeros(d)
    mech = make(m)
    opt = getattr(server, name)(params, aggregate=mech, backend="cpu", **ALL_OPTIMIZERS[name])
    for t in range(3):
        x = _clients(m, d, seed=t)
        st = opt.step(x, torch.zeros(m, d)) if name.startswith("Scaffold") else opt.step(x)
        assert bool(st.finite) and st.robust.round == t and st.robust.noise_std > 0
    assert mech.rounds == 3 and bool(torch.isfinite(params).all()) and float(params.abs().sum()) > 0


def test_the_optimizers_checkpoint_carries_the_mechanism_so_a_restored_server_never_replays_noise():
    x = _clients(4, 300)
    p1 = torch.zeros(300)
    opt = server.FedAdam(p1, lr=0.1, aggregate=privacy.ServerSideAdaptiveClipping(1.0, 4, 0.2, clipped_count_stddev=1.0,
                                                                                  seed=5), backend="cpu")
    opt.step(x)
    opt.step(x)
    ckpt = opt.state_dict()
    p2 = p1.clone()
    mech2 = privacy.ServerSideAdaptiveClipping(1.0, 4, 0.2, clipped_count_stddev=1.0)  # another seed, round 0
    restored = server.FedAdam(p2, lr=0.1, aggregate=mech2, backend="cpu")
    restored.load_state_dict(ckpt)
    assert (mech2.seed, mech2.rounds, mech2.clipping_norm) == (5, 2, opt.aggregate.clipping_norm)
    opt.step(x)
    restored.step(x)
    assert torch.equal(p1, p2)  # the third round's noise, not the first's again
    bad = copy.deepcopy(ckpt)
    bad["fastagg"]["aggregate"]["state"]["rounds"] = -1
    before = (mech2.rounds, restored.state_dict()["state"][0]["m"].clone())
    with pytest.raises(ValueError, match="aggregate state is invalid"):
        restored.load_state_dict(bad)
    assert mech2.rounds == before[0] and torch.equal(restored.state_dict()["state"][0]["m"], before[1])
    other = server.FedAdam(torch.zeros(300), lr=0.1, aggregate=privacy.ServerSideFixedClipping(1.0, 0.2, 4))
    with pytest.raises(ValueError, match="ServerSideAdaptiveClipping"):
        other.load_state_dict(ckpt)


def test_accountant_poisson_rate_is_num_sampled_over_population():
    """Against Opacus's RDP accountant (written apart from dp-accounting) at q = n / N: the same RDP bound to a few
    percent, both ways; a rate of 1 / N (or N / n...) lands far outside."""
    from opacus.accountants import RDPAccountant

    z, n, pop, t = 1.1, 25, 500, 50
    acc = privacy.PrivacyAccountant(z, sampling="poisson", population_size=pop, num_sampled=n)
    acc.step(t)
    theirs = RDPAccountant()
    theirs.history = [(z, n / pop, t)]
    want = theirs.get_epsilon(acc.delta)
    assert 0.95 * want <= acc.epsilon() <= 1.01 * want, (acc.epsilon(), want)


@pytest.mark.parametrize("kw", [{}, dict(sampling="poisson", population_size=300, num_sampled=12),
                                dict(sampling="without-replacement", population_size=300, num_sampled=12),
                                dict(sampling="poisson", population_size=300, num_sampled=12, method="pld")],
                         ids=["none", "poisson", "without-replacement", "poisson-pld"])
def test_accountant_incremental_epsilon_is_the_from_scratch_composition(kw):
    """One release's RDP / PLD is computed once; epsilon after T releases must equal dp-accounting composing the
    event T times in a fresh accountant, exactly, after any sequence of steps (and after a restore)."""
    import dp_accounting as dpa

    acc = privacy.PrivacyAccountant(0.9, **kw)
    rel = dpa.NeighboringRelation.REPLACE_ONE if kw.get("sampling") == "without-replacement" else \
        dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    event = dpa.GaussianDpEvent(0.45 if kw.get("sampling") == "without-replacement" else 0.9)
    if kw.get("sampling") == "poisson":
        event = dpa.PoissonSampledDpEvent(12 / 300, event)
    elif kw.get("sampling") == "without-replacement":
        event = dpa.SampledWithoutReplacementDpEvent(300, 12, event)
    steps = (3,) if kw.get("method") == "pld" else (1, 7, 400)
    for t in steps:
        acc.step(t - acc.releases)
        fresh = (dpa.pld.PLDAccountant(rel) if kw.get("method") == "pld" else dpa.rdp.RdpAccountant(
            neighboring_relation=rel)).compose(event, t)
        assert acc.epsilon() == fresh.get_epsilon(acc.delta), t
        assert acc.epsilon(1e-3) == fresh.get_epsilon(1e-3), t
    again = privacy.PrivacyAccountant(0.9, **kw)  # (a state restores into an accountant of its configuration)
    again.load_state_dict(acc.state_dict())
    assert again.epsilon() == acc.epsilon() and again.releases == steps[-1]


@pytest.mark.parametrize("delta", [1, 1.0, 2.0, float("nan"), 0.0, -1e-5, "1e-5", None])
def test_accountant_epsilon_refuses_a_delta_outside_0_1(delta):
    acc = privacy.PrivacyAccountant(1.0)
    acc.step(3)
    if delta is None:
        assert acc.epsilon(None) > 0  # (None: the accountant's own delta)
        return
    with pytest.raises(ValueError, match="delta"):
        acc.epsilon(delta)
    assert acc.releases == 3


def test_mechanism_refuses_an_accountant_of_another_noise_or_sample_size():
    ok = privacy.PrivacyAccountant(1.0, sampling="without-replacement", population_size=100, num_sampled=4)
    with pytest.raises(ValueError, match="noise multiplier"):  # no noise at all, an accountant of z = 1
        privacy.ServerSideFixedClipping(0.0, 0.5, 4, accountant=ok)
    with pytest.raises(ValueError, match="num_sampled"):
        privacy.ServerSideFixedClipping(1.0, 0.5, 8, accountant=ok)
    with pytest.raises(TypeError, match="PrivacyAccountant"):
        privacy.ServerSideFixedClipping(1.0, 0.5, 4, accountant=object())
    # set after the constructor (as the simulator does): checked at the release, before anything changes
    x = _clients(4, 64)
    mech = privacy.ServerSideAdaptiveClipping(0.5, 4, 0.2, clipped_count_stddev=1.0, seed=1)
    mech.accountant = ok
    params = torch.zeros(64)
    opt = server.FedAvg(params, aggregate=mech, backend="cpu")
    with pytest.raises(ValueError, match="noise multiplier 1.0"):
        opt.step(x)
    assert mech.rounds == 0 and mech.clipping_norm == 0.2 and ok.releases == 0 and params.abs().sum() == 0
    mech.accountant = privacy.PrivacyAccountant.for_mechanism(mech, sampling="without-replacement",
                                                              population_size=100)
    assert mech.accountant.noise_multiplier == 0.5 and mech.accountant.num_sampled == 4
    assert opt.step(x).robust.epsilon > 0 and mech.accountant.releases == 1


def test_adaptive_norm_stays_bounded_with_few_replies_and_its_state_is_checked():
    """Two replies against num_sampled_clients = 400 (count std 20): the noised fraction swings by +-10^4 %; the
    norm must stay finite and positive within its bounds, and every release go through."""
    x = _clients(2, 16)
    for direction in ("paper", "flower"):
        mech = privacy.ServerSideAdaptiveClipping(1.0, 400, 0.1, clip_norm_lr=0.5, seed=3, direction=direction)
        norms = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (2 replies against 400: warned once a round)
            for _ in range(30):
                norms.append(privacy.release(x, mech, backend="cpu").next_clipping_norm)
        assert all(1e-7 <= c <= 1e5 for c in norms), (min(norms), max(norms))
        steps = [b / a for a, b in zip(norms, norms[1:])]
        assert all(math.exp(-0.5) * (1 - 1e-12) <= s <= math.exp(0.5) * (1 + 1e-12) for s in steps)  # (f in [0, 1])
        assert mech.norm_bounds == (0.1 / 1e6, 0.1 * 1e6)
    # a restored state is checked before anything changes
    mech = privacy.ServerSideAdaptiveClipping(1.0, 40, 0.1, seed=3)
    before = mech.state_dict()
    for bad, match in ((dict(rounds=1 << 63), "2\\^63"), (dict(rounds=(1 << 64) + 5), "2\\^63"),
                       (dict(clipping_norm=1e9), "norm_bounds"), (dict(clipping_norm=float("inf")), "clipping_norm")):
        with pytest.raises(ValueError, match=match):
            mech.load_state_dict({**before, **bad})
        assert mech.state_dict() == before
    mech.rounds = 1 << 63  # set directly: the release refuses it (the count query's stream), nothing changes
    with pytest.raises(ValueError, match="rounds"):
        privacy.release(_clients(40, 16), mech, backend="cpu")
    assert mech.rounds == 1 << 63 and mech.clipping_norm == 0.1
    with pytest.raises(ValueError, match="norm_bounds"):
        privacy.ServerSideAdaptiveClipping(1.0, 40, 0.1, norm_bounds=(0.5, 1.0))


# -- the reviewer's findings: the sensitivity the accountant assumes, the accountant restored with the mechanism --
def _accounted(make, sampling, n, seed=11):
    """A mechanism from ``make(accountant)`` with an accountant of ``sampling`` (its noise multiplier 1)."""
    acc = privacy.PrivacyAccountant(1.0, sampling=sampling, population_size=None if sampling == "none" else 1000,
                                    num_sampled=None if sampling == "none" else n)
    return make(acc), acc


ACCOUNTED = {
    "server-fixed": lambda acc, **kw: privacy.ServerSideFixedClipping(1.0, 0.5, 10, seed=11, accountant=acc, **kw),
    "client-fixed": lambda acc, **kw: privacy.ClientSideFixedClipping(1.0, 0.5, 10, seed=11, accountant=acc, **kw),
    "server-adaptive": lambda acc, **kw: privacy.ServerSideAdaptiveClipping(
        1.0, 10, 0.5, clipped_count_stddev=5.0, seed=11, accountant=acc, **kw),
    "client-adaptive": lambda acc, **kw: privacy.ClientSideAdaptiveClipping(
        1.0, 10, 0.5, clipped_count_stddev=5.0, seed=11, accountant=acc, **kw),
}


@pytest.mark.parametrize("sampling", ["poisson", "none"])
@pytest.mark.parametrize("kind", list(ACCOUNTED))
def test_an_added_client_moves_an_accounted_release_by_at_most_what_the_accountant_assumes(kind, sampling):
    """The oracle is the definition: under add-or-remove-one neighbours the accountant composes a Gaussian of
    std / sensitivity = ``event_noise_multiplier``. The pair: ``M`` clients sending ``+C e`` (D) and the same with
    one more sending ``-C e`` (D'); both released at the same seed and round, so the noise cancels and the
    difference is the release's shift on that pair. Dividing by the replies it is ``2 C / (M + 1)`` (0.09 at
    C = 0.5, M = 10, twice the ``C / n = 0.05`` the noise of std ``z C / n`` is calibrated to); with the fixed
    denominator n it is ``C / n`` for every ``M`` (Poisson sampling makes ``M`` random)."""
    d, c, n = 8, 0.5, 10
    e = torch.zeros(d, dtype=torch.float64)
    e[0] = 1.0
    for m in (4, 10, 13):
        a, acc_a = _accounted(ACCOUNTED[kind], sampling, n)
        b, acc_b = _accounted(ACCOUNTED[kind], sampling, n)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (a round of m != n replies is expected under Poisson: no warning)
            ra = privacy.release([c * e] * m, a, backend="reference")
            rb = privacy.release([c * e] * m + [-c * e], b, backend="reference")
        assert ra.noise_std == rb.noise_std > 0
        shift = float((ra.estimate - rb.estimate).norm())
        assumed = ra.noise_std / acc_a.event_noise_multiplier  # the sensitivity the accountant's epsilon holds for
        assert shift <= assumed * (1 + 1e-9), (m, shift, assumed)
        assert shift == pytest.approx(c / n, rel=1e-9)  # the bound is attained (the pair is the worst case)
        if ra.noisy_clipped_fraction is not None:  # the count query: (count + N(0, sigma_b^2)) / n, sensitivity 1 / n
            moved = abs(ra.noisy_clipped_fraction - rb.noisy_clipped_fraction)
            assert moved <= 1 / n + 1e-12, (m, moved)
        assert acc_a.releases == acc_b.releases == 1


def test_dividing_by_the_replies_is_flowers_and_refused_where_an_accountant_cannot_hold():
    x = _clients(6, 40, dtype=torch.float64)
    mean, _ = _clipped_mean(x, 0.5)
    # no accountant: Flower's numbers (the mean over the 6 replies; num_sampled_clients=8 is warned about)
    flower = privacy.ServerSideFixedClipping(1e-12, 0.5, 8, seed=2)
    with pytest.warns(RuntimeWarning, match="num_sampled_clients"):
        got = privacy.release(x, flower, backend="reference").estimate
    torch.testing.assert_close(got, mean, rtol=1e-9, atol=1e-9)
    assert not flower.divides_by_expected()
    # the fixed denominator asked for without an accountant: the sum over num_sampled_clients = 8
    fixed = privacy.ServerSideFixedClipping(1e-12, 0.5, 8, seed=2, denominator="expected")
    torch.testing.assert_close(privacy.release(x, fixed, backend="reference").estimate, mean * 6 / 8,
                               rtol=1e-9, atol=1e-9)
    for sampling in ("poisson", "none"):
        with pytest.raises(ValueError, match="denominator='expected'"):
            _accounted(lambda acc: privacy.ServerSideFixedClipping(1.0, 0.5, 8, accountant=acc,
                                                                   denominator="replies"), sampling, 8)
    with pytest.raises(ValueError, match="weighted"):
        _accounted(lambda acc: privacy.ServerSideFixedClipping(1.0, 0.5, 8, accountant=acc, weighted=True),
                   "poisson", 8)
    with pytest.raises(ValueError, match="denominator"):
        privacy.ServerSideFixedClipping(1.0, 0.5, 8, denominator="actual")
    # replace-one (a fixed-size sample): dividing by the replies holds for exactly n of them, else refused
    mech, acc = _accounted(lambda acc: privacy.ServerSideFixedClipping(1.0, 0.5, 6, seed=2, accountant=acc,
                                                                       denominator="replies"),
                           "without-replacement", 6)
    assert privacy.release(x, mech, backend="reference").epsilon > 0
    with pytest.raises(ValueError, match="5 clients replied"):
        privacy.release(x[:5], mech, backend="reference")
    assert mech.rounds == 1 and acc.releases == 1


def test_the_optimizers_checkpoint_restores_the_accountant_with_the_mechanism():
    """torch.optim's way (opt.load_state_dict) into a freshly built optimizer, mechanism and accountant: the
    accountant continues from the releases made (its epsilon is that of 4 releases after the 4th round, not 1)."""
    def build():
        acc = privacy.PrivacyAccountant(1.0, sampling="poisson", population_size=1000, num_sampled=4)
        mech = privacy.ServerSideFixedClipping(1.0, 0.5, 4, seed=3, accountant=acc)
        return server.FedAdam(torch.zeros(30), lr=0.1, aggregate=mech, backend="cpu"), mech, acc

    x = _clients(4, 30)
    opt, mech, acc = build()
    for _ in range(3):
        opt.step(x)
    ckpt = opt.state_dict()
    opt2, mech2, acc2 = build()
    opt2.load_state_dict(ckpt)
    assert (mech2.rounds, acc2.releases) == (3, 3)
    ref = privacy.PrivacyAccountant(1.0, sampling="poisson", population_size=1000, num_sampled=4)
    ref.step(4)
    assert opt2.step(x).robust.epsilon == ref.epsilon() == opt.step(x).robust.epsilon
    # a checkpoint whose accountant is of another configuration is refused, nothing changes (checked on a copy)
    bad = copy.deepcopy(ckpt)
    bad["fastagg"]["aggregate"]["state"]["accountant"]["population_size"] = 10 ** 19
    opt3, mech3, acc3 = build()
    with pytest.raises(ValueError, match="population_size"):
        opt3.load_state_dict(bad)
    assert (mech3.rounds, acc3.releases, acc3.population_size) == (0, 0, 1000)
    copy.copy(mech3).load_state_dict(ckpt["fastagg"]["aggregate"]["state"])  # a check on a copy...
    assert (mech3.rounds, acc3.releases) == (0, 0)  # ...leaves the original's accountant alone


def test_a_mechanism_ahead_of_its_accountant_steps_it_up_with_a_warning():
    """Mismatched checkpoints (the mechanism's of 30 releases, the accountant's older, or none restored): at the
    next release the accountant composes every release made, never fewer."""
    x = _clients(4, 30)
    acc = privacy.PrivacyAccountant(1.0, sampling="poisson", population_size=100, num_sampled=4)
    mech = privacy.ServerSideFixedClipping(1.0, 0.5, 4, seed=0, accountant=acc)
    mech.load_state_dict({"seed": 0, "rounds": 30, "clipping_norm": 0.5})  # (no accountant in it: an older one)
    with pytest.warns(RuntimeWarning, match="made 30 releases.*composed 0"):
        eps = privacy.release(x, mech, backend="cpu").epsilon
    ref = privacy.PrivacyAccountant(1.0, sampling="poisson", population_size=100, num_sampled=4)
    ref.step(31)
    assert acc.releases == 31 and eps == ref.epsilon()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # in step again: no warning
        privacy.release(x, mech, backend="cpu")
    assert acc.releases == 32


@pytest.mark.parametrize("z,error", [("1", TypeError), (True, TypeError), (None, TypeError), (1e300, ValueError),
                                     (float("inf"), ValueError), (-1.0, ValueError)])
def test_accountant_refuses_a_noise_multiplier_of_another_type_or_range(z, error):
    with pytest.raises(error, match="noise_multiplier"):
        privacy.PrivacyAccountant(z, sampling="poisson", population_size=100, num_sampled=2)


@pytest.mark.parametrize("key,value", [("noise_multiplier", "3"), ("noise_multiplier", True),
                                       ("noise_multiplier", 2.0), ("population_size", 10 ** 19),
                                       ("population_size", 100.0), ("num_sampled", 11), ("sampling", "none"),
                                       ("method", "pld"), ("delta", 0.5), ("releases", -3), ("releases", 2 ** 70),
                                       ("releases", 3.0), ("releases", True), ("extra", 1)])
def test_accountant_load_state_dict_refuses_another_configuration(key, value):
    acc = privacy.PrivacyAccountant(1.0, sampling="poisson", population_size=100, num_sampled=10)
    acc.step(50)
    state = {**acc.state_dict(), key: value}
    other = privacy.PrivacyAccountant(1.0, sampling="poisson", population_size=100, num_sampled=10)
    other.step(2)
    before = (other.state_dict(), other.epsilon())
    with pytest.raises(ValueError, match=key):
        other.load_state_dict(state)
    assert (other.state_dict(), other.epsilon()) == before
    other.load_state_dict(acc.state_dict())
    assert other.epsilon() == acc.epsilon() and other.releases == 50


def test_release_takes_compressed_updates_as_their_dequantized_rows():
    """privacy.release takes what fastagg.fedexp_step takes, compressed updates included (a TypeError before): the
    release of int8 clients is the release of their dequantized values (x_j = s_b q_j, written from the format's
    definition) under the same mechanism state, bit for bit; a client no quantizer writes (code -128) is left out
    as a non-finite one; base= does not apply to them."""
    from fastagg.compress import Int8Blockwise, quantize_int8

    g = torch.Generator().manual_seed(5)
    d, block = 32, 8
    updates = [quantize_int8(0.05 * torch.randn(d, generator=g), block=block) for _ in range(4)]
    dense = [torch.from_numpy(u.codes.double().numpy() * np.repeat(u.scales.double().numpy(), block)[:d]).float()
             for u in updates]
    bad = Int8Blockwise(torch.full((d,), -128, dtype=torch.int8), torch.ones(d // block), block)
    a = privacy.ServerSideFixedClipping(1.0, 0.1, 5, seed=11)
    b = privacy.ServerSideFixedClipping(1.0, 0.1, 5, seed=11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (4 finite replies where 5 were sampled: Flower's warning)
        ra = privacy.release(updates + [bad], a)
        rb = privacy.release(dense + [torch.full((d,), float("nan"))], b)
    assert torch.equal(ra.estimate, rb.estimate) and ra.noise_std == rb.noise_std > 0
    assert ra.excluded.tolist() == rb.excluded.tolist() == [False] * 4 + [True]
    with pytest.raises(TypeError, match="base="):
        privacy.release(updates, privacy.ServerSideFixedClipping(1.0, 0.1, 4, seed=1), base=torch.zeros(d))


@pytest.mark.parametrize("make", [lambda c, m: privacy.ServerSideFixedClipping(1.0, c, m, seed=2),
                                  lambda c, m: privacy.ClientSideFixedClipping(1.0, c, m, seed=2)],
                         ids=["server", "client"])
@pytest.mark.parametrize("clip", [False, True])
def test_a_release_reads_the_host_once(make, clip):
    """One host read a release (a sync on a GPU, which leaves the device idle until the host launches again): the
    non-finite flags (client-side with the clipped flags), read after the server-side clipped sum was launched.
    Counted as the mechanism's own calls of the tensor methods that read values to the host."""
    import fastagg.privacy.mechanisms as mechanisms_mod

    m, d = 6, 700
    x = _clients(m, d, seed=9)
    c = float(x.double().norm(dim=1).median()) if clip else 10.0
    reads = []
    names = ("tolist", "item", "__bool__", "__float__", "__int__", "nonzero", "cpu", "numpy")
    originals = {n: getattr(torch.Tensor, n) for n in names}

    def counted(name):
        def read(self, *a, **k):
            import sys
            if sys._getframe(1).f_code.co_filename == mechanisms_mod.__file__:
                reads.append(name)
            return originals[name](self, *a, **k)
        return read

    try:
        for n in names:
            setattr(torch.Tensor, n, counted(n))
        r = privacy.release(x, make(c, m), backend="reference")
    finally:
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)
    assert bool(r.clipped.any()) == clip
    assert reads == ["tolist"]
