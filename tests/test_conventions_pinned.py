"""Conventions pinned on inputs where they differ (the mutation run of tools/mutation found them unpinned: the
oracle inputs had odd M, beta * M whose rounding modes agree, vectors whose QSGD levels never reach s). Each oracle
is the definition or a peer library, never fastagg itself."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastagg import robust
from fastagg.compress import quantize_qsgd, quantize_qsgd_rows
from fastagg.testing import cpu_backends


def _columns(m: int, d: int = 7, seed: int = 0) -> torch.Tensor:
    """m clients whose sorted values differ at every rank of every coordinate (the two middles never tie)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, d, generator=g, dtype=torch.float64) * 3


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("m", [2, 4, 6, 5])
def test_median_even_conventions_on_even_and_odd_counts(backend, m):
    """even='lower' is torch.median's convention (the lower middle), even='mean' numpy's and Flower's FedMedian's
    (the mean of the two middles); with an odd count both are the middle value."""
    x = _columns(m)
    lower = robust.aggregate(x, robust.Median(even="lower"), backend=backend).estimate.double()
    mean = robust.aggregate(x, robust.Median(even="mean"), backend=backend).estimate.double()
    torch.testing.assert_close(lower, torch.median(x, dim=0).values, rtol=0, atol=1e-12)
    torch.testing.assert_close(mean, torch.from_numpy(np.median(x.numpy(), axis=0)), rtol=1e-12, atol=1e-12)
    if m % 2 == 0:  # the conventions differ here: each is below the upper middle by a margin
        upper = torch.sort(x, dim=0).values[m // 2]
        assert bool((lower < upper - 1e-9).all()) and bool((mean < upper - 1e-9).all())
        assert bool((lower < mean - 1e-9).all())


@pytest.mark.parametrize("beta, m", [(0.27, 10), (0.25, 6), (0.2, 11), (0.45, 9)])
def test_trimmed_mean_cuts_int_beta_m_as_scipy_and_flower(beta, m):
    """beta * M = 2.7, 1.5, 2.2, 4.05: int(), round() and ceil() cut different counts on the first two; scipy's
    trim_mean (and Flower's FedTrimmedAvg) cut int(beta * M) from each end."""
    stats = pytest.importorskip("scipy.stats")
    x = _columns(m, d=9, seed=m)
    got = robust.aggregate(x, robust.TrimmedMean(beta), backend="reference").estimate.double()
    want = torch.from_numpy(stats.trim_mean(x.numpy(), beta, axis=0))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("s", [1, 3, 16, 127])
def test_qsgd_reaches_level_s_where_the_paper_puts_it(s):
    """QSGD's levels lie in [0, s] (Alistarh et al., Sec. 3.1): a coordinate holding the whole norm has
    |x_j| / (||x|| / s) = s exactly and must decode to x_j whatever the uniform draw (no level above s, none
    clamped below it)."""
    x = torch.zeros(40, dtype=torch.float64)
    x[7] = -2.5
    for client in range(5):
        deq = quantize_qsgd(x, s, client=client).dequantize().double()
        torch.testing.assert_close(deq, x, rtol=1e-6, atol=0.0)


def test_qsgd_is_unbiased_on_coordinates_near_the_top_level():
    """E[x~] = x (the paper's Lemma 3.1), checked over 4000 keyed draws on a vector whose big coordinates sit
    between levels s - 1 and s (where a level clamped to s - 1 biases them by up to a level); the bound is five
    standard errors of each coordinate's mean (the level variance is at most 1/4 of a level squared)."""
    s = 4
    x = torch.tensor([0.9, -0.95, 0.2, 0.0, -0.05, 0.3], dtype=torch.float64)
    reps = 4000
    rows = x.repeat(reps, 1)
    deq = torch.stack([u.dequantize().double() for u in quantize_qsgd_rows(rows, s, seed=11)])
    mean = deq.mean(0)
    level = float(x.norm()) / s
    se = 0.5 * level / reps ** 0.5
    assert bool(((mean - x).abs() <= 5 * se).all()), (mean - x) / se


def test_fedexp_step_eval_model_is_the_average_of_the_last_two_iterates():
    """FedExP (Jhunjhunwala et al., ICLR 2023, Sec. 4) evaluates the average of the last two iterates,
    (w_t + w_{t+1}) / 2, with w_{t+1} = w_t + eta mean and eta = max(1, sum_i p_i ||d_i||^2 / (2 (||mean||^2 + eps)))
    (eq. 9): written out here, on clients whose mean nearly cancels (eta well above 1)."""
    import fastagg

    g = torch.Generator().manual_seed(3)
    d = torch.randn(6, 11, generator=g, dtype=torch.float64)
    d = d - 0.9 * d.mean(0)  # a short mean: eta ~ 1 / (2 * 0.1^2) / ...
    w0 = torch.randn(11, generator=g, dtype=torch.float64)
    mean = d.mean(0)
    eta = max(1.0, float((d * d).sum(1).mean()) / (2 * (float(mean @ mean) + 1e-3)))
    assert eta > 2
    w1 = w0 + eta * mean
    for backend in cpu_backends():
        w = w0.clone()
        res = fastagg.fedexp_step(d, eps=1e-3, params=w, backend=backend)
        assert float(res.eta) == pytest.approx(eta, rel=1e-12)
        torch.testing.assert_close(w, w1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res.eval_params.double(), (w0 + w1) / 2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pop, n", [(1000, 50), (200, 40)])
def test_poisson_accountant_rate_is_num_sampled_over_population(pop, n):
    """Poisson sampling at rate q = num_sampled / population (McMahan et al. 2018): fastagg's RDP epsilon against
    Opacus's RDP accountant (an independent implementation) at that q, within 10% both ways; a rate of
    1 / population gives an epsilon several times smaller."""
    pytest.importorskip("dp_accounting")
    opacus = pytest.importorskip("opacus.accountants")
    import warnings

    from fastagg.privacy import PrivacyAccountant

    z, t, delta = 1.0, 100, 1e-5
    acc = PrivacyAccountant(z, sampling="poisson", population_size=pop, num_sampled=n, method="rdp")
    acc.step(t)
    ref = opacus.RDPAccountant()
    ref.history = [(z, n / pop, t)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = float(ref.get_epsilon(delta))
    got = acc.epsilon(delta)
    assert 0.9 * want <= got <= 1.1 * want, (got, want)


def test_accountant_default_delta_is_the_documented_population_power():
    """The default delta is 1 / population^1.1 (PrivacyAccountant's docstring; README and docs/PRIVACY.md report
    epsilons at it): below 1 / population, the level at which leaking one client's data outright is allowed."""
    pytest.importorskip("dp_accounting")
    from fastagg.privacy import PrivacyAccountant

    for pop in (50, 1000):
        acc = PrivacyAccountant(1.0, sampling="poisson", population_size=pop, num_sampled=10)
        assert acc.delta == pytest.approx(pop ** -1.1, rel=1e-12) and acc.delta < 1 / pop
    assert PrivacyAccountant(1.0).delta == 1e-5


@pytest.mark.parametrize("backend", cpu_backends())
def test_an_update_of_norm_exactly_c_is_not_clipped(backend):
    """min(1, C / ||d||) < 1 only for ||d|| > C: an update of norm exactly C (3-4-5, exact in float32) is neither
    scaled nor counted as clipped, as Flower 1.42's adaptive_clip_inputs_inplace reports it (its norm_bit is
    scaling_factor < 1); one a float32 step longer is. The count is what adaptive clipping moves C with."""
    sup = pytest.importorskip("flwr.supercore.differential_privacy")
    from fastagg import privacy

    c = 5.0
    x = torch.zeros(4, 6)
    x[0, :2] = torch.tensor([3.0, 4.0])                      # norm exactly C
    x[1, :2] = torch.tensor([3.0, torch.nextafter(torch.tensor(4.0), torch.tensor(5.0)).item()])  # just above
    x[2, :2] = torch.tensor([0.3, 0.4])                      # well inside
    x[3, :2] = torch.tensor([6.0, 8.0])                      # twice C
    want = [sup.adaptive_clip_inputs_inplace([row.numpy().astype(np.float64).copy()], c) for row in x]
    assert want == [False, True, False, True]
    r = privacy.release(x, privacy.ServerSideFixedClipping(0.0, c, 4, seed=0), backend=backend)
    assert r.clipped.tolist() == want
    torch.testing.assert_close(r.estimate.double(), torch.stack([x[0], x[1] * (c / x[1].double().norm()).float(),
                                                                 x[2], x[3] / 2]).double().mean(0),
                               rtol=1e-6, atol=1e-7)


def test_client_side_adaptive_counts_the_clients_that_clipped_without_their_bits():
    """Clients clip with Flower 1.42's adaptive_clip_inputs_inplace (float64, in place) and send the float32 result
    without norm bits: the server must count exactly the clients whose norm_bit Flower returned (their clipped
    norms land on C up to float32 rounding, either side of it), so the next C is C exp(lr (count / M - q))
    (Andrew et al.; zero noise here, so the fraction is the count's)."""
    sup = pytest.importorskip("flwr.supercore.differential_privacy")
    from fastagg import privacy

    c, lr, q = 0.7, 0.2, 0.5
    g = np.random.default_rng(5)
    sent, bits = [], []
    for k in range(9):
        raw = g.standard_normal(33) * (0.03 if k % 3 == 0 else 1.0 + k)  # every third inside C, the rest clipped
        bits.append(bool(sup.adaptive_clip_inputs_inplace([raw], c)))
        sent.append(torch.from_numpy(raw).float())
    assert 0 < sum(bits) < len(bits)
    mech = privacy.ClientSideAdaptiveClipping(0.0, len(sent), initial_clipping_norm=c, target_clipped_quantile=q,
                                              clip_norm_lr=lr, seed=0)
    r = privacy.release(torch.stack(sent), mech, backend="reference")
    assert r.noisy_clipped_fraction == pytest.approx(sum(bits) / len(bits), abs=1e-12)
    assert r.next_clipping_norm == pytest.approx(c * np.exp(lr * (sum(bits) / len(bits) - q)), rel=1e-12)


def test_adaptive_count_noise_is_independent_of_the_update_noise():
    """Andrew et al.'s two queries (the clipped count, the clipped sum) each get noise of their own: were the
    count's sample the update noise's first coordinate, the released count would reveal it. Over 300 seeds, the
    count noise recovered from the noised fraction and the first coordinate of the update noise (all-zero updates:
    the estimate is the noise) are uncorrelated (|r| < 0.3, about 5 standard errors)."""
    from fastagg import privacy

    m, z = 4, 1.0
    counts, firsts = [], []
    for seed in range(300):
        mech = privacy.ServerSideAdaptiveClipping(z, m, initial_clipping_norm=1.0, clipped_count_stddev=2.0,
                                                  seed=seed)
        r = privacy.release(torch.zeros(m, 3), mech, backend="reference")
        counts.append(r.noisy_clipped_fraction * m / mech.clipped_count_stddev)  # count 0: the noise sample
        firsts.append(float(r.estimate[0]) / r.noise_std)
    corr = float(np.corrcoef(counts, firsts)[0, 1])
    assert abs(corr) < 0.3, corr
    assert 0.7 < float(np.std(counts)) < 1.3  # the recovered count noise is N(0, 1)
