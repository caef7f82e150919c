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
    from scipy import stats  # a test requirement ([test]): a missing one fails, never skips
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
    from opacus import accountants as opacus  # a test requirement ([test]): a missing one fails, never skips
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
    from flwr.supercore import differential_privacy as sup  # a test requirement ([test]): a missing one fails, never skips
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
    from flwr.supercore import differential_privacy as sup  # a test requirement ([test]): a missing one fails, never skips
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


def test_multikrum_selects_m_minus_f_by_default():
    """Multi-Krum's default selection is m = n - f (El Mhamdi et al., ICML 2018, Sec. 3, as fastagg's MultiKrum
    documents; Flower's MultiKrum asks for num_nodes_to_select): the mean of the n - f updates of lowest Krum score
    (the sum of squared distances to the n - f - 2 nearest others, Blanchard et al.), scored here in numpy."""
    g = np.random.default_rng(2)
    n, f = 9, 2
    x = g.standard_normal((n, 5))
    x[3] += 8.0
    x[6] -= 5.0
    d2 = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    scores = [np.sort(np.delete(d2[i], i))[: n - f - 2].sum() for i in range(n)]
    keep = np.argsort(scores, kind="stable")[: n - f]
    res = robust.aggregate(torch.from_numpy(x), robust.MultiKrum(f), backend="reference")
    assert sorted(np.flatnonzero(res.selected.numpy()).tolist()) == sorted(keep.tolist())
    torch.testing.assert_close(res.estimate.double(), torch.from_numpy(x[keep].mean(0)), rtol=1e-12, atol=1e-12)


def test_bulyan_needs_4f_plus_3_clients():
    """Bulyan's requirement n >= 4f + 3 (El Mhamdi et al., ICML 2018, Sec. 4): 4f + 2 clients are refused naming
    the bound, 4f + 3 aggregate."""
    for f in (1, 2):
        x = _columns(4 * f + 3, d=4, seed=f)
        with pytest.raises(robust.TooFewClients, match=f"M >= 4 num_malicious \\+ 3 = {4 * f + 3}"):
            robust.aggregate(x[: 4 * f + 2], robust.Bulyan(f), backend="reference")
        assert robust.aggregate(x, robust.Bulyan(f), backend="reference").selected.sum() == 4 * f + 3 - 2 * f


@pytest.mark.parametrize("backend", cpu_backends())
def test_normbound_leaves_short_updates_as_they_are(backend):
    """NormBound (Sun et al., 2019): est = sum_i p_i min(1, C / ||d_i||) d_i -- updates shorter than C are not
    lengthened to C (numpy here)."""
    g = np.random.default_rng(4)
    x = g.standard_normal((5, 8))
    x[:3] *= 0.05  # norms ~0.14, under C
    c = 1.0
    norms = np.linalg.norm(x, axis=1)
    assert (norms[:3] < c).all() and (norms[3:] > c).all()
    want = (np.minimum(1.0, c / norms)[:, None] * x).mean(0)
    res = robust.aggregate(torch.from_numpy(x), robust.NormBound(c), backend=backend)
    torch.testing.assert_close(res.estimate.double(), torch.from_numpy(want), rtol=1e-10, atol=1e-12)
    assert res.clipped == 2


def test_fedexp_on_a_robust_selection_averages_the_selected_norms():
    """FedExP on MultiKrum's estimate: eta = max(1, avg / (2 (||est||^2 + eps))) with avg the mean of the SELECTED
    clients' squared norms (the weights renormalized over them: eq. 9 over the clients that entered the estimate),
    written out in numpy with the Krum scores of Blanchard et al."""
    from fastagg import server

    g = np.random.default_rng(7)
    n, f, eps = 9, 2, 1e-3
    x = g.standard_normal((n, 6))
    x -= 0.95 * x.mean(0)  # a short mean: eta well above 1
    x[5] += 6.0
    d2 = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    scores = [np.sort(np.delete(d2[i], i))[: n - f - 2].sum() for i in range(n)]
    keep = np.argsort(scores, kind="stable")[: n - f]
    mean = x[keep].mean(0)
    eta = max(1.0, float((x[keep] ** 2).sum(1).mean()) / (2 * (float(mean @ mean) + eps)))
    assert eta > 2
    w = torch.zeros(6, dtype=torch.float64)
    st = server.FedExP(w, eps=eps, aggregate=robust.MultiKrum(f), backend="reference").step(torch.from_numpy(x))
    assert float(st.eta) == pytest.approx(eta, rel=1e-10)
    torch.testing.assert_close(w, torch.from_numpy(eta * mean), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_int8_blockwise_is_its_definition_on_every_path(backend):
    """int8 blockwise absmax (the module's definition): s_b = float32(max |x_j| / 127), q_j = round-half-even(x_j
    / s_b); the block's absmax element gets the code +-127. Written out in numpy, for the torch definition path
    (backend="reference") and the fused one."""
    from fastagg.compress import quantize_int8_rows

    g = np.random.default_rng(9)
    x = (g.standard_normal((3, 10)) * [[1.0], [1e-3], [50.0]]).astype(np.float32)
    block = 4
    got = quantize_int8_rows(torch.from_numpy(x), block, backend=backend)
    for row, u in zip(x, got):
        pad = np.zeros(-(-row.size // block) * block)
        pad[:row.size] = row
        tiles = pad.reshape(-1, block)
        scales = (np.abs(tiles).max(1) / 127.0).astype(np.float32)
        codes = np.round(tiles / scales.astype(np.float64)[:, None]).reshape(-1)[:row.size]
        np.testing.assert_array_equal(u.scales.numpy(), scales)
        np.testing.assert_array_equal(u.codes.numpy().astype(np.float64), codes)
        assert np.abs(u.codes.numpy()).max() == 127


@pytest.mark.parametrize("d, fraction", [(7, 0.3), (10, 0.25), (1000, 0.0001), (9, 1.0)])
def test_sparsify_keeps_ceil_fraction_d_entries_at_least_one(d, fraction):
    """fraction= keeps k = ceil(fraction * d) entries, at least 1 (fastagg.compress.sparse's definition; 2.1 -> 3,
    2.5 -> 3, 0.1 -> 1): top-k the k largest magnitudes (numpy here), rand-k k distinct ones."""
    import math

    from fastagg.compress import sparsify_randk, sparsify_topk

    g = np.random.default_rng(d)
    x = g.permutation(np.arange(1, d + 1, dtype=np.float32)) * g.choice([-1, 1], d)
    k = max(1, math.ceil(fraction * d))
    top = sparsify_topk(torch.from_numpy(x), fraction)
    assert sorted(top.indices.tolist()) == sorted(np.argsort(-np.abs(x), kind="stable")[:k].tolist())
    rand = sparsify_randk(torch.from_numpy(x), fraction, seed=1)
    assert rand.indices.numel() == k == len(set(rand.indices.tolist()))


def test_fedasync_hinge_is_flat_up_to_and_including_b():
    """FedAsync's hinge (Xie, Koyejo, Gupta 2019, Sec. 5.2): s(t - tau) = 1 if t - tau <= b, else
    1 / (a (t - tau - b) + 1)."""
    from fastagg.asynchronous import Hinge

    for a, b in ((10.0, 4), (0.5, 0), (3.0, 2)):
        h = Hinge(a, b)
        for s in range(b + 6):
            want = 1.0 if s <= b else 1.0 / (a * (s - b) + 1.0)
            assert h(s) == pytest.approx(want, rel=1e-15), (a, b, s)


def test_adds_that_arrive_during_round_stats_wait_for_it():
    """Accumulator.round_stats holds the accumulator's lock for its pass: two adds from other threads while the
    pass runs (the second would fold into the buffer the pass reads) wait, so the statistics are those of the
    clients folded before it -- their mean written out here -- and the adds land afterwards."""
    import threading

    import fastagg
    from fastagg.backends import resolve

    g = torch.Generator().manual_seed(8)
    ds = [torch.randn(50, generator=g, dtype=torch.float64) for _ in range(4)]
    acc = fastagg.Accumulator(like=torch.zeros(50, dtype=torch.float64), backend="cpu")
    acc.add_many(ds[:2])
    inner = resolve("cpu", torch.device("cpu"))
    threads = []

    class Racing:
        def __getattr__(self, name):
            return getattr(inner, name)

        def round_stats(self, **kw):
            for d in ds[2:]:
                threads.append(threading.Thread(target=acc.add, args=(d,)))
                threads[-1].start()
                threads[-1].join(0.3)  # (they wait for the lock round_stats holds)
            return inner.round_stats(**kw)

    stats = acc.round_stats(lambda device: Racing())
    mean = stats.mean.clone()
    for t in threads:
        t.join(10)
    torch.testing.assert_close(mean, (ds[0] + ds[1]) / 2, rtol=1e-12, atol=1e-12)
    assert acc.num_clients == 4


def test_a_merged_accumulator_is_the_weighted_mean_of_both_sets_of_clients():
    """Hierarchical aggregation: edge accumulators merged at the root give the weighted mean over every client,
    sum_i n_i d_i / sum_i n_i (written out here), and the total weight of both."""
    import fastagg

    g = torch.Generator().manual_seed(6)
    ds = [torch.randn(20, generator=g, dtype=torch.float64) for _ in range(5)]
    ns = [1.0, 3.0, 0.5, 2.0, 7.0]
    a = fastagg.Accumulator(like=torch.zeros(20, dtype=torch.float64), backend="cpu")
    b = fastagg.Accumulator(like=torch.zeros(20, dtype=torch.float64), backend="cpu")
    a.add_many(ds[:2], ns[:2])
    b.add_many(ds[2:], ns[2:])
    a.merge(b)
    assert a.total_weight == pytest.approx(sum(ns), rel=1e-15) and a.num_clients == 5
    want = sum(n * d for n, d in zip(ns, ds)) / sum(ns)
    w = torch.zeros(20, dtype=torch.float64)
    fastagg.server.FedAvg(w, backend="cpu").step(a)
    torch.testing.assert_close(w, want, rtol=1e-12, atol=1e-12)


def test_max_staleness_refuses_only_updates_staler_than_it():
    """max_staleness=k (AsyncServer's docstring: updates staler than k are refused): an update exactly k versions
    old is folded with its staleness weight, one k + 1 old is refused and changes nothing."""
    from fastagg import server
    from fastagg.asynchronous import AsyncServer, StaleUpdate

    w = torch.zeros(4, dtype=torch.float64)
    srv = AsyncServer(server.FedAvg(w, backend="reference"), buffer_size=1, max_staleness=2)
    for _ in range(3):
        srv.submit(torch.ones(4, dtype=torch.float64), srv.version)
    assert srv.version == 3
    before = w.clone()
    with pytest.raises(StaleUpdate, match="3 versions stale"):
        srv.submit(torch.ones(4, dtype=torch.float64), 0)
    assert torch.equal(w, before) and srv.version == 3
    r = srv.submit(torch.ones(4, dtype=torch.float64), 1)
    assert r.folded and r.staleness == 2 and srv.version == 4
    torch.testing.assert_close(w, before + 3 ** -0.5, rtol=1e-12, atol=0)


def test_a_scaled_add_folds_scale_times_delta_and_its_square_norm():
    """Accumulator.add(delta, weight, scale=c) folds c * delta in delta's place (the asynchronous server's staleness
    weight): sum += n c delta, sum of squares += n c^2 ||delta||^2 (the norm of the folded update), total weight
    += n alone -- written out here."""
    import fastagg

    g = torch.Generator().manual_seed(12)
    ds = [torch.randn(16, generator=g, dtype=torch.float64) for _ in range(3)]
    ns, cs = [2.0, 1.0, 0.5], [0.5, 1.0, 3 ** -0.5]
    acc = fastagg.Accumulator(like=torch.zeros(16, dtype=torch.float64), backend="cpu")
    for d, n, c in zip(ds, ns, cs):
        acc.add(d, n, scale=c)
    torch.testing.assert_close(acc.weighted_sum, sum(n * c * d for d, n, c in zip(ds, ns, cs)), rtol=1e-12, atol=0)
    assert float(acc.weighted_sq_norm_sum) == pytest.approx(
        sum(n * c * c * float(d @ d) for d, n, c in zip(ds, ns, cs)), rel=1e-12)
    assert acc.total_weight == pytest.approx(sum(ns), rel=1e-15)


def test_a_submit_while_a_step_runs_does_not_step_the_same_buffer_again():
    """One step at a time, in the order the buffers filled: a second submit arriving while the first buffer's step
    is running (made slow here) must not step that buffer again -- the model is then u1 + u2 (FedAvg, lr 1, one
    update a buffer, both fresh) and the version 2."""
    import threading
    import time

    from fastagg import server
    from fastagg.asynchronous import AsyncServer

    w = torch.zeros(5, dtype=torch.float64)
    opt = server.FedAvg(w, backend="reference")
    inner = opt.step

    def slow_step(*a, **kw):
        time.sleep(0.4)
        return inner(*a, **kw)

    opt.step = slow_step
    srv = AsyncServer(opt, buffer_size=1)
    u1 = torch.arange(5, dtype=torch.float64)
    u2 = torch.full((5,), 0.5, dtype=torch.float64)
    first = threading.Thread(target=srv.submit, args=(u1, 0))
    first.start()
    time.sleep(0.1)  # the first step is sleeping now
    srv.submit(u2, 0)
    first.join(10)
    assert srv.version == 2
    torch.testing.assert_close(w, u1 + u2, rtol=1e-12, atol=0)
