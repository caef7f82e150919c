"""Server optimizers against the float64 oracle (tests/server_oracle.py) over several rounds with varying
participants and weights, on every backend; checkpoints; the papers' identities; bad input and bad rounds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastagg
import server_oracle as oracle
from fastagg import server
from fastagg.testing import assert_close, cpu_backends

BACKENDS = cpu_backends()
D = 517
PARTICIPANTS = [3, 5, 2, 4, 5, 3]

CASES = {
    "FedAvg": ("FedAvg", dict(lr=0.7)),
    "FedAvgM": ("FedAvgM", dict(lr=0.7, momentum=0.9)),
    "FedAvgM-nesterov": ("FedAvgM", dict(lr=0.5, momentum=0.9, nesterov=True)),
    "FedExP": ("FedExP", dict(eps=1e-3)),
    "FedExP-official-decay": ("FedExP", dict(eps=0.05, eps_mode="official", eps_decay=0.998 ** 2)),
    "FedExP-exact-projection": ("FedExP", dict(eps=0.0, exact_projection=True)),
    "FedExPM": ("FedExPM", dict(eps=1e-3, beta=0.9)),
    "FedACG": ("FedACG", dict(lam=0.85)),
    "FedAdam": ("FedAdam", dict(lr=0.1, tau=1e-3)),
    "FedAdam-textbook": ("FedAdam", dict(lr=0.1, tau=1e-3, bias_correction="adam")),
    "FedYogi": ("FedYogi", dict(lr=0.01, tau=1e-3)),
    "FedAdagrad": ("FedAdagrad", dict(lr=0.1, tau=1e-3)),
    "FedAMS": ("FedAMS", dict(lr=0.1, vhat_floor=1e-8)),
}


def rounds(seed=0, d=D, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    out = []
    for t, m in enumerate(PARTICIPANTS):
        deltas = (0.1 * torch.randn(m, d, generator=g, dtype=torch.float64) + 0.02).to(dtype)
        weights = None if t % 2 else torch.randint(1, 50, (m,), generator=g).tolist()
        out.append((deltas, weights))
    return out


def make(cls_name, hyper, w, backend):
    return getattr(server, cls_name)(w, backend=backend, **hyper)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_optimizer_matches_fp64_oracle_over_rounds(case, backend):
    cls_name, hyper = CASES[case]
    w0 = torch.randn(D, generator=torch.Generator().manual_seed(9))
    w = w0.clone()
    opt = make(cls_name, hyper, w, backend)
    ref = getattr(oracle, cls_name)(w0, **hyper)
    for t, (deltas, weights) in enumerate(rounds()):
        assert_close(opt.broadcast(), ref.broadcast(), rtol=1e-5, atol=1e-5, name=f"broadcast, round {t}")
        before = deltas.clone()
        stats = opt.step(deltas, weights=weights)
        assert torch.equal(before, deltas)
        ref.step(deltas.double(), weights)
        assert_close(w, ref.w, rtol=1e-5, atol=1e-5, name=f"params after round {t}")
        if hasattr(ref, "eta"):
            assert_close(stats.eta, ref.eta, rtol=1e-5, atol=0, name=f"eta, round {t}")
        if cls_name.startswith("FedExP"):
            assert_close(opt.eval_params(), ref.eval, rtol=1e-5, atol=1e-5, name=f"eval, round {t}")
    assert opt.round == len(PARTICIPANTS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["ScaffoldExP", "Scaffold"])
def test_scaffold_matches_oracle(variant, backend):
    w0 = torch.randn(D, generator=torch.Generator().manual_seed(1))
    w = w0.clone()
    hyper = dict(eps=1e-3) if variant == "ScaffoldExP" else dict(lr=0.8)
    opt = getattr(server, variant)(w, num_clients=10, backend=backend, **hyper)
    ref = oracle.ScaffoldExP(w0, num_clients=10, **hyper)
    g = torch.Generator().manual_seed(5)
    for t, (deltas, weights) in enumerate(rounds()):
        dc = 0.01 * torch.randn(deltas.shape[0], D, generator=g)
        opt.step(deltas, dc, weights=weights)
        ref.step(deltas.double(), weights, dc.double())
        assert_close(w, ref.w, rtol=1e-5, atol=1e-5, name=f"params, round {t}")
        assert_close(opt.control, ref.c, rtol=1e-5, atol=1e-7, name=f"control, round {t}")
        if variant == "ScaffoldExP":
            assert_close(opt.eval_params(), ref.eval, rtol=1e-5, atol=1e-5, name=f"eval, round {t}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["FedExPM", "FedAdam", "FedACG", "FedAvgM-nesterov", "FedAMS"])
def test_state_dict_round_trip_resumes_bit_for_bit(case, backend):
    cls_name, hyper = CASES[case]
    w0 = torch.randn(D)
    straight = w0.clone()
    opt = make(cls_name, hyper, straight, backend)
    for deltas, weights in rounds():
        opt.step(deltas, weights=weights)
    resumed = w0.clone()
    first = make(cls_name, hyper, resumed, backend)
    for deltas, weights in rounds()[:3]:
        first.step(deltas, weights=weights)
    ckpt = first.state_dict()
    second = make(cls_name, {**hyper}, resumed, backend)
    second.load_state_dict(ckpt)
    for deltas, weights in rounds()[3:]:
        second.step(deltas, weights=weights)
    assert torch.equal(straight, resumed)
    assert torch.equal(torch.as_tensor(opt.eval_params()), torch.as_tensor(second.eval_params()))
    assert second.round == opt.round == len(PARTICIPANTS)


def test_load_state_dict_names_the_difference_and_changes_nothing():
    w = torch.zeros(D)
    opt = server.FedAdam(w)
    opt.step(torch.randn(3, D))
    ckpt = opt.state_dict()
    other = server.FedYogi(torch.zeros(D))
    with pytest.raises(ValueError, match="state_dict is from FedAdam; this optimizer is FedYogi"):
        other.load_state_dict(ckpt)
    smaller = server.FedAdam([torch.zeros(D - 1)])
    with pytest.raises(ValueError, match=r"parameter layout differs at entry 0: its shape is \(517,\); this "
                                         r"parameter's is \(516,\)"):
        smaller.load_state_dict(ckpt)
    layers = server.FedAdam([torch.zeros(500), torch.zeros(17)])
    with pytest.raises(ValueError, match=r"has 1 entries; these params have 2|differs at entry 0"):
        layers.load_state_dict(ckpt)
    before = {k: v.clone() for k, v in smaller.flat_state.items()}
    assert all(torch.equal(before[k], smaller.flat_state[k]) for k in before)
    with pytest.raises(ValueError, match="not a fastagg optimizer state_dict"):
        opt.load_state_dict({"state": {}})


@pytest.mark.parametrize("backend", BACKENDS)
def test_fedacg_params_are_the_weighted_average_of_client_models(backend):
    w = torch.randn(D)
    opt = server.FedACG(w, lam=0.85, backend=backend)
    g = torch.Generator().manual_seed(3)
    for t, m in enumerate(PARTICIPANTS):
        b = torch.as_tensor(opt.broadcast()).clone()
        thetas = b + 0.1 * torch.randn(m, D, generator=g)  # the clients' models after local training
        n = torch.randint(1, 20, (m,), generator=g).double()
        opt.step(thetas - b, weights=n)
        avg = (n / n.sum()) @ thetas.double()
        assert_close(w, avg, rtol=1e-5, atol=1e-5, name=f"w_t vs average of client models, round {t}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fedexpm_recursive_numerator_equals_the_sum_form(backend):
    beta = 0.9
    opt = server.FedExPM(torch.zeros(D), eps=1e-3, beta=beta, backend=backend)
    ms = []
    for t, (deltas, weights) in enumerate(rounds()):
        opt.step(deltas, weights=weights)
        p = torch.full((deltas.shape[0],), 1 / deltas.shape[0], dtype=torch.float64) if weights is None else \
            torch.tensor(weights, dtype=torch.float64) / sum(weights)
        ms.append(float(p @ deltas.double().square().sum(1)))
        sum_form = sum((beta / 2) ** (t - k) * ms[k] for k in range(t + 1))
        assert_close(opt.flat_state["numerator"], sum_form, rtol=1e-5, atol=0, name=f"A_t, round {t}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["FedExP", "FedExPM", "FedAdam", "FedACG"])
def test_accumulator_step_equals_batched_step(case, backend):
    cls_name, hyper = CASES[case]
    w_batch, w_stream = torch.zeros(D), torch.zeros(D)
    batched = make(cls_name, hyper, w_batch, backend)
    streamed = make(cls_name, hyper, w_stream, backend)
    acc = fastagg.Accumulator(like=w_stream, backend=backend)
    for deltas, weights in rounds():
        batched.step(deltas, weights=weights)
        acc.reset()
        for i, row in enumerate(deltas):
            acc.add(row, weight=1.0 if weights is None else weights[i])
        streamed.step(acc)
        assert_close(w_stream, w_batch, rtol=1e-5, atol=1e-6, name="params")
    assert_close(streamed.last_stats.eta, batched.last_stats.eta, rtol=1e-5, atol=0, name="eta")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_round_leaves_params_and_state_exactly_as_before(case, backend):
    cls_name, hyper = CASES[case]
    w = torch.randn(D)
    opt = make(cls_name, hyper, w, backend)
    deltas, weights = rounds()[0]
    opt.step(deltas, weights=weights)
    snap_w, snap_state = w.clone(), {k: v.clone() for k, v in opt.flat_state.items()}
    bad = deltas.clone()
    bad[1, 7] = float("nan")
    with pytest.raises(ValueError, match=r"deltas\[1\] contain NaN or Inf"):
        opt.step(bad, weights=weights)
    with pytest.raises(ValueError, match=r"deltas have 516 elements per client; the optimizer's params have 517"):
        opt.step(deltas[:, :-1], weights=weights)
    opt.on_nonfinite = "skip"
    stats = opt.step(bad, weights=weights)
    assert not bool(stats.finite)
    assert torch.equal(w, snap_w)
    assert set(opt.flat_state) == set(snap_state)
    for k in snap_state:
        assert torch.equal(opt.flat_state[k], snap_state[k]), k


def test_hyperparameter_errors():
    w = torch.zeros(4)
    for make_opt, pattern in [
        (lambda: server.FedExP(w), r"FedExP needs eps"),
        (lambda: server.FedExP(w, eps=-1), r"eps must be a finite number >= 0"),
        (lambda: server.FedExP(w, eps=1, eps_mode="x"), r"eps_mode must be one of"),
        (lambda: server.FedAvgM(w, momentum=1.0), r"momentum must be in \[0, 1\)"),
        (lambda: server.FedAvgM(w, nesterov=True), r"nesterov=True needs momentum > 0"),
        (lambda: server.FedAdam(w, betas=(0.9,)), r"betas must be a pair"),
        (lambda: server.FedAdam(w, bias_correction="x"), r"bias_correction must be one of"),
        (lambda: server.FedACG(w, lam=-0.1), r"lam must be a finite number >= 0"),
        (lambda: server.ScaffoldExP(w, num_clients=0, eps=1), r"num_clients must be an integer >= 1"),
        (lambda: server.FedAvg(w, on_nonfinite="x"), r"on_nonfinite must be one of"),
    ]:
        with pytest.raises((ValueError, TypeError), match=pattern):
            make_opt()


def test_module_parameters_and_numpy_params():
    net = torch.nn.Linear(4, 3)
    opt = server.FedAvgM(net.parameters(), lr=1.0, momentum=0.5)
    before = [p.detach().clone() for p in net.parameters()]
    opt.step(torch.ones(2, 15))
    assert all(torch.allclose(p.detach(), b + 1) for p, b in zip(net.parameters(), before))
    w = np.zeros(6, dtype=np.float32)
    fx = server.FedExP(w, eps=0.0)
    fx.step(np.ones((2, 6), dtype=np.float32))
    assert float(w[0]) == 1.0 and isinstance(fx.eval_params(), np.ndarray)


def _bn_like(seed):
    g = torch.Generator().manual_seed(seed)
    glob = {"w": torch.randn(5, 3, generator=g), "bn.running_mean": torch.randn(3, generator=g),
            "bn.num_batches_tracked": torch.tensor(7), "b": torch.randn(4, generator=g)}
    models = [{k: (v + torch.randn(v.shape, generator=g) if v.is_floating_point() else v + 3 + i)
               for k, v in glob.items()} for i in range(3)]
    return glob, models


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["FedAdam", "FedExP", "FedACG"])
def test_step_with_full_models_and_a_base_equals_the_step_with_their_updates(backend, name):
    """``step(models, base=sent)``: updates formed inside the stats pass; buffers become the clients' average
    (integers: the base plus the rounded average advance), as the same step on ``model - base`` updates."""
    kw = {"FedExP": dict(eps=1e-3)}.get(name, {})
    glob, models = _bn_like(0)
    a, b = {k: v.clone() for k, v in glob.items()}, {k: v.clone() for k, v in glob.items()}
    oa, ob = getattr(server, name)(a, backend=backend, **kw), getattr(server, name)(b, backend=backend, **kw)
    for t in range(2):
        sent = oa.broadcast()
        sent = {k: sent.get(k, a[k]).clone() for k in a}
        base_b = ob.broadcast()
        base_b = {k: base_b.get(k, b[k]).clone() for k in b}
        ms = [{k: m[k] + t * 0.1 if m[k].is_floating_point() else m[k] + t for k in m} for m in models]
        sa = oa.step(ms, weights=[1, 2, 3], base=sent)
        sb = ob.step([{k: m[k] - base_b[k] for k in m} for m in ms], weights=[1, 2, 3])
        assert_close(sa.eta, sb.eta, rtol=1e-6, atol=0, name="eta")
        for k in a:
            assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, name=f"{name} {k} round {t}")
    assert a["bn.num_batches_tracked"].dtype == torch.int64


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_base_is_checked(backend):
    glob, models = _bn_like(1)
    opt = server.FedAvg({k: v.clone() for k, v in glob.items()}, backend=backend)
    before = {k: v.clone() for k, v in opt._p.original.items()}
    bad = dict(glob, w=torch.zeros(5, 4))
    with pytest.raises(ValueError, match="base"):
        opt.step(models, base=bad)
    with pytest.raises(TypeError, match="base"):
        opt.step(models, base={k: (v.double() if v.is_floating_point() else v) for k, v in glob.items()})
    acc = fastagg.Accumulator(glob, backend=backend)
    with pytest.raises(TypeError, match="base= does not apply to an Accumulator"):
        opt.step(acc, base=glob)
    for k, v in opt._p.original.items():
        assert torch.equal(v, before[k])


# -- a step from a start model (the momentum family's apply reads it; fastagg.nvflare's aggregator) -------------
START_CASES = {k: CASES[k] for k in ("FedAvg", "FedAvgM-nesterov", "FedExP", "FedExPM", "FedACG", "FedAdam")}


def _start_model(seed, dtype, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": (scale * torch.randn(300, generator=g)).to(dtype),
            "b.bias": (scale * torch.randn(77, generator=g)).to(dtype)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(START_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_from_a_start_model_is_copying_it_in_then_stepping(backend, case, dtype):
    """``_step_from(start, deltas)`` on params holding NaN garbage (never read: the momentum family's apply reads
    ``start`` where it writes them; other rules copy it in) ends exactly as copying ``start`` into the params and
    stepping: params, state, eval model and stats, bit for bit, over rounds that are finite, skipped (a NaN
    client), with elements that would overflow (kept at start's value, counted), raised (params then hold start),
    and from an Accumulator."""
    name, hyper = START_CASES[case]
    cls = getattr(server, name)
    ref_p, own_p = _start_model(0, dtype), _start_model(0, dtype)
    ref = cls(ref_p, backend=backend, on_nonfinite="skip", **hyper)
    own = cls(own_p, backend=backend, on_nonfinite="skip", **hyper)
    g = torch.Generator().manual_seed(1)
    huge = torch.finfo(dtype).max

    def deltas(m=3):
        return [{k: (0.1 * torch.randn(v.shape, generator=g)).to(dtype) for k, v in ref_p.items()} for _ in range(m)]

    for t in range(5):
        start = _start_model(10 + t, dtype)
        ds = deltas()
        if t in (0, 2):  # a NaN client: the round is skipped (in round 0, before the eval buffer exists)
            ds[1]["b.bias"][5] = float("nan")
        if t == 3:  # elements that would overflow keep start's value and are counted
            start["a.weight"][:4] = huge
            for d in ds:
                d["a.weight"][:4] = huge / 2
        if t == 4:
            acc_ref, acc_own = (fastagg.Accumulator(like=ref_p, client_norms=cls.needs_client_norms)
                                for _ in range(2))
            acc_ref.add_many(ds), acc_own.add_many(ds)
            args_ref, args_own = (acc_ref,), (acc_own,)
        else:
            args_ref, args_own = (ds,), (ds,)
        with torch.no_grad():
            for k in ref_p:
                ref_p[k].copy_(start[k])
                own_p[k].fill_(float("nan"))
        before = {k: v.clone() for k, v in start.items()}
        a = ref.step(*args_ref)
        b = own._step_from(start, *args_own)
        assert all(torch.equal(start[k], before[k]) for k in start)  # start is only read
        for k in ref_p:
            assert torch.equal(own_p[k], ref_p[k]), (t, k)
        assert bool(a.finite) == bool(b.finite) and (t not in (0, 2) or not bool(a.finite))
        assert torch.equal(a.eta, b.eta) and int(a.overflowed) == int(b.overflowed)
        assert (int(a.overflowed) > 0) == (t == 3)
        sa, sb = ref.state_dict(), own.state_dict()
        for k, v in sa["state"].items():
            for n, x in v.items():
                assert torch.equal(x, sb["state"][k][n]), (t, k, n)
        if hasattr(ref, "eval_params"):
            ea, eb = ref.eval_params(), own.eval_params()
            for k in ea:
                assert torch.equal(torch.as_tensor(ea[k]), torch.as_tensor(eb[k])), (t, k)
    raising = cls(own_p, backend=backend, on_nonfinite="raise", **hyper)
    bad = deltas()
    bad[0]["a.weight"][0] = float("inf")
    with torch.no_grad():
        for v in own_p.values():
            v.fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN or Inf"):
        raising._step_from(start, bad)
    assert all(torch.equal(own_p[k], start[k]) for k in start)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_start_model_that_does_not_fit_or_overlaps_what_the_step_writes_is_refused(backend):
    params = _start_model(0, torch.float32)
    opt = server.FedAvg(params, backend=backend)
    ds = [{k: torch.zeros_like(v) for k, v in params.items()}]
    with pytest.raises(ValueError, match="start must be a model like the params"):
        opt._step_from({"a.weight": torch.zeros(300), "b.bias": torch.zeros(78)}, ds)
    with pytest.raises(ValueError, match="start must be a model like the params"):
        opt._step_from({k: v.double() for k, v in params.items()}, ds)
    with pytest.raises(ValueError, match="overlaps"):
        opt._step_from({"a.weight": params["a.weight"], "b.bias": torch.zeros(77)}, ds)
    square = {"x": torch.zeros(5), "y": torch.ones(5)}
    sq_opt = server.FedAvg(square, backend=backend)
    with pytest.raises(ValueError, match="start must be a model like the params"):  # the entries by name, not order
        sq_opt._step_from({"y": torch.ones(5), "x": torch.zeros(5)}, [{k: torch.zeros(5) for k in square}])


class _StatsSpy:
    """A backend that records what each round_stats call was asked to write."""

    def __init__(self, inner):
        self._inner, self.mean_outs = inner, []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def round_stats(self, **kw):
        self.mean_outs.append(kw["mean_out"])
        return self._inner.round_stats(**kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["FedAvg", "FedAvgM-nesterov"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_an_accumulator_step_reads_the_sum_scaled_instead_of_a_written_mean(backend, case, dtype):
    """FedAvg and FedAvgM stepping on an Accumulator: the stats pass writes no mean (mean_out=None) and the apply
    reads the sum scaled by 1 / total_weight, as the stats pass would have written it: params, momentum and stats
    bit for bit those of the step that writes the mean, over finite, skipped and overflowing rounds, from a start
    model too."""
    name, hyper = CASES[case]
    cls = getattr(server, name)
    pa, pb = _start_model(0, dtype), _start_model(0, dtype)
    eager = cls(pa, backend=backend, on_nonfinite="skip", **hyper)
    eager._apply_reads_sum = False
    lazy = cls(pb, backend=backend, on_nonfinite="skip", **hyper)
    spy = lazy._backend = _StatsSpy(lazy._backend)
    g = torch.Generator().manual_seed(2)
    huge = torch.finfo(dtype).max
    accs = [fastagg.Accumulator(like=pa, client_norms=False, backend=backend) for _ in range(2)]
    for t in range(4):
        ds = [{k: (0.1 * torch.randn(v.shape, generator=g, dtype=torch.float64)).to(dtype) for k, v in pa.items()}
              for _ in range(3)]
        if t == 1:
            ds[2]["a.weight"][3] = float("nan")
        if t == 2:
            for p in (pa, pb):
                p["a.weight"][:2] = huge
            ds[0]["a.weight"][:2] = huge / 4
        for acc in accs:
            acc.reset()
            acc.add_many(ds, [1.0, 2.0, 3.0], on_nonfinite="skip")
        if t == 3:
            start = _start_model(7, dtype)
            a, b = eager._step_from(start, accs[0]), lazy._step_from(start, accs[1])
        else:
            a, b = eager.step(accs[0]), lazy.step(accs[1])
        assert spy.mean_outs[-1] is None
        for k in pa:
            assert torch.equal(pa[k], pb[k]), (t, k)
        assert bool(a.finite) == bool(b.finite) and torch.equal(a.mean_sq_norm, b.mean_sq_norm)
        # (float64: an update that could overflow a param has a squared norm past float64, and is left out)
        assert int(a.overflowed) == int(b.overflowed) and (int(a.overflowed) > 0) == (t == 2 and dtype != torch.float64)
        for k, v in eager.state_dict()["state"].items():
            for n, x in v.items():
                assert torch.equal(x, lazy.state_dict()["state"][k][n]), (t, k, n)
        assert torch.equal(accs[0].weighted_sum["a.weight"], accs[1].weighted_sum["a.weight"])  # sums unchanged


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_stats_without_a_mean_out_gives_the_same_statistics(backend):
    """round_stats(mean_out=None): the mean is not kept; the clients' norms, flags and ||mean||^2 are those of the
    pass that writes it (per-layer rows, an init, an Inf client, every dtype); noise needs a mean_out."""
    from fastagg.backends import resolve
    from fastagg.rows import client_rows

    b = resolve(backend, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    for dtype, m in ((torch.float32, 1), (torch.float32, 5), (torch.bfloat16, 3), (torch.float64, 2)):
        x = torch.randn(m, 1000, generator=g).to(dtype)
        x[m - 1, 7] = float("inf")
        rows = client_rows([[r[:300], r[300:]] for r in x], name="deltas")
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        init, w = torch.randn(1000, generator=g).to(cdt), torch.rand(m, generator=g, dtype=torch.float64)
        outs = []
        for mean_out in (torch.empty(1000, dtype=cdt), None):
            sq, bad, msq = (torch.empty(m, dtype=torch.float64), torch.empty(m, dtype=torch.bool),
                            torch.empty((), dtype=torch.float64))
            b.round_stats(rows=rows, weights=w, mean_init=init, aux=None, aux_coef=0.0, mean_out=mean_out,
                          sq_norms_out=sq, nonfinite_out=bad, mean_sq_out=msq)
            outs.append((sq, bad, msq))
        (sq0, bad0, msq0), (sq1, bad1, msq1) = outs
        assert torch.equal(sq0.nan_to_num(), sq1.nan_to_num()) and torch.equal(bad0, bad1) and bool(bad0[-1])
        assert torch.equal(msq0.nan_to_num(), msq1.nan_to_num())
    with pytest.raises(ValueError, match="noise needs a mean_out"):
        b.round_stats(rows=rows, weights=w, mean_init=None, aux=None, aux_coef=0.0, mean_out=None,
                      sq_norms_out=sq, nonfinite_out=bad, mean_sq_out=msq, noise=(1.0, 0, 0))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_adds_that_arrive_during_a_step_on_the_accumulator_wait_for_it(backend):
    """The sum-reading apply reads the accumulator's buffer after the stats pass: adds from another thread while
    the step runs (two of them: the second would fold into the buffer the first swapped out) wait for the step's
    lock, so the step is the one of the clients folded before it, and the adds land afterwards."""
    import threading

    params = _start_model(0, torch.float32)
    expect = {k: v.clone() for k, v in params.items()}
    g = torch.Generator().manual_seed(5)
    ds = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(4)]
    acc = fastagg.Accumulator(like=params, client_norms=False, backend=backend)
    acc.add_many(ds[:2])
    ref = server.FedAvg(expect, backend=backend)
    ref._apply_reads_sum = False
    ref.step(acc)
    opt = server.FedAvg(params, backend=backend)
    inner = opt._backend
    threads = []

    class Racing:
        def __getattr__(self, name):
            return getattr(inner, name)

        def momentum_apply(self, **kw):
            for d in ds[2:]:
                threads.append(threading.Thread(target=acc.add, args=(d,)))
                threads[-1].start()
                threads[-1].join(0.3)  # (they wait for the step's lock)
            return inner.momentum_apply(**kw)

    opt._backend = Racing()
    opt.step(acc)
    for t in threads:
        t.join(10)
    assert all(torch.equal(params[k], expect[k]) for k in params)
    assert acc.num_clients == 4
