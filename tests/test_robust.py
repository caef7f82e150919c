"""fastagg.robust against float64 oracles written from the papers' definitions on stacked copies (the library
never stacks): every rule, every client form, non-finite clients left out, bounds and bad arguments refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastagg import robust, server
from fastagg.testing import cpu_backends

M, D = 11, 37


def _updates(m=M, d=D, seed=0, bad=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g, dtype=torch.float64) * 0.1
    x[list(bad)] += 5.0  # outliers: far from the honest ones
    return x


def _median(x, even="mean"):
    s = np.sort(x, axis=0)
    m = s.shape[0]
    if m % 2 or even == "lower":
        return s[(m - 1) // 2]
    return 0.5 * (s[m // 2 - 1] + s[m // 2])


def _trimmed(x, beta):
    k = int(beta * x.shape[0])
    return np.sort(x, axis=0)[k:x.shape[0] - k].mean(axis=0)


def _meamed(x, f):
    med = _median(x)
    out = np.empty(x.shape[1])
    for j in range(x.shape[1]):
        order = np.argsort(np.abs(x[:, j] - med[j]), kind="stable")[:x.shape[0] - f]
        out[j] = x[order, j].mean()
    return out


def _krum_scores(x, f):
    m = x.shape[0]
    d2 = np.array([[np.sum((x[i] - x[j]) ** 2) for j in range(m)] for i in range(m)])
    return np.array([np.sort(np.delete(d2[i], i))[:m - f - 2].sum() for i in range(m)])


def _geomed(x, a, nu=1e-6, iters=1000):
    z = (a[:, None] * x).sum(0) / a.sum()
    for _ in range(iters):
        w = a / np.maximum(nu, np.linalg.norm(x - z, axis=1))
        z = (w[:, None] * x).sum(0) / w.sum()
    return z


FORMS = ["matrix", "rows", "layers", "state_dicts", "models"]


def _as(form, x):
    """The clients' updates in a user's form (and the base for full models)."""
    x32 = x.float()
    if form == "matrix":
        return x32, None
    if form == "rows":
        return list(x32), None
    if form == "layers":
        return [[r[:20].reshape(4, 5), r[20:]] for r in x32], None
    if form == "state_dicts":
        return [{"w": r[:20].reshape(4, 5), "b": r[20:]} for r in x32], None
    base = torch.linspace(-3, 3, x.shape[1])  # full models: base + update
    return [b + r for b, r in zip([base] * len(x32), x32)], base


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("form", FORMS)
def test_coordinatewise_rules_equal_their_float64_oracle(form, backend):
    x = _updates(bad=(3,))
    x32 = x.float().double().numpy()
    deltas, base = _as(form, x)
    for rule, want in [(robust.Median(), _median(x32)), (robust.Median(even="lower"), _median(x32, "lower")),
                       (robust.TrimmedMean(0.2), _trimmed(x32, 0.2)), (robust.MeaMed(2), _meamed(x32, 2))]:
        got = robust.aggregate(deltas, rule, base=base, backend=backend).estimate
        tol = 1e-6 if form == "models" else 1e-7  # full models: the float32 models' own rounding of base + x
        np.testing.assert_allclose(got.double().numpy(), want, rtol=0, atol=tol, err_msg=repr(rule))
    even = _updates(m=10)
    got = robust.aggregate(even.float(), robust.Median()).estimate
    np.testing.assert_allclose(got.double().numpy(), np.median(even.float().double().numpy(), axis=0), atol=1e-7)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("form", FORMS)
def test_krum_family_and_geometric_median_equal_their_float64_oracle(form, backend):
    x = _updates(bad=(0, 5))
    x32 = x.float().double().numpy()
    deltas, base = _as(form, x)
    w = np.arange(1, M + 1, dtype=np.float64)
    scores = _krum_scores(x32, 2)
    krum = robust.aggregate(deltas, robust.Krum(2), base=base, backend=backend)
    assert int(np.argmin(scores)) == int(krum.selected.nonzero())
    np.testing.assert_allclose(krum.scores.numpy(), scores, rtol=1e-6)
    d2 = ((x32[:, None, :] - x32[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(krum.distances.numpy(), d2, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(krum.estimate.double().numpy(), x32[np.argmin(scores)], atol=1e-6)
    mk = robust.aggregate(deltas, robust.MultiKrum(2, num_selected=5), weights=w, base=base, backend=backend)
    best = np.argsort(scores, kind="stable")[:5]
    assert sorted(mk.selected.nonzero().flatten().tolist()) == sorted(best.tolist())
    want = (w[best, None] * x32[best]).sum(0) / w[best].sum()
    np.testing.assert_allclose(mk.estimate.double().numpy(), want, atol=1e-6)
    assert not mk.selected[0] and not mk.selected[5]  # the outliers are never chosen
    gm = robust.aggregate(deltas, robust.GeometricMedian(max_iter=1000, tol=0.0), weights=w, base=base,
                          backend=backend)
    np.testing.assert_allclose(gm.estimate.double().numpy(), _geomed(x32, w), atol=2e-6)
    nb = robust.aggregate(deltas, robust.NormBound(0.3), weights=w, base=base, backend=backend)
    norms = np.linalg.norm(x32, axis=1)
    want = ((w / w.sum() * np.minimum(1, 0.3 / norms))[:, None] * x32).sum(0)
    np.testing.assert_allclose(nb.estimate.double().numpy(), want, atol=1e-6)
    assert nb.clipped == int((norms > 0.3).sum())
    cc = robust.aggregate(deltas, robust.CenteredClipping(0.3, iters=4), weights=w, base=base, backend=backend)
    v, a = np.zeros(x32.shape[1]), w / w.sum()
    for _ in range(4):  # the paper's iteration on the stacked updates
        dist = np.linalg.norm(x32 - v, axis=1)
        v = v + ((a * np.minimum(1, 0.3 / dist))[:, None] * (x32 - v)).sum(0)
    np.testing.assert_allclose(cc.estimate.double().numpy(), v, atol=1e-6)
    assert cc.clipped == int((dist > 0.3).sum())
    assert np.linalg.norm(v - x32[[0, 5]].mean(0)) > np.linalg.norm(v - np.delete(x32, [0, 5], 0).mean(0))


def test_bulyan_equals_the_papers_iterated_krum_then_trimmed_coordinates():
    f, m = 2, 13
    x = _updates(m=m, bad=(1, 7)).float().double().numpy()
    left, chosen = list(range(m)), []
    for _ in range(m - 2 * f):
        sc = _krum_scores(x[left], f) if len(left) - f - 2 > 0 else np.zeros(len(left))
        win = left[int(np.argmin(sc))]
        chosen.append(win)
        left.remove(win)
    sel = x[sorted(chosen)]
    want = _meamed(sel, len(sel) - (len(sel) - 2 * f))
    got = robust.aggregate(torch.from_numpy(x).float(), robust.Bulyan(f))
    assert sorted(got.selected.nonzero().flatten().tolist()) == sorted(chosen)
    np.testing.assert_allclose(got.estimate.double().numpy(), want, atol=1e-7)
    assert float(got.estimate.abs().max()) < 0.5  # the two colluding outliers (+5 everywhere) are trimmed away


def test_non_finite_clients_are_left_out_and_reported_not_raised():
    x = _updates().float()
    x[2, 5] = float("nan")
    x[8, 0] = float("inf")
    res = robust.aggregate(x, robust.Median())
    assert res.excluded.tolist() == [i in (2, 8) for i in range(M)]
    assert torch.isfinite(res.estimate).all()
    keep = [i for i in range(M) if i not in (2, 8)]
    np.testing.assert_allclose(res.estimate.double().numpy(), _median(x[keep].double().numpy()), atol=1e-7)
    res = robust.aggregate(x, robust.Krum(1))
    assert torch.isfinite(res.estimate).all() and not res.selected[2] and not res.selected[8]


def test_bad_arguments_are_refused_before_anything():
    x = _updates().float()
    for make, err, text in [
        (lambda: robust.Krum(5), ValueError, r"M > 2 num_malicious \+ 2 = 12; 11 clients"),
        (lambda: robust.Bulyan(3), ValueError, r"M >= 4 num_malicious \+ 3 = 15; 11"),
        (lambda: robust.TrimmedMean(0.5), ValueError, r"beta must be in \[0, 0.5\)"),
        (lambda: robust.MeaMed(11), ValueError, "num_malicious < M"),
        (lambda: robust.MultiKrum(1, num_selected=20), ValueError, "num_selected=20 but only 11"),
        (lambda: robust.Krum(-1), ValueError, "num_malicious must be an integer >= 0"),
        (lambda: robust.GeometricMedian(nu=0), ValueError, "nu must be"),
        (lambda: robust.CenteredClipping(0.0), ValueError, "tau must be"),
        (lambda: robust.CenteredClipping(1.0, iters=0), ValueError, "iters must be"),
    ]:
        with pytest.raises(err, match=text):
            robust.aggregate(x, make())
    with pytest.raises(TypeError, match="Median is unweighted"):
        robust.aggregate(x, robust.Median(), weights=[1.0] * M)
    with pytest.raises(ValueError, match="weights"):
        robust.aggregate(x, robust.MultiKrum(1), weights=[-1.0] + [1.0] * (M - 1))
    with pytest.raises(ValueError, match="every one of the 11 clients"):
        robust.aggregate(torch.full((M, D), float("nan")), robust.Median())


@pytest.mark.parametrize("name", ["FedAvg", "FedAdam", "FedExP"])
def test_a_server_optimizer_steps_on_the_robust_estimate(name):
    """``aggregate=`` replaces the weighted mean: FedAvg(lr=1) then moves the params by exactly the estimate; a
    NaN client is left out (reported in last_stats.robust), never raised on or stepped with."""
    x = _updates(bad=(4,)).float()
    x[9, 0] = float("nan")
    kw = {"eps": 1e-3} if name == "FedExP" else {}
    w = torch.zeros(D)
    opt = getattr(server, name)(w, aggregate=robust.Median(), **kw)
    st = opt.step(x)
    est = robust.aggregate(x, robust.Median()).estimate
    if name == "FedAvg":
        torch.testing.assert_close(w, est)
    assert torch.isfinite(w).all() and bool(st.finite)
    assert st.robust.excluded[9] and not st.robust.selected[9]
    ref = getattr(server, name)(torch.zeros(D), **kw)
    with pytest.raises(ValueError, match="NaN"):
        ref.step(x)  # without a robust rule a NaN client is an accident: the round is refused


def _bn_clients(m=8):
    """State_dicts of a real Linear + BatchNorm1d model: honest clients near the global one; client 2 sends the
    honest clients' mean weights (so every whole-update rule selects or weighs it) with huge statistics (valid:
    running_var >= 0); client 4 an honest model with a negative running_var; client 6 a NaN running_mean."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    base = {k: v.clone() for k, v in net.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    clients = [{k: v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v + i
                for k, v in base.items()} for i in range(m)]
    for sd in clients:
        sd["1.running_var"] = sd["1.running_var"].abs()
    honest = [i for i in range(m) if i not in (2, 4, 6)]
    for k in ("0.weight", "0.bias", "1.weight", "1.bias"):
        clients[2][k] = torch.stack([clients[i][k] for i in honest]).mean(0)
    clients[2]["1.running_mean"] = torch.full((3,), 1e6)
    clients[2]["1.running_var"] = torch.full((3,), 1e6)
    clients[4]["1.running_var"] = torch.tensor([0.5, -1.0, 0.5])
    clients[6]["1.running_mean"] = torch.full((3,), float("nan"))
    return base, clients


@pytest.mark.parametrize("rule", [robust.Krum(1), robust.MultiKrum(1, num_selected=2), robust.GeometricMedian(),
                                  robust.NormBound(10.0), robust.CenteredClipping(10.0), robust.Median(),
                                  robust.TrimmedMean(0.0)], ids=repr)
def test_batchnorm_statistics_of_a_hostile_client_never_reach_the_model(rule):
    """The whole-update rules choose clients by their updates, which hold no statistics: the model's BatchNorm
    statistics are each element's median over the clients left in (numpy's median), never a selected client's
    statistics as sent; a negative variance or a NaN mean leaves its client out. The coordinate-wise rules keep
    applying themselves element by element (TrimmedMean(0): the plain mean, once the invalid clients are out)."""
    base, clients = _bn_clients()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model.load_state_dict(base)
    st = server.FedAvg(model, aggregate=rule).step(clients, base=base)
    assert st.robust.excluded.tolist() == [i in (4, 6) for i in range(8)]
    if isinstance(rule, robust.Krum):
        assert st.robust.selected[2]  # the rule takes client 2's weights ...
    left = [i for i in range(8) if i not in (4, 6)]
    stat = lambda k: np.stack([clients[i][k].double().numpy() for i in left])  # noqa: E731
    agg = (lambda v: v.mean(0)) if isinstance(rule, robust.TrimmedMean) else (lambda v: np.median(v, axis=0))
    for k, buf in (("1.running_mean", model[1].running_mean), ("1.running_var", model[1].running_var)):
        np.testing.assert_allclose(buf.double().numpy(), agg(stat(k)), rtol=1e-6, atol=1e-6, err_msg=k)
    if not isinstance(rule, robust.TrimmedMean):  # ... but not its statistics
        assert float(model[1].running_var.max()) < 10.0 and float(model[1].running_mean.abs().max()) < 10.0
    assert bool((model[1].running_var >= 0).all())
    assert int(model[1].num_batches_tracked) == int(base["1.num_batches_tracked"]) + round(float(agg(np.array(left))))


def test_geometric_median_at_a_million_parameters_equals_an_exact_weiszfeld():
    """10^6 parameters of updates that share a large part (as one round's clients do): Weiszfeld's distances from
    the uncentred Gram matrix cancel (~1e-16 ||delta||^2 > the distance near a client), which froze the iteration
    at the medoid. Oracle: Weiszfeld in float64 on the clients' exact coordinates in their own span (a QR of
    delta_i - delta_0, distances taken directly, 5000 iterations from the mean)."""
    m, d = 6, 1 << 20
    g = torch.Generator().manual_seed(0)
    x = torch.randn(d, generator=g, dtype=torch.float64) + 0.01 * torch.randn(m, d, generator=g, dtype=torch.float64)
    x[0] += 0.05
    X = x.numpy()
    q, r = np.linalg.qr((X[1:] - X[0]).T)
    y = np.concatenate([np.zeros((m - 1, 1)), r], axis=1).T  # client i at y[i], client 0 at the origin
    z = y.mean(0)
    for _ in range(5000):
        w = 1 / np.maximum(1e-6, np.linalg.norm(y - z, axis=1))
        z = (w[:, None] * y).sum(0) / w.sum()
    want = X[0] + q @ z
    spread = min(np.linalg.norm(X[i] - X[j]) for i in range(m) for j in range(i))
    assert min(np.linalg.norm(X[i] - want) for i in range(m)) > 0.3 * spread  # the median is no client's update
    backend = "cpu" if "cpu" in cpu_backends() else "reference"
    res = robust.aggregate(x, robust.GeometricMedian(max_iter=1000, tol=0.0), backend=backend)
    assert np.linalg.norm(res.estimate.numpy() - want) < 1e-6 * spread
    assert float(res.coefs.max()) < 0.5  # no single client's update


def _far_oracles(r, big, f, a, tau, nu=1e-6, iters=2000):
    """NormBound, CenteredClipping and Weiszfeld on updates ``delta_i = F_i r_i`` (F_i = f for i in ``big``, else
    1) from the definitions, in float64 without forming F_i r_i: ``||delta_i - v|| = F_i ||r_i - v / F_i||``."""
    m = r.shape[0]
    F = np.array([f if i in big else 1.0 for i in range(m)])
    norm = np.linalg.norm
    nb = sum(a[i] * (r[i] * min(F[i], tau / norm(r[i]))) for i in range(m))  # a_i min(1, C/||delta_i||) delta_i
    v = np.zeros(r.shape[1])
    for _ in range(4):
        step = np.zeros_like(v)
        for i in range(m):
            u = r[i] - v / F[i]  # (delta_i - v) / F_i
            step += a[i] * u * min(F[i], tau / norm(u))  # a_i min(1, tau / ||delta_i - v||) (delta_i - v)
        v = v + step
    z = np.mean([r[i] for i in range(m) if i not in big], axis=0)
    for _ in range(iters):
        num, den = np.zeros_like(z), 0.0
        for i in range(m):
            d = max(nu / F[i], norm(z / F[i] - r[i]))  # max(nu, ||z - delta_i||) / F_i
            num += a[i] * r[i] / d  # w_i delta_i
            den += a[i] / d / F[i]  # w_i
        z = num / den
    return nb, v, z


@pytest.mark.parametrize("backend", cpu_backends())
def test_an_update_whose_squares_overflow_float64_is_weighed_by_scaling_never_nan(backend):
    """Finite float64 updates of ~1e200 (squares beyond float64): NormBound, CenteredClipping and GeometricMedian
    measure them on updates scaled by powers of two and give what the definitions give (oracles that never form
    1e200 r: tiny, nonzero coefficients, the far updates' pull a_i tau r / ||r||), never NaN; the Krum family
    orders them farther than every other (Inf) and picks as the float64 oracle (numpy's Inf distances) does."""
    m, f = 11, 1e200
    r = _updates(m=m).double()
    x = r.clone()
    x[[3, 8]] *= f
    w = np.arange(1.0, m + 1)
    a = w / w.sum()
    nb, cc, gm = _far_oracles(r.numpy(), {3, 8}, f, a, 0.3)
    for rule, want in ((robust.NormBound(0.3), nb), (robust.CenteredClipping(0.3, iters=4), cc),
                       (robust.GeometricMedian(max_iter=2000, tol=0.0), gm)):
        res = robust.aggregate(x, rule, weights=w, backend=backend)
        np.testing.assert_allclose(res.estimate.numpy(), want, rtol=0, atol=1e-9, err_msg=repr(rule))
        assert 0 < float(res.coefs[3]) < 1e-150 and 0 < float(res.coefs[8]) < 1e-150, repr(rule)
    w0 = torch.zeros(D, dtype=torch.float64)
    server.FedAvg(w0, aggregate=robust.CenteredClipping(0.3, iters=4)).step(x, weights=w)
    np.testing.assert_allclose(w0.numpy(), cc, rtol=0, atol=1e-9)
    three = torch.tensor([[1.7e308] * D, [-1.7e308] * D, [1.0] * D], dtype=torch.float64)
    np.testing.assert_array_equal(robust.aggregate(three, robust.GeometricMedian(), backend=backend).estimate, 1.0)
    huge = x.clone()
    huge[3] = 1.7e308
    huge[4] = -1.7e308  # their difference is beyond float64, but no rule needs it
    for rule in (robust.NormBound(0.3), robust.CenteredClipping(0.3), robust.GeometricMedian()):
        est = robust.aggregate(huge, rule, backend=backend).estimate
        assert torch.isfinite(est).all() and float(est.abs().max()) < 1.0, repr(rule)
    w1 = torch.zeros(D, dtype=torch.float64)
    bare = torch.tensor([[1.7e308] * D, [-1.7e308] * D, [1.7e308] * D, [-1.7e308] * D], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"client 0's update is finite but its squared norm .* overflows"):
        server.FedAvg(w1, aggregate=robust.GeometricMedian()).step(bare)  # every distance beyond float64
    assert bool((w1 == 0).all())  # refused before the params were written
    xn = x.numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        scores = _krum_scores(xn, 2)
    krum = robust.aggregate(x, robust.Krum(2), backend=backend)
    assert not torch.isnan(krum.scores).any() and int(krum.selected.nonzero()) == int(np.argmin(scores))
    np.testing.assert_allclose(krum.estimate.numpy(), xn[np.argmin(scores)], atol=1e-12)
    for rule in (robust.MultiKrum(2), robust.Bulyan(2)):
        res = robust.aggregate(x, rule, backend=backend)
        assert torch.isfinite(res.estimate).all() and float(res.estimate.abs().max()) < 1.0, repr(rule)
        assert not res.selected[3] and not res.selected[8]


def test_a_zero_weight_client_is_never_chosen_and_no_estimate_is_nan():
    """MultiKrum (and Flower's Krum drop-in, MultiKrum(f, 1)) chooses among clients of positive weight: the best
    scored client of weight 0 would enter with coefficient 0/0. The other weighted rules give it coefficient 0."""
    x = _updates(bad=(0,))
    x[5] = x[1:].mean(0)  # the most central update: Krum's pick, were it not of weight 0
    w = np.ones(M)
    w[5] = 0.0
    xn = x.numpy()
    scores = _krum_scores(xn, 1)
    assert int(np.argmin(scores)) == 5
    best = int(np.argsort(np.where(w > 0, scores, np.inf), kind="stable")[0])
    for rule in (robust.MultiKrum(1, num_selected=1), robust.MultiKrum(1, num_selected=3)):
        res = robust.aggregate(x, rule, weights=w)
        assert torch.isfinite(res.estimate).all() and not res.selected[5], repr(rule)
        if rule._num_selected == 1:
            np.testing.assert_allclose(res.estimate.double().numpy(), xn[best], atol=1e-12)
    for rule in (robust.GeometricMedian(), robust.NormBound(0.3), robust.CenteredClipping(0.3)):
        res = robust.aggregate(x, rule, weights=w)
        assert torch.isfinite(res.estimate).all() and float(res.coefs[5]) == 0.0, repr(rule)
    y = x.clone()
    y[2, 0] = float("nan")
    only = np.zeros(M)
    only[2] = 1.0
    with pytest.raises(ValueError, match=r"every client of positive weight was left out .*\(clients \[2\]\)"):
        robust.aggregate(y, robust.MultiKrum(1), weights=only)


def test_a_non_finite_client_counts_as_one_of_the_f_attackers():
    """At the rule's bound (Krum: M = 2f + 3; Bulyan: M = 4f + 3) a NaN client leaves M - 1 clients of whom at
    most f - 1 are attackers: the rule runs with f - 1 (its definition over the clients left), never raising
    TooFewClients. Oracles: Krum's scores with M - 1 - (f - 1) - 2 neighbours; Bulyan with f = 0 is the mean;
    MeaMed keeps M - f values (M - 1 - (f - 1))."""
    x = _updates(m=7)
    x[1, 3] = float("nan")
    keep = [i for i in range(7) if i != 1]
    xk = x[keep].numpy()
    res = robust.aggregate(x, robust.Krum(2))
    assert res.excluded[1] and keep[int(np.argmin(_krum_scores(xk, 1)))] == int(res.selected.nonzero())
    np.testing.assert_allclose(res.scores[keep].numpy(), _krum_scores(xk, 1), rtol=1e-9)
    res = robust.aggregate(x, robust.Bulyan(1))
    np.testing.assert_allclose(res.estimate.double().numpy(), xk.astype(np.float32).astype(np.float64).mean(0)
                               if x.dtype == torch.float32 else xk.mean(0), atol=1e-12)
    res = robust.aggregate(x[:5], robust.MeaMed(2))
    np.testing.assert_allclose(res.estimate.double().numpy(), _meamed(x[[0, 2, 3, 4]].numpy(), 1), atol=1e-12)
    with pytest.raises(robust.TooFewClients, match="M > 2 num_malicious"):
        robust.aggregate(x[:6], robust.Krum(2))  # the bound with every client still holds first


@pytest.mark.parametrize("m", [4, 10])
def test_median_of_an_even_count_pins_lower_and_mean_against_numpy(m):
    """Even M, distinct values: ``even="lower"`` is numpy's lower middle (``np.quantile(method="lower")``),
    strictly below the upper middle (``method="higher"``); ``even="mean"`` is ``np.median``."""
    x = _updates(m=m, seed=3).float()
    xn = x.double().numpy()
    lower, upper = np.quantile(xn, 0.5, axis=0, method="lower"), np.quantile(xn, 0.5, axis=0, method="higher")
    assert (lower < upper).all()
    for backend in cpu_backends():
        got = robust.aggregate(x, robust.Median(even="lower"), backend=backend).estimate.double().numpy()
        np.testing.assert_array_equal(got, lower)
        assert (got < upper).all()
        got = robust.aggregate(x, robust.Median(), backend=backend).estimate.double().numpy()
        np.testing.assert_allclose(got, np.median(xn, axis=0), rtol=0, atol=1e-7)
        assert ((got > lower) & (got < upper)).all()


def _int8_clients(m=5, d=32, block=8, seed=3):
    from fastagg.compress import quantize_int8

    g = torch.Generator().manual_seed(seed)
    return [quantize_int8(0.05 * torch.randn(d, generator=g), block=block) for _ in range(m)]


def _dequantized(u):
    """x~_j = s_b * q_j, written from the format's definition (not the library's dequantize)."""
    return u.codes.double().numpy() * np.repeat(u.scales.double().numpy(), u.block)[:u.codes.numel()]


def _bad_client(kind, d=32, block=8):
    from fastagg.compress import Fp8Blockwise, Int8Blockwise

    if kind == "fp8-nan-code":
        return Fp8Blockwise(torch.full((d,), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn),
                            torch.ones(d // block), block)
    if kind == "int8-code-128":
        return Int8Blockwise(torch.full((d,), -128, dtype=torch.int8), torch.ones(d // block), block)
    return Int8Blockwise(torch.ones(d, dtype=torch.int8), -torch.ones(d // block), block)  # "negative-scale"


@pytest.mark.parametrize("kind", ["fp8-nan-code", "int8-code-128", "negative-scale"])
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_a_compressed_client_no_quantizer_writes_is_left_out_by_robust_rules(kind, mode):
    """An fp8 NaN code, an int8 -128 or a scale <= 0 under a robust rule: an attack like a NaN client (left out,
    reported in ``excluded``, counted among f), never the whole round refused (it raised ValueError before, with
    either on_nonfinite). Without a rule the fold still refuses it naming the client (malformed, not non-finite),
    the model unchanged."""
    honest, bad = _int8_clients(), _bad_client(kind)
    want = np.median(np.stack([_dequantized(u) for u in honest]), axis=0)  # 5 honest: the middle value
    for rule in (robust.Median(), robust.Krum(num_malicious=1), robust.MultiKrum(num_malicious=1)):
        model = torch.nn.Linear(32, 1, bias=False)
        before = model.weight.detach().clone().reshape(-1).double()
        stats = server.FedAvg(model, aggregate=rule, on_nonfinite=mode).step(honest + [bad])
        assert stats.robust.excluded.tolist() == [False] * 5 + [True], rule
        assert not bool(stats.robust.selected[5])
        if isinstance(rule, robust.Median):
            got = model.weight.detach().reshape(-1).double() - before
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7)
    model = torch.nn.Linear(32, 1, bias=False)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"deltas\[5\]"):
        server.FedAvg(model, on_nonfinite=mode).step(honest + [bad])
    assert torch.equal(model.weight.detach(), before)


def test_robust_aggregate_takes_compressed_updates():
    """robust.aggregate takes what fastagg.fedexp_step takes, compressed updates included (a TypeError before):
    their dequantized rows, a bad one left out; base= does not apply to them."""
    honest = _int8_clients()
    rows = np.stack([_dequantized(u) for u in honest])
    res = robust.aggregate(honest + [_bad_client("int8-code-128")], robust.Median())
    np.testing.assert_allclose(res.estimate.double().numpy(), np.median(rows, axis=0), rtol=1e-6, atol=1e-7)
    assert res.excluded.tolist() == [False] * 5 + [True]
    res = robust.aggregate(honest[:4] + [torch.from_numpy(rows[4]).float()], robust.TrimmedMean(0.2))
    np.testing.assert_allclose(res.estimate.double().numpy(), _trimmed(rows, 0.2), rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match="base="):
        robust.aggregate(honest, robust.Median(), base=torch.zeros(32))
