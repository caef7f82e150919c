"""Property-based fuzzing of every public entry point (hypothesis): random shapes, dtypes (mixed between clients
and params), strides, input forms, overlapping buffers, index tables, weights and values (NaN, Inf, values near
the dtypes' limits). Every call either equals the same call on the reference backend, or raises a ValueError /
TypeError -- the same kind the reference raises -- with every buffer it was given unchanged.

CI runs FASTAGG_FUZZ_EXAMPLES (default 150) examples per entry point; set it higher for a long run (the README
reports a 10,000-example run).
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastagg
from fastagg import client, privacy, robust, server
from fastagg.testing import assert_close, cpu_backends, snapshot, tolerance

EXAMPLES = int(os.environ.get("FASTAGG_FUZZ_EXAMPLES", "150"))
BACKENDS = [b for b in cpu_backends() if b != "reference"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SCALES = [1e-3, 1.0, 100.0, 1e18, 3e38]


def _values(data, shape, dtype, label):
    """Random values of ``dtype``: a scale (huge ones overflow float16's range), sometimes a NaN or an Inf."""
    seed = data.draw(st.integers(0, 2 ** 31 - 1), label=f"{label} seed")
    scale = data.draw(st.sampled_from(SCALES), label=f"{label} scale")
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    if t.numel() and data.draw(st.integers(0, 9), label=f"{label} poison") == 0:
        t.view(-1)[data.draw(st.integers(0, t.numel() - 1))] = data.draw(st.sampled_from([float("nan"),
                                                                                         float("inf")]))
    return t.to(dtype)


def _clients(data, m, d, dtype):
    """M clients' updates in one of the accepted forms (some strided, some not accepted)."""
    form = data.draw(st.sampled_from(["matrix", "strided", "list", "per-layer", "transposed"]), label="form")
    x = _values(data, (m, d), dtype, "deltas")
    if form == "matrix":
        return x
    if form == "strided":  # rows inside a wider buffer: row stride > d
        wide = torch.zeros(m, d + 3, dtype=dtype)
        wide[:, :d] = x
        return wide[:, :d]
    if form == "transposed":  # column stride != 1: rejected
        return x.t().contiguous().t()
    if form == "list":
        return list(x.unbind(0))
    cut = data.draw(st.integers(0, d), label="layer cut")
    return [[r[:cut], r[cut:]] if 0 < cut < d else [r] for r in x]


@pytest.fixture(autouse=True)
def _quiet_interpreter_numpy():
    """Triton's CPU interpreter sums with numpy, which warns on Inf - Inf (NaN on a GPU, flagged the same)."""
    with np.errstate(invalid="ignore", over="ignore"):
        yield


def _weights(data, m):
    kind = data.draw(st.sampled_from(["none", "counts", "bad", "huge", "wrong length"]), label="weights")
    if kind == "none":
        return None
    if kind == "counts":
        return data.draw(st.lists(st.integers(0, 50), min_size=m, max_size=m), label="counts")
    if kind == "bad":
        return data.draw(st.lists(st.sampled_from([1.0, -1.0, float("nan"), 0.0]), min_size=m, max_size=m))
    if kind == "huge":
        return [1e308] * m
    return [1.0] * (m + 1)


def _run_both(call, args, backend, outputs=()):
    """Run ``call(args, backend)`` and ``call(copy of args, "reference")``: (result, error, reference result,
    reference error); asserts the inputs are unchanged when the call raised. ``outputs`` (a mean_out buffer)
    are exempt: a round refused for NaN/Inf has computed its statistics into them."""
    ref_args = copy.deepcopy(args)
    before = snapshot(args)
    try:
        got, err = call(args, backend), None
    except (ValueError, TypeError) as e:
        got, err = None, e
    try:
        ref, ref_err = call(ref_args, "reference"), None
    except (ValueError, TypeError) as e:
        ref, ref_err = None, e
    if err is not None:
        assert str(err), "an error must say what is wrong"
        if not _applied_with_kept_elements(err):
            _assert_same_bits(before, args, skip={id(o) for o in outputs})
    assert (err is None) == (ref_err is None), f"{backend}: {err!r} but the reference: {ref_err!r}"
    if err is not None:
        assert type(err) is type(ref_err), f"{backend} raised {err!r}, the reference {ref_err!r}"
    return got, ref, args, ref_args


def _applied_with_kept_elements(err) -> bool:
    """The one documented error after a write: elements whose new value alone overflowed their dtype (values
    within a factor ~2 of its largest) kept their old values; every other element was updated, no Inf/NaN."""
    return "kept their previous values" in str(err)


def _assert_same_bits(before, after, skip=frozenset()):
    if id(after) in skip:
        return
    if isinstance(before, torch.Tensor):
        bits = lambda t: t.detach().contiguous().view(-1).view(torch.uint8)  # noqa: E731 (NaN-safe comparison)
        assert torch.equal(bits(before), bits(after)), "a buffer changed although the call raised"
    elif isinstance(before, dict):
        for k in before:
            _assert_same_bits(before[k], after[k], skip)
    elif isinstance(before, (list, tuple)):
        for b, a in zip(before, after):
            _assert_same_bits(b, a, skip)


def _close(a, b, dtype, kind, name):
    if a is None or b is None:
        assert a is None and b is None, name
        return
    rtol, atol = tolerance(dtype, kind)
    a, b = torch.as_tensor(a).double().reshape(-1), torch.as_tensor(b).double().reshape(-1)
    # where an input already held Inf/NaN, backends may carry it as Inf or as NaN: compare finiteness there
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(fa, fb), f"{name}: finite at {fa.nonzero().flatten().tolist()[:5]} vs " \
                                f"{fb.nonzero().flatten().tolist()[:5]}"
    scale = float(b[fb].abs().max()) if bool(fb.any()) else 1.0
    assert_close(a[fa], b[fb], rtol=rtol * 8, atol=atol * 8 * max(1.0, scale), name=name)


def _flat(p):
    if isinstance(p, torch.Tensor):
        return p
    return torch.cat([t.reshape(-1).double() for t in p])


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=st.data())
def test_fuzz_fedexp_and_fedavg(backend, data):
    m, d = data.draw(st.integers(1, 5), label="M"), data.draw(st.integers(1, 40), label="d")
    dtype, pdtype = data.draw(st.sampled_from(DTYPES), label="dtype"), data.draw(st.sampled_from(DTYPES), label="p")
    deltas = _clients(data, m, d, dtype)
    params = _values(data, (d,), pdtype, "params") if data.draw(st.booleans(), label="params?") else None
    alias = data.draw(st.sampled_from(["none", "mean_out=deltas", "params=deltas", "eval_out=params",
                                       "mean_out", "eval_out"]), label="outputs")
    kw = dict(weights=_weights(data, m), on_nonfinite=data.draw(st.sampled_from(["raise", "skip"])))
    which = data.draw(st.sampled_from(["fedexp", "fedavg"]), label="op")
    cdt = torch.float64 if (pdtype if params is not None else dtype) == torch.float64 else torch.float32
    if alias == "mean_out=deltas" and isinstance(deltas, torch.Tensor):
        kw["mean_out"] = deltas[0] if deltas.dtype == cdt else deltas[0].to(cdt)
    elif alias == "params=deltas" and isinstance(deltas, torch.Tensor) and params is not None:
        params = deltas[0]
    elif alias == "eval_out=params" and params is not None and which == "fedexp":
        kw["eval_out"] = params
    elif alias == "mean_out":
        kw["mean_out"] = torch.empty(d, dtype=cdt)
    elif alias == "eval_out" and params is not None and which == "fedexp":
        kw["eval_out"] = torch.empty(d, dtype=params.dtype)

    def call(args, backend):
        deltas, params, kw = args
        if which == "fedexp":
            return fastagg.fedexp_step(deltas, eps=1e-3, params=params, backend=backend, **kw)
        return fastagg.fedavg_step(deltas, lr=0.5, params=params, backend=backend, **kw)

    got, ref, args, ref_args = _run_both(call, (deltas, params, kw), backend,
                                         outputs=[kw["mean_out"]] if "mean_out" in kw else [])
    if got is None:
        return
    assert bool(got.finite) == bool(ref.finite)
    if bool(got.finite):
        _close(got.mean_flat, ref.mean_flat, dtype if dtype != torch.float64 else cdt, "mean", "mean")
        _close(got.eta, ref.eta, torch.float32, "norm", "eta")
    if params is not None:
        _close(_flat(args[1]), _flat(ref_args[1]), params.dtype, "params", "params")
        assert bool(torch.isfinite(args[1]).all()) or not bool(torch.isfinite(params).all()) or \
            not bool(torch.isfinite(ref_args[1]).all())


OPTIMIZERS = ["FedAvgM", "FedExP", "FedExPM", "FedACG", "FedAdam", "FedYogi", "FedAdagrad", "FedAMS"]


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=st.data())
def test_fuzz_server_optimizers(backend, data):
    name = data.draw(st.sampled_from(OPTIMIZERS), label="optimizer")
    d = data.draw(st.integers(1, 40), label="d")
    pdtype, dtype = data.draw(st.sampled_from(DTYPES), label="params dtype"), data.draw(st.sampled_from(DTYPES))
    hyper = {"FedExP": dict(eps=1e-3), "FedExPM": dict(eps=1e-3), "FedAvgM": dict(momentum=0.9)}.get(name, {})
    on_nonfinite = data.draw(st.sampled_from(["raise", "skip"]))
    params = _values(data, (d,), pdtype, "params")
    rounds = [(_clients(data, data.draw(st.integers(1, 4)), d, dtype), None) for _ in range(data.draw(st.integers(1, 3)))]

    w, w_ref = params.clone(), params.clone()
    opt = getattr(server, name)(w, backend=backend, on_nonfinite=on_nonfinite, **hyper)
    ref = getattr(server, name)(w_ref, backend="reference", on_nonfinite=on_nonfinite, **hyper)
    for t, (deltas, weights) in enumerate(rounds):
        before = snapshot([w, opt.flat_state, deltas])
        outcome, kept = [], []
        for o, x in ((opt, deltas), (ref, copy.deepcopy(deltas))):
            try:
                outcome.append(bool(o.step(x, weights=weights).finite))
                kept.append(False)
            except (ValueError, TypeError) as e:
                outcome.append(type(e))
                kept.append(_applied_with_kept_elements(e))
        assert outcome[0] == outcome[1], f"round {t}: {backend} {outcome[0]}, reference {outcome[1]}"
        if outcome[0] is False or (not isinstance(outcome[0], bool) and not kept[0]):  # refused: nothing changed
            _assert_same_bits(before, [w, opt.flat_state, deltas])
        _close(w, w_ref, pdtype, "params", f"{name} params after round {t}")
        if bool(torch.isfinite(params).all()):
            assert bool(torch.isfinite(w).all()), "Inf/NaN written into params"


ROBUST_RULES = [lambda f: robust.Median(), lambda f: robust.Median(even="lower"), lambda f: robust.TrimmedMean(0.25),
                lambda f: robust.MeaMed(f), lambda f: robust.Krum(f), lambda f: robust.MultiKrum(f),
                lambda f: robust.Bulyan(f), lambda f: robust.Bulyan(f, selection="multikrum"),
                lambda f: robust.GeometricMedian(), lambda f: robust.NormBound(0.5),
                lambda f: robust.CenteredClipping(0.5)]


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=st.data())
def test_fuzz_robust_aggregation(backend, data):
    """Every robust rule on every client form, dtype, scale (NaN/Inf clients: left out), weights: the estimate equals
    the reference backend's, or both refuse alike with the inputs unchanged; never Inf/NaN from finite kept
    clients; through a server optimizer the params stay finite."""
    m, d = data.draw(st.integers(1, 12), label="M"), data.draw(st.integers(1, 40), label="d")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    rule = data.draw(st.sampled_from(ROBUST_RULES), label="rule")(data.draw(st.integers(0, 3), label="f"))
    deltas = _clients(data, m, d, dtype)
    weights = _weights(data, m) if rule.weighted and data.draw(st.booleans()) else None
    got, ref, _, _ = _run_both(lambda a, b: robust.aggregate(a[0], rule, weights=a[1], backend=b), [deltas, weights],
                               backend)
    if got is None:
        return
    assert torch.equal(got.selected, ref.selected) and torch.equal(got.excluded, ref.excluded)
    _close(got.estimate, ref.estimate, dtype, "mean", f"{rule!r} estimate")
    w = torch.zeros(d, dtype=torch.float32)
    try:
        server.FedAvg(w, backend=backend, aggregate=rule).step(copy.deepcopy(deltas), weights=weights)
    except (ValueError, TypeError):
        pass
    assert bool(torch.isfinite(w).all()), "Inf/NaN written into params"


DP_MECHANISMS = [lambda z, c, n: privacy.ServerSideFixedClipping(z, c, n, seed=3),
                 lambda z, c, n: privacy.ClientSideFixedClipping(z, c, n, seed=3),
                 lambda z, c, n: privacy.ServerSideAdaptiveClipping(z, n, c, clipped_count_stddev=n, seed=3),
                 lambda z, c, n: privacy.ClientSideAdaptiveClipping(z, n, c, clipped_count_stddev=n, seed=3)]


@FUZZ
@given(data=st.data())
def test_fuzz_dp_accountant_matches_its_mechanism(data):
    """PrivacyAccountant.for_mechanism and a mechanism's accountant= with any noise multiplier / sample size: the
    mechanism takes exactly an accountant of its own z and n, and refuses any other naming it; epsilon(delta)
    answers a number >= 0 for delta in (0, 1) and a ValueError naming delta for anything else."""
    z = data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]), label="mechanism z")
    n = data.draw(st.integers(1, 6), label="n")
    az = data.draw(st.sampled_from([0.5, 1.0, 2.0, 1.0 + 1e-9]), label="accountant z")
    an = data.draw(st.integers(1, 6), label="accountant num_sampled")
    sampling = data.draw(st.sampled_from(["none", "poisson"]), label="sampling")
    acc = privacy.PrivacyAccountant(az, sampling=sampling, population_size=50, num_sampled=an)
    mismatch = abs(az - z) > 1e-12 * z or (sampling != "none" and an != n)
    try:
        mech = privacy.ServerSideFixedClipping(z, 1.0, n, accountant=acc, seed=1)
        assert not mismatch, "an accountant of another mechanism was taken"
    except ValueError as e:
        assert mismatch and ("noise multiplier" in str(e) or "num_sampled" in str(e)), e
    if z > 0:
        own = privacy.PrivacyAccountant.for_mechanism(privacy.ServerSideFixedClipping(z, 1.0, n, seed=1))
        assert own.noise_multiplier == z
    delta = data.draw(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3)), label="delta")
    acc.step(data.draw(st.integers(0, 3), label="releases"))
    if sampling == "poisson":
        return  # (its one-release RDP costs ~0.5 s; the delta check is the same code)
    if isinstance(delta, float) and 0 < delta < 1:
        assert acc.epsilon(delta) >= 0
    else:
        with pytest.raises(ValueError, match="delta"):
            acc.epsilon(delta)


_WARM = {}


def _warm_accountant(sampling, n):
    """An accountant at 0 releases whose one-release RDP is already computed (copies share it: ~0.2 s each)."""
    if (sampling, n) not in _WARM:
        acc = privacy.PrivacyAccountant(1.0, sampling=sampling, population_size=None if sampling == "none" else 20,
                                        num_sampled=None if sampling == "none" else n)
        acc.step()
        acc.epsilon()
        acc.releases = 0
        _WARM[sampling, n] = acc
    return _WARM[sampling, n]


@FUZZ
@given(data=st.data())
def test_fuzz_dp_denominator_and_accountant_state(data):
    """A mechanism's ``denominator=`` with any accountant and reply count, and an accountant's ``load_state_dict``
    with one entry of its state replaced: either a ValueError/TypeError with nothing changed, or (denominator) a
    release that an added client sending -C e moves by at most the sensitivity the accountant assumes."""
    sampling = data.draw(st.sampled_from(["none", "without-replacement", None]), label="sampling")
    denominator = data.draw(st.sampled_from([None, "expected", "replies", "actual"]), label="denominator")
    n, m = 4, data.draw(st.integers(1, 7), label="replies")

    def make():
        acc = None if sampling is None else copy.copy(_warm_accountant(sampling, n))
        return privacy.ServerSideFixedClipping(1.0, 0.5, n, seed=2, accountant=acc, denominator=denominator)

    try:
        a, b = make(), make()
    except ValueError as e:
        assert denominator in ("replies", "actual") and "denominator" in str(e), e
        return
    e1 = torch.zeros(3, dtype=torch.float64)
    e1[0] = 1.0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ra = privacy.release([0.5 * e1] * m, a, backend="reference")
            rb = privacy.release([0.5 * e1] * m + [-0.5 * e1], b, backend="reference")
    except ValueError as e:
        assert denominator == "replies" and sampling == "without-replacement" and "clients replied" in str(e), e
        assert a.rounds + b.rounds <= 1
        return
    shift = float((ra.estimate - rb.estimate).norm())
    if a.accountant is not None and a.accountant.sampling == "none":  # add-or-remove-one: C / n
        assert shift <= 0.5 / n * (1 + 1e-9)
    key = data.draw(st.sampled_from(["noise_multiplier", "sampling", "method", "population_size", "num_sampled",
                                     "delta", "releases", "extra"]), label="state key")
    value = data.draw(st.one_of(st.none(), st.booleans(), st.integers(-3, 2 ** 70), st.floats(), st.text(max_size=3)),
                      label="state value")
    acc = privacy.PrivacyAccountant(1.0)
    acc.step(2)
    before = acc.state_dict()
    state = {**before, key: value}
    try:
        acc.load_state_dict(state)
    except (ValueError, TypeError):
        assert acc.state_dict() == before
        return
    assert key == "releases" or state == before, (key, value)
    assert acc.releases == state["releases"] and acc.epsilon() >= 0


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=st.data())
def test_fuzz_dp_release(backend, data):
    """Every DP mechanism on every client form, dtype and scale (NaN/Inf clients: left out; 3e38 clients: clipped),
    with and without noise: the release equals the reference backend's (the noise to 1e-4 of its std, the backends'
    float32 Box-Muller agreeing to ~1e-6), or both refuse alike with the inputs unchanged; never Inf/NaN; through a
    server optimizer the params stay finite."""
    m, d = data.draw(st.integers(1, 8), label="M"), data.draw(st.integers(1, 40), label="d")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    z = data.draw(st.sampled_from([0.0, 0.5, 2.0]), label="z")
    c = data.draw(st.sampled_from([1e-3, 1.0, 1e3]), label="clip")
    make = data.draw(st.sampled_from(DP_MECHANISMS), label="mechanism")
    deltas = _clients(data, m, d, dtype)
    got, ref, _, _ = _run_both(lambda a, b: privacy.release(a, make(z, c, m), backend=b), deltas, backend)
    if got is None:
        return
    assert torch.equal(got.excluded, ref.excluded) and torch.equal(got.clipped, ref.clipped)
    assert bool(torch.isfinite(got.estimate).all()), "Inf/NaN in a release"
    rtol, atol = tolerance(dtype, "mean")
    diff = (got.estimate.double() - ref.estimate.double()).abs()
    assert float(diff.max()) <= 1e-4 * 7 * got.noise_std + 8 * atol * c + 8 * rtol * float(ref.estimate.abs().max())
    w = torch.zeros(d, dtype=torch.float32)
    try:
        server.FedAdam(w, backend=backend, aggregate=make(z, c, m)).step(copy.deepcopy(deltas))
    except (ValueError, TypeError):
        pass
    assert bool(torch.isfinite(w).all()), "Inf/NaN written into params"


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=st.data())
def test_fuzz_accumulator(backend, data):
    d = data.draw(st.integers(1, 40), label="d")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    clients = [(_values(data, (d,), data.draw(st.sampled_from([dtype, dtype, torch.float32])), "client"),
                data.draw(st.sampled_from([1.0, 2.0, 0.0, 1e30]), label="weight"))
               for _ in range(data.draw(st.integers(1, 4)))]
    params = _values(data, (d,), dtype, "params")

    def call(args, backend):
        clients, params = args
        acc = fastagg.Accumulator(torch.zeros(d, dtype=dtype), backend=backend)
        took = [acc.add(c, weight=w, on_nonfinite="skip") for c, w in clients]
        if not any(took) or acc.total_weight == 0:
            return took, None
        return took, acc.fedexp_step(eps=1e-3, params=params, on_nonfinite="skip")

    got, ref, args, ref_args = _run_both(call, (clients, params), backend)
    if got is None:
        return
    if got[0] != ref[0]:
        # at the very edge of the dtype a fused multiply-add (the AVX2 build) keeps finite what a separate multiply
        # and add overflows: tolerated only where a weighted update is within 4x of the largest finite value
        big = torch.finfo(dtype if dtype != torch.bfloat16 else torch.float32).max / 4
        edge = [float((w * c.double()).abs().max()) >= big for c, w in clients]
        assert all(e for e, a, b in zip(edge, got[0], ref[0]) if a != b), "the same clients are accepted"
        return
    if got[1] is not None:
        assert bool(got[1].finite) == bool(ref[1].finite)
        _close(args[1], ref_args[1], dtype, "params", "params")


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=st.data())
def test_fuzz_client_steps(backend, data):
    m, d = data.draw(st.integers(1, 5), label="M"), data.draw(st.integers(1, 40), label="d")
    n = data.draw(st.integers(1, 7), label="population")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    x = _values(data, (m, d), dtype, "params")
    layout = data.draw(st.sampled_from(["own", "expand", "strided", "grads=params"]), label="params layout")
    if layout == "expand":
        x = x[0].expand(m, d)
    elif layout == "strided":
        wide = torch.zeros(m, d + 2, dtype=dtype)
        wide[:, :d] = x
        x = wide[:, :d]
    g = x if layout == "grads=params" else _values(data, (m, d), dtype, "grads")
    ids = torch.tensor(data.draw(st.lists(st.integers(-2, n + 1), min_size=m, max_size=m), label="client_ids"))
    rule = data.draw(st.sampled_from(["sps", "momentum", "mass", "scaffold"]), label="rule")
    losses = _values(data, (m,), torch.float64, "losses").abs()

    def call(args, backend):
        x, g, ids, losses = args
        state = client.ClientState(n, d, dtype=cdt)
        if rule == "sps":
            return client.sps_step(params=x, grads=g, losses=losses, gamma_b=0.5, backend=backend), state
        if rule == "momentum":
            return client.local_step(params=x, grads=g, lr=0.1, momentum=0.9, state=state, client_ids=ids,
                                     backend=backend), state
        if rule == "mass":
            return client.mass_step(params=x, grads=g, state=state, client_ids=ids, eta1=0.1, gam=0.5,
                                    backend=backend), state
        ci = torch.zeros(n, d, dtype=cdt)
        return client.local_step(params=x, grads=g, lr=0.1, control=(torch.zeros(d, dtype=cdt), ci),
                                 client_ids=ids, backend=backend), state

    got, ref, args, ref_args = _run_both(call, (x, g, ids, losses), backend)
    if got is None:
        return
    _close(got[0], ref[0], torch.float32, "norm", "steps")
    _close(args[0], ref_args[0], dtype, "params", "params")
    assert bool(torch.isfinite(args[0]).all()) or not bool(torch.isfinite(x).all()) or \
        not bool(torch.isfinite(ref_args[0]).all())


# -- issue 19: keys by name, hostile scalars -------------------------------------------------------------------

KEYS = ["a.weight", "b.bias", "c.w", "d.running_mean"]


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=st.data())
def test_fuzz_keyed_accumulators_merge_and_reload_by_key(backend, data):
    """Accumulators of one state_dict model whose keys come in random orders (the model's, each client's, the
    other accumulator's, the one a saved round is loaded into): every sum equals the float64 sum by key, or the
    call raises ValueError/TypeError with the accumulator unchanged."""
    shapes = {k: data.draw(st.sampled_from([(3,), (2, 2), (1,)]), label=f"shape {k}") for k in KEYS}

    def model(seed, order):
        g = torch.Generator().manual_seed(seed)
        return {k: torch.randn(*shapes[k], generator=g, dtype=torch.float64) for k in order}

    def order():
        return data.draw(st.permutations(KEYS), label="key order")

    acc = fastagg.Accumulator(like=model(0, order()), backend=backend)
    other = fastagg.Accumulator(like=model(0, order()), backend=backend)
    want = {k: torch.zeros(shapes[k], dtype=torch.float64) for k in KEYS}
    scale = {k: torch.zeros(shapes[k], dtype=torch.float64) for k in KEYS}  # sum |w c|: the rounding's scale
    for i in range(data.draw(st.integers(1, 4), label="clients")):
        target = data.draw(st.sampled_from([acc, other]), label="which")
        w = data.draw(st.sampled_from([1.0, 2.5, 0.0, 1e308, 10**400, -1.0, "3", True]), label="weight")
        c = model(10 + i, order())
        try:
            ok = target.add(c, w, client_id=f"c{i}")
        except (TypeError, ValueError):
            continue
        if ok:
            for k in KEYS:
                want[k] += float(w) * c[k]
                scale[k] += abs(float(w)) * c[k].abs()
    try:
        acc.merge(other)
    except ValueError:  # the merged sums overflow (1e308 weights): nothing merged
        want = None
    def by_key(a):  # the parameter sums (weighted_sum) and the buffers' sums, by key
        out = dict(a.weighted_sum)
        out.update({n: b for n, b in zip(a._buffer_names, a._buffer_sums) if b is not None})
        return out

    if want is not None:
        got = by_key(acc)
        for k in KEYS:  # another summation order: equal to rounding at the scale of the terms
            if k in got:
                err = (torch.as_tensor(got[k]).reshape(shapes[k]) - want[k]).abs()
                assert bool((err <= 1e-12 * scale[k]).all()), (k, err, scale[k])
    reloaded = fastagg.Accumulator(like=model(0, order()), backend=backend)
    reloaded.load_state_dict(acc.state_dict())
    mine, theirs = by_key(reloaded), by_key(acc)
    assert set(mine) == set(theirs)
    for k in mine:
        assert torch.equal(torch.as_tensor(mine[k]), torch.as_tensor(theirs[k])), k
    assert reloaded.client_ids == acc.client_ids and reloaded.total_weight == acc.total_weight


HOSTILE = [float("nan"), float("inf"), -1.0, 10**400, "1", True, None, [1.0], 1j, torch.tensor(float("nan")),
           torch.ones(2), torch.tensor(1 + 1j)]


@FUZZ
@given(data=st.data())
def test_fuzz_hostile_scalars_get_a_type_or_value_error(data):
    """Every numeric argument of every entry point, given a hostile value, raises TypeError or ValueError (never
    OverflowError, RuntimeError or a silent result) and leaves its buffers unchanged."""
    value = data.draw(st.sampled_from(HOSTILE), label="value")
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    w = torch.zeros(8)
    losses = torch.ones(3, dtype=torch.float64)
    calls = {
        "eps": lambda: fastagg.fedexp_step(x, eps=value, params=w),
        "lr": lambda: fastagg.fedavg_step(x, lr=value, params=w),
        "weights": lambda: fastagg.fedexp_step(x, eps=1e-3, weights=[1.0, value, 1.0], params=w),
        "server lr": lambda: server.FedAdam(w, lr=value),
        "momentum": lambda: server.FedAvgM(w, momentum=value),
        "sps c": lambda: client.sps_step(params=x.clone(), grads=x, losses=losses, c=value),
        "min_sq_norm": lambda: client.sps_step(params=x.clone(), grads=x, losses=losses, min_sq_norm=value),
        "accumulator weight": lambda: fastagg.Accumulator(like=w).add(x[0], value),
        "from sums": lambda: fastagg.fedexp_step_from_sums(x[0], value, 3.0, 3, eps=1e-3),
        "step closure": lambda: server.FedAvg(w).step(x, closure=value),
    }
    name = data.draw(st.sampled_from(sorted(calls)), label="argument")
    before = snapshot([x, w])
    try:
        calls[name]()
    except (TypeError, ValueError):
        pass
    else:  # a few hostile values are valid for some arguments (None for optional ones, a one-element tensor)
        assert value is None or isinstance(value, torch.Tensor) and value.numel() == 1 and \
            bool(torch.isfinite(value)) or value is True and name == "eps", (name, value)
    for b, a in zip(before, [x, w]):
        assert torch.equal(b, a) or name in ("lr", "eps", "weights", "from sums", "accumulator weight",
                                             "step closure")


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=st.data())
def test_fuzz_async_server(backend, data):
    """Random submission sequences to the asynchronous server (versions from the past, the future, negative or
    fractional; repeated client ids; NaN updates; huge weights): every refused submission leaves the buffers,
    version and model exactly as they were; the version always equals the updates folded // K; params stay finite."""
    from fastagg.asynchronous import AsyncServer, Polynomial

    d = data.draw(st.integers(1, 30), label="d")
    k = data.draw(st.integers(1, 4), label="K")
    w = torch.zeros(d)
    srv = AsyncServer(server.FedAvg(w, backend=backend), buffer_size=k, staleness=Polynomial(0.5),
                      max_staleness=data.draw(st.sampled_from([None, 0, 2]), label="max_staleness"),
                      normalize=data.draw(st.sampled_from(["weights", "flsim"]), label="normalize"))
    folded = 0
    for _ in range(data.draw(st.integers(1, 12), label="submits")):
        v = data.draw(st.sampled_from([srv.version, max(0, srv.version - 1), max(0, srv.version - 3),
                                       srv.version + 1, -1, 0.5]), label="version")
        cid = data.draw(st.sampled_from([None, "a", "b"]), label="client")
        u = _values(data, (d,), torch.float32, "update")
        weight = data.draw(st.sampled_from([1.0, 3.0, 1e30]), label="weight")
        before = (srv.version, srv.pending, w.clone())
        try:
            res = srv.submit(u, v, weight=weight, client_id=cid)
        except (ValueError, TypeError):
            assert (srv.version, srv.pending) == before[:2] and torch.equal(w, before[2])
            continue
        folded += res.folded - sum(n for n, _ in res.discarded)  # (a buffer whose step overflows is discarded)
        assert srv.version == folded // k and srv.pending == folded % k
        assert bool(torch.isfinite(w).all()), "Inf/NaN written into params"


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=st.data())
def test_fuzz_qfedavg(backend, data):
    """QFedAvg on random client forms, dtypes, scales and losses (negative, NaN, huge): equal to the reference
    backend's step, or both refuse alike with params unchanged; never Inf/NaN in params from finite ones."""
    m, d = data.draw(st.integers(1, 6), label="M"), data.draw(st.integers(1, 30), label="d")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    deltas = _clients(data, m, d, dtype)
    losses = [data.draw(st.sampled_from([0.0, 0.5, 3.0, 1e30, -1.0, float("nan")]), label="loss") for _ in range(m)]
    q = data.draw(st.sampled_from([0.0, 0.2, 1.0, 3.0]), label="q")
    params = _values(data, (d,), torch.float32, "params")
    w, w_ref = params.clone(), params.clone()
    outcome = []
    for p, b, x in ((w, backend, deltas), (w_ref, "reference", copy.deepcopy(deltas))):
        try:
            outcome.append(bool(server.QFedAvg(p, client_learning_rate=0.1, q=q, backend=b,
                                               on_nonfinite="skip").step(x, losses).finite))
        except (ValueError, TypeError) as e:
            outcome.append(type(e))
    assert outcome[0] == outcome[1]
    if not isinstance(outcome[0], bool):  # refused: params bit for bit as they were
        assert torch.equal(w.view(torch.int32), params.view(torch.int32))
    _close(w, w_ref, torch.float32, "params", "QFedAvg params")
    if bool(torch.isfinite(params).all()):
        assert bool(torch.isfinite(w).all()), "Inf/NaN written into params"


def _check_compressed_round(us, data, d, dtype, backend):
    """The compressed clients ``us`` with drawn weights: the Accumulator's fold and the functional round on
    ``backend`` equal the reference backend's, or both refuse alike with every input unchanged; never Inf/NaN in
    params."""
    ws = [data.draw(st.sampled_from([1.0, 2.0, 0.0, 1e30]), label="weight") for _ in us]
    params = torch.randn(d, dtype=dtype)

    def call(args, backend):
        us, params = args
        acc = fastagg.Accumulator(torch.zeros(d, dtype=dtype), backend=backend)
        took = acc.add_many(us, ws, on_nonfinite="skip")
        summed = acc.weighted_sum.clone()
        res = fastagg.fedexp_step(us, eps=1e-3, weights=ws if sum(ws) > 0 else None, params=params,
                                  on_nonfinite="skip", backend=backend)
        return took, summed, bool(res.finite)

    got, ref, args, ref_args = _run_both(call, (us, params), backend)
    assert bool(torch.isfinite(args[1]).all()), "Inf/NaN written into params"
    if got is None:
        return
    assert got[0] == ref[0] and got[2] == ref[2]
    if all(got[0]):
        _close(got[1], ref[1], dtype, "mean", "sum")
        if got[2]:
            _close(args[1], ref_args[1], dtype, "params", "params")


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=st.data())
def test_fuzz_int8_clients(backend, data):
    """int8 blockwise clients (fastagg.compress) with random sizes, blocks, codes (the out-of-range -128 now and
    then) and scales (tiny, huge, NaN, Inf, zero, negative): the Accumulator's fold and the functional round equal
    the reference backend's, or both refuse alike with every input unchanged; never Inf/NaN in params."""
    from fastagg.compress import Int8Blockwise

    d = data.draw(st.integers(1, 300), label="d")
    block = data.draw(st.sampled_from([1, 3, 16, 64, 1000, 2 ** 31 - 1]), label="block")  # (the last: hostile)
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
    nblocks = -(-d // block)
    us = []
    for _ in range(data.draw(st.integers(1, 4), label="M")):
        low = data.draw(st.sampled_from([-127, -127, -127, -128]), label="lowest code")
        codes = torch.randint(low, 128, (d,), generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))),
                              dtype=torch.int8)
        scales = torch.tensor([data.draw(st.sampled_from([1.0, 0.01, 1e-30, 1e30, 3e38, float("nan"),
                                                           float("inf"), 0.0, -1.0, 1.0, 1.0, 0.5]))
                               for _ in range(nblocks)], dtype=torch.float32)
        us.append(Int8Blockwise(codes, scales, block))
    _check_compressed_round(us, data, d, dtype, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=st.data())
def test_fuzz_fp8_and_sparse_clients(backend, data):
    """fp8 blockwise clients (random bytes: the two NaN codes now and then), sparse clients (indices sorted, or
    duplicated, unsorted, out of range; values tiny, huge, NaN) and float clients (float32 / bfloat16 / float64;
    values tiny, huge, NaN, Inf) mixed in one list: the Accumulator's fold and the functional round equal the
    reference backend's, or both refuse alike with every input unchanged."""
    from fastagg.compress import Fp8Blockwise, SparseUpdate

    d = data.draw(st.integers(1, 300), label="d")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
    us = []
    for _ in range(data.draw(st.integers(1, 4), label="M")):
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
        kind = data.draw(st.sampled_from(["fp8", "sparse", "float"]), label="kind")
        if kind == "float":
            x = torch.randn(d, generator=g) * data.draw(st.sampled_from([1.0, 1e-30, 1e30, float("nan"),
                                                                          float("inf")]), label="float scale")
            us.append(x.to(data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))))
        elif kind == "fp8":
            block = data.draw(st.sampled_from([1, 7, 64, 1000]), label="block")
            codes = torch.randint(0, 256, (d,), generator=g, dtype=torch.int32).to(torch.uint8)
            if data.draw(st.sampled_from([False, False, True]), label="finite codes only"):
                codes[(codes & 0x7F) == 0x7F] = 0
            scales = torch.tensor([data.draw(st.sampled_from([1.0, 1e-30, 1e30, float("nan"), 0.0, 1.0]))
                                   for _ in range(-(-d // block))], dtype=torch.float32)
            us.append(Fp8Blockwise(codes.view(torch.float8_e4m3fn), scales, block))
        else:
            k = data.draw(st.integers(0, d), label="k")
            idx = torch.sort(torch.randperm(d, generator=g)[:k]).values
            how = data.draw(st.sampled_from(["sorted", "sorted", "sorted", "duplicated", "unsorted", "outside"]))
            if k >= 2 and how == "duplicated":
                idx[1] = idx[0]
            elif k >= 2 and how == "unsorted":
                idx = idx.flip(0)
            elif k >= 1 and how == "outside":
                idx[-1] = d
            vals = torch.randn(k, generator=g) * data.draw(st.sampled_from([1.0, 1e-30, 1e30, float("nan")]))
            us.append(SparseUpdate(idx.to(data.draw(st.sampled_from([torch.int32, torch.int64]))), vals, d))
    _check_compressed_round(us, data, d, dtype, backend)
