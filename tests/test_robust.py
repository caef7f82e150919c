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


def test_batchnorm_buffers_follow_the_rule():
    """State_dict clients with BatchNorm statistics: Krum's model takes the selected client's statistics, the median
    the element-wise median of the clients' statistics; a client whose statistics hold NaN is left out."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    base = {k: v.clone() for k, v in net.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    clients = []
    for i in range(7):
        sd = {k: (v + 0.1 * torch.randn(v.shape, generator=g) + (5.0 if i == 3 else 0.0)) if v.is_floating_point()
              else v + i for k, v in base.items()}
        clients.append(sd)
    clients[5]["1.running_mean"] = torch.full((3,), float("nan"))
    for rule in (robust.Krum(1), robust.Median()):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        model.load_state_dict(base)
        opt = server.FedAvg(model, aggregate=rule)
        st = opt.step(clients, base=base)
        assert st.robust.excluded[5] and not st.robust.selected[5]
        assert not st.robust.selected[3] or isinstance(rule, robust.Median)  # the median keeps every finite client
        kept = [i for i in range(7) if bool(st.robust.selected[i])]
        rm = torch.stack([clients[i]["1.running_mean"] for i in kept])
        want = rm[0] if isinstance(rule, robust.Krum) else torch.from_numpy(np.median(rm.double().numpy(), axis=0))
        torch.testing.assert_close(model[1].running_mean.double(), want.double(), rtol=1e-6, atol=1e-6)
        adv = torch.tensor([float(i) for i in kept])
        want_n = int(base["1.num_batches_tracked"]) + int(round(float(adv[0] if isinstance(rule, robust.Krum)
                                                                      else adv.median())))
        assert int(model[1].num_batches_tracked) == want_n
