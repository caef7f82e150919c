"""Real use and hostile input, one test per class of failure (issue 9): buffers of the wrong dtype, shape or
device, overlapping outputs, out-of-range indices, checkpoints that lie, numbers at the edge of their dtype,
models with BatchNorm, model.parameters(), named clients in another order, threads. Each bad call must raise an
error naming what is wrong with every buffer unchanged, or give the reference's numbers."""
from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch

import fastagg
from fastagg import client, server
from fastagg.testing import assert_close, assert_unchanged, cpu_backends, snapshot

BACKENDS = cpu_backends()
OPTIMIZERS = {
    "FedAvg": {}, "FedAvgM": dict(momentum=0.9), "FedExP": dict(eps=1e-3), "FedExPM": dict(eps=1e-3),
    "FedACG": {}, "FedAdam": {}, "FedYogi": {}, "FedAdagrad": {}, "FedAMS": {},
    "Scaffold": dict(num_clients=10), "ScaffoldExP": dict(num_clients=10, eps=1e-3),
}


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _step(opt, name, deltas, **kw):
    if name.startswith("Scaffold"):
        return opt.step(deltas, 0.5 * deltas, **kw)
    return opt.step(deltas, **kw)


# ---- dtypes -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_mixed_dtypes_are_converted_on_load(name, backend):
    """float64 deltas with float32 params (the C++ apply pass used to write 8-byte elements into 4-byte state:
    heap corruption) and float32 deltas with float64 params: the math and state follow the params' dtype."""
    d = 301
    for delta_dtype, param_dtype in ((torch.float64, torch.float32), (torch.float32, torch.float64),
                                     (torch.bfloat16, torch.float32)):
        w = _randn(d, seed=1, dtype=param_dtype)
        ref_w = w.clone()
        opt = getattr(server, name)(w, backend=backend, **OPTIMIZERS[name])
        ref = getattr(server, name)(ref_w, backend="reference", **OPTIMIZERS[name])
        for t in range(3):
            deltas = 0.1 * _randn(4, d, seed=10 + t, dtype=delta_dtype)
            _step(opt, name, deltas)
            _step(ref, name, deltas.to(param_dtype))
        tol = 1e-12 if param_dtype == torch.float64 else 1e-5
        assert_close(w, ref_w, rtol=tol, atol=tol, name=f"{name} {delta_dtype} deltas, {param_dtype} params")
        for k, v in opt.flat_state.items():
            assert v.dtype == ref.flat_state[k].dtype, k


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_params_stay_float64_exact(backend):
    """An all-zero float32 update leaves float64 params bit-identical (they were rounded to float32 before)."""
    w = torch.full((7,), 1.0, dtype=torch.float64) + 1e-12
    before = w.clone()
    fastagg.fedavg_step(torch.zeros(3, 7), params=w, backend=backend)
    assert torch.equal(w, before)
    fastagg.fedavg_step(torch.full((3, 7), 0.5), params=w, backend=backend)
    assert torch.equal(w, before + 0.5)


# ---- the C++ binding checks what it is handed ----------------------------------------------------------------


def test_cpu_binding_rejects_bad_buffers_itself():
    """The compiled module is called directly, past every Python check: wrong dtype, wrong length, an index out
    of range, overlapping outputs, a non-capsule. Each is a named error; no buffer changes."""
    from fastagg.backends import cpu

    C = cpu.compiled()
    dl = cpu._dl
    x = _randn(3, 10)
    mean, sq, bad, msq = torch.zeros(10), torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.bool), \
        torch.zeros(1, dtype=torch.float64)
    w = torch.full((3,), 1 / 3, dtype=torch.float64)
    outs = [mean, sq, bad, msq]
    before = snapshot(outs + [x])

    def call(rows=None, weights=None, mean_out=None, sq_out=None, lens=(10,)):
        C.round_stats(dl(x) if rows is None else rows, None, list(lens), dl(w) if weights is None else weights,
                      None, None, 0.0, dl(mean) if mean_out is None else mean_out, dl(sq) if sq_out is None else sq_out,
                      dl(bad), dl(msq), 0.0, 0, 0)  # (no noise: sigma, seed, round)

    with pytest.raises(TypeError, match="weights must be float64"):
        call(weights=dl(w.float()))
    with pytest.raises(ValueError, match="weights has 2 elements; expected 3"):
        call(weights=dl(w[:2]))
    with pytest.raises(ValueError, match="deltas have 10 columns; expected 12"):
        call(lens=(12,))
    with pytest.raises(ValueError, match="mean_out has 9 elements"):
        call(mean_out=dl(mean[:9]))
    with pytest.raises(ValueError, match="mean_out overlaps deltas"):
        call(mean_out=dl(x[0]))
    with pytest.raises(TypeError, match="DLPack capsule"):
        call(rows=x.data_ptr())
    with pytest.raises(TypeError, match="sq_norms_out must be float64"):
        call(sq_out=dl(sq.float()))
    assert_unchanged(before, outs + [x], "buffers")
    # local_step: an index outside the population, a written table whose rows overlap
    params, grads = torch.zeros(2, 10), torch.ones(2, 10)
    ci, c = torch.zeros(5, 10), torch.zeros(10)
    step = torch.zeros(2, dtype=torch.float64)
    snap = snapshot([params, ci, step])

    def local(ci_index, x_base=params):
        C.local_step(2, 10, (dl(x_base), None, False), (dl(grads), None, False), None, dl(c),
                     (dl(ci), ci_index, False), None, 0.1, 0.0, 0.0, 0.0, 0.0, None, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-30,
                     0, 0, dl(step))

    with pytest.raises(ValueError, match=r"client_ids\[0\] = -1 is outside \[0, 5\)"):
        local(dl(torch.tensor([-1, 0])))
    with pytest.raises(ValueError, match="client_ids\\[1\\] = 5 is outside"):
        local(dl(torch.tensor([0, 5])))
    with pytest.raises(ValueError, match="rows overlap"):
        local(dl(torch.tensor([0, 1])), x_base=torch.zeros(10).expand(2, 10))
    assert_unchanged(snap, [params, ci, step], "local-step buffers")


# ---- aliasing ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_that_alias_inputs_are_rejected(backend):
    x = _randn(4, 20)
    w = _randn(20, seed=1)
    before = snapshot([x, w])
    with pytest.raises(ValueError, match="mean_out overlaps deltas"):
        fastagg.fedexp_step(x, eps=1e-3, mean_out=x[1], backend=backend)
    with pytest.raises(ValueError, match="overlaps eval_out"):
        fastagg.fedexp_step(x, eps=1e-3, params=w, eval_out=w, backend=backend)
    with pytest.raises(ValueError, match="params entry 0 overlaps deltas"):
        fastagg.fedexp_step(x, eps=1e-3, params=x[2], backend=backend)
    with pytest.raises(ValueError, match="overlaps"):
        fastagg.fedexp_step(x, eps=1e-3, params=[w[:10], w[5:15]], backend=backend)
    opt = server.FedAdam(w, backend=backend)
    opt.step(x)
    with pytest.raises(ValueError, match="overlaps"):
        opt.step(opt.flat_state["m"].reshape(1, -1))
    assert_unchanged(before[0], x, "deltas")
    # client steps: params whose rows share memory, grads that are the params
    shared = torch.zeros(20).expand(3, 20)
    with pytest.raises(ValueError, match="share memory"):
        client.local_step(params=shared, grads=torch.ones(3, 20), lr=0.1, backend=backend)
    p = torch.zeros(3, 20)
    with pytest.raises(ValueError, match="params overlaps grads"):
        client.local_step(params=p, grads=p, lr=0.1, backend=backend)


# ---- checkpoints ---------------------------------------------------------------------------------------------


def _format1(opt) -> dict:
    """The checkpoint fastagg wrote before its optimizers were torch Optimizers (format 1: flat buffers by name)."""
    return {"format": 1, "optimizer": type(opt).__name__, "hyperparameters": dict(opt.hyperparameters),
            "layout": opt.layout.signature(), "state": {k: v.clone() for k, v in opt.flat_state.items()}}


@pytest.mark.parametrize("form", ["torch", "format 1"])
def test_server_load_state_dict_checks_everything_and_changes_nothing(form):
    w = _randn(10)
    opt = server.FedAdam(w, lr=0.1)
    opt.step(0.1 * _randn(3, 10, seed=2))
    good = opt.state_dict() if form == "torch" else _format1(opt)
    before_state, before_lr = snapshot(opt.flat_state), opt.lr

    def broken(change):
        sd = opt.state_dict() if form == "torch" else _format1(opt)
        change(sd["state"][0] if form == "torch" else sd["state"],
               sd["param_groups"][0] if form == "torch" else sd["hyperparameters"],
               sd["fastagg"] if form == "torch" else sd)
        return sd

    cases = [
        (lambda st, hp, meta: st.__setitem__("m", torch.zeros(3)), ValueError, "'m' .*has shape"),
        (lambda st, hp, meta: st.__setitem__("m", torch.zeros(10, dtype=torch.float64)), TypeError, "'m' has dtype"),
        (lambda st, hp, meta: st.__setitem__("v", torch.full((10,), float("nan"))), ValueError, "NaN or Inf"),
        (lambda st, hp, meta: st.__setitem__("bogus", torch.zeros(10)), ValueError, "'bogus' is not one"),
        (lambda st, hp, meta: st.__setitem__("step", torch.tensor(-1.0, dtype=torch.float64)), ValueError, "step"),
        (lambda st, hp, meta: st.__setitem__("step", torch.tensor(1.5, dtype=torch.float64)), ValueError, "step"),
        (lambda st, hp, meta: hp.__setitem__("lr", -1.0), ValueError, "lr must be"),
        (lambda st, hp, meta: hp.__setitem__("betas", (0.9, 1.5)), ValueError, "betas"),
        (lambda st, hp, meta: hp.pop("tau"), ValueError, "hyperparameters"),
        (lambda st, hp, meta: meta.__setitem__("optimizer", "FedYogi"), ValueError, "FedYogi"),
        (lambda st, hp, meta: st.__setitem__("m", [0.0] * 10), TypeError, "expected a tensor"),
        (lambda st, hp, meta: meta.__setitem__("format", 7), ValueError, "format 7"),
    ]
    for change, err, match in cases:
        with pytest.raises(err, match=match):
            opt.load_state_dict(broken(change))
        assert_unchanged(before_state, opt.flat_state, "optimizer state")
        assert opt.lr == before_lr
    opt.load_state_dict(good)  # the real one still loads


def test_server_load_state_dict_checks_the_torch_shape():
    """Per-parameter slices: every parameter's state present, shaped like it, one dtype and one round counter."""
    params = [_randn(6), _randn(4).reshape(2, 2)]
    opt = server.FedAvgM(params, lr=0.5, momentum=0.9)
    opt.step([[0.1 * _randn(6, seed=3), 0.1 * _randn(4, seed=4).reshape(2, 2)]])
    before = snapshot(opt.flat_state)

    def broken(change):
        sd = opt.state_dict()
        change(sd)
        return sd

    for change, err, match in [
        (lambda sd: sd["state"][1].pop("momentum_buffer"), ValueError, r"\[1\] has no 'momentum_buffer'"),
        (lambda sd: sd["state"][1].__setitem__("momentum_buffer", torch.zeros(4)), ValueError,
         r"parameter 1 has shape \(4,\); the parameter has shape \(2, 2\)"),
        (lambda sd: sd["state"][1].__setitem__("momentum_buffer", torch.zeros(2, 2, dtype=torch.float64)), TypeError,
         "parameter 0's has torch.float32"),
        (lambda sd: sd["state"][1].__setitem__("step", torch.tensor(0.0, dtype=torch.float64)), ValueError,
         "one round counter"),
        (lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])), ValueError, "one group"),
        (lambda sd: sd["param_groups"][0].__setitem__("params", [0]), ValueError, "layout has 2 entries"),
        (lambda sd: sd.pop("fastagg"), ValueError, "no 'fastagg' entry"),
        (lambda sd: sd["state"].__setitem__(0, "garbage"), ValueError, "expected a dict"),
    ]:
        with pytest.raises(err, match=match):
            opt.load_state_dict(broken(change))
        assert_unchanged(before, opt.flat_state, "optimizer state")
    sgd = torch.optim.SGD([torch.zeros(6, requires_grad=True)], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="a torch optimizer's state_dict"):
        opt.load_state_dict(sgd.state_dict())


def test_client_state_load_state_dict_checks_everything_and_changes_nothing():
    st = client.ClientState(4, 6)
    client.local_step(params=torch.zeros(2, 6), grads=torch.ones(2, 6), lr=0.1, momentum=0.9, state=st,
                      client_ids=torch.tensor([0, 2]))
    before = snapshot(st.vectors)
    for change, err, match in [
        (lambda sd: sd["vectors"].__setitem__("momentum", torch.zeros(1, 6)), ValueError, "shape"),
        (lambda sd: sd["vectors"].__setitem__("momentum", torch.zeros(4, 6, dtype=torch.float64)), TypeError, "dtype"),
        (lambda sd: sd["vectors"].__setitem__("momentum", torch.full((4, 6), float("inf"))), ValueError, "NaN or Inf"),
        (lambda sd: sd["vectors"].__setitem__("evil", torch.zeros(4, 6)), ValueError, "'evil' is not one"),
        (lambda sd: sd["scalars"].__setitem__("decsps_steps", torch.full((4,), -1.0, dtype=torch.float64)),
         ValueError, "whole numbers"),
        (lambda sd: sd.__setitem__("dim", 7), ValueError, "4 clients x 7"),
    ]:
        sd = st.state_dict()
        change(sd)
        with pytest.raises(err, match=match):
            st.load_state_dict(sd)
        assert_unchanged(before, st.vectors, "client state")


# ---- indices -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_client_ids_out_of_range_are_rejected_without_state(backend):
    """Negative ids read before the start of c_i (garbage into params, or a segfault) on the C++ path."""
    x, g = torch.zeros(2, 10), torch.ones(2, 10)
    ci = torch.zeros(5, 10)
    for ids in ([-1, 0], [0, 5]):
        with pytest.raises(ValueError, match=r"client_ids must be in \[0, 5\)"):
            client.local_step(params=x, grads=g, lr=0.1, control=(torch.zeros(10), ci),
                              client_ids=torch.tensor(ids), backend=backend)
    assert float(x.abs().max()) == 0.0


# ---- numbers at the edge of their dtype ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_steps_that_do_not_fit_the_params_dtype_are_refused(backend):
    w = torch.zeros(10)
    with pytest.raises(ValueError, match="overflows torch.float32"):
        server.FedAvg(w, lr=1e39, backend=backend).step(torch.ones(2, 10))
    stats = server.FedAvg(w, lr=1e39, backend=backend, on_nonfinite="skip").step(torch.ones(2, 10))
    assert not bool(stats.finite) and float(w.abs().max()) == 0.0
    # FedExP with eps = 0 and clients that nearly cancel: eta = 2e60, finite in float64, Inf in float32
    d = torch.zeros(2, 10)
    d[0, 0], d[1, 0], d[1, 1] = 1.0, -1.0, 1e-30
    with pytest.raises(ValueError, match="overflows torch.float32"):
        fastagg.fedexp_step(d, eps=0.0, params=w, backend=backend)
    # eta fits float32 (2e12) but eta * mean does not
    d = torch.full((2, 10), 1e33)
    d[1] = -1e33 * (1 - 1e-6)
    with pytest.raises(ValueError, match="overflows torch.float32"):
        fastagg.fedexp_step(d, eps=0.0, params=w, backend=backend)
    assert float(w.abs().max()) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_elements_that_would_overflow_keep_their_value(backend):
    """float16 params near 65504: the step itself fits, a few elements' new values do not. They keep their old
    values (never Inf), are counted, and "raise" mode says so."""
    w = torch.full((8,), 100.0, dtype=torch.float16)
    w[:2] = 64992.0  # float16's largest finite is 65504
    deltas = torch.full((2, 8), 1000.0, dtype=torch.float16)
    stats = server.FedAvg(w, backend=backend, on_nonfinite="skip").step(deltas)
    assert bool(torch.isfinite(w).all())
    assert w[:2].tolist() == [64992.0, 64992.0] and w[2:].tolist() == [1100.0] * 6
    assert int(stats.overflowed) == 2
    with pytest.raises(ValueError, match="2 elements of params"):
        server.FedAvg(w, backend=backend).step(deltas)
    assert bool(torch.isfinite(w).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_near_float64_max_do_not_overflow(backend):
    res = fastagg.fedexp_step(torch.ones(2, 5), eps=1e-3, weights=[1e308, 1e308], backend=backend)
    assert torch.equal(res.mean_flat, torch.ones(5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_client_that_would_poison_the_accumulator_is_rejected(backend):
    acc = fastagg.Accumulator(torch.zeros(6), backend=backend)
    acc.add(torch.ones(6), weight=2.0)
    acc.add(torch.full((6,), 3.0), weight=1.0)
    before = snapshot([acc.weighted_sum, acc.weighted_sq_norm_sum])
    poison = torch.zeros(6)
    poison[2] = 3e38  # finite and steppable alone, but 10 * 3e38 overflows the float32 sum
    with pytest.raises(ValueError, match="would overflow the running sums"):
        acc.add(poison, weight=10.0)
    assert not acc.add(poison, weight=10.0, on_nonfinite="skip")
    assert_unchanged(before, [acc.weighted_sum, acc.weighted_sq_norm_sum], "accumulator")
    assert acc.num_clients == 2 and acc.total_weight == 3.0


# ---- real models ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_takes_model_parameters_outside_no_grad(name):
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    before = [p.detach().clone() for p in net.parameters()]
    opt = getattr(server, name)(net.parameters(), **OPTIMIZERS[name])
    d = sum(p.numel() for p in net.parameters())
    _step(opt, name, 0.1 * _randn(3, d, seed=3))
    assert all(p.requires_grad for p in net.parameters())
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, net.parameters()))
    out = net(torch.ones(2, 4)).sum()
    out.backward()  # autograd still works on the stepped parameters


def _bn_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3))


def _client_update(global_sd, seed):
    """One client's local training of the BatchNorm CNN: a few SGD steps in train mode (running statistics move)."""
    net = _bn_net()
    net.load_state_dict(global_sd)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(8, 1, 6, 6, generator=g) + seed % 3
        y = torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return {k: v - global_sd[k] for k, v in net.state_dict().items()}


@pytest.mark.parametrize("params_form", ["module", "state_dict"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batchnorm_buffers_are_averaged_not_extrapolated(backend, params_form):
    """A small CNN with BatchNorm over four FedExP rounds, clients sending state_dict updates: parameters take
    FedExP's step; running statistics become the clients' weighted average and never count in eta;
    num_batches_tracked advances by the average advance. Checked against a float64 hand-written FedExP."""
    net = _bn_net()
    ref = {k: v.double().clone() for k, v in net.state_dict().items()}
    params = net if params_form == "module" else net.state_dict(keep_vars=False)
    opt = server.FedExP(params, eps=1e-3, backend=backend)
    buffer_names = {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for t in range(4):
        gsd = {k: v.clone() for k, v in net.state_dict().items()}
        updates = [_client_update(gsd, seed=10 * t + i) for i in range(3)]
        weights = [1.0, 2.0, 3.0]
        stats = opt.step(updates, weights=weights)
        # float64 oracle
        p = torch.tensor(weights, dtype=torch.float64) / 6.0
        pnames = [k for k in ref if k not in buffer_names]
        deltas = [torch.cat([u[k].double().flatten() for k in pnames]) for u in updates]
        mean = sum(pi * dv for pi, dv in zip(p, deltas))
        avg_sq = sum(pi * dv.square().sum() for pi, dv in zip(p, deltas))
        eta = max(1.0, float(avg_sq / (2 * (mean.square().sum() + 1e-3))))
        assert_close(stats.eta, torch.tensor(eta, dtype=torch.float64), rtol=1e-5, atol=0, name=f"eta round {t}")
        off = 0
        for k in pnames:
            n = ref[k].numel()
            ref[k] += eta * mean[off:off + n].view_as(ref[k])
            off += n
        for k in ("1.running_mean", "1.running_var"):
            ref[k] += sum(pi * u[k].double() for pi, u in zip(p, updates))
        ref["1.num_batches_tracked"] += torch.round(sum(pi * u["1.num_batches_tracked"].double()
                                                        for pi, u in zip(p, updates)))
        now = net.state_dict() if params_form == "module" else params
        for k, v in ref.items():
            assert_close(now[k], v, rtol=1e-5, atol=1e-6, name=f"{k} round {t}")
    state = net.state_dict() if params_form == "module" else params
    assert bool((state["1.running_var"] > 0).all())
    if params_form == "state_dict":
        net.load_state_dict(params)
    net.eval()
    assert bool(torch.isfinite(net(torch.randn(5, 1, 6, 6))).all())


def test_buffers_that_cannot_be_updated_are_reported():
    net = _bn_net()
    opt = server.FedAvg(net)
    d = sum(p.numel() for p in net.parameters())
    with pytest.warns(RuntimeWarning, match="carry none"):
        opt.step(torch.zeros(2, d))
    opt2 = server.FedAvg(list(net.parameters()))
    upd = {k: torch.zeros_like(v) for k, v in net.state_dict().items()}
    with pytest.warns(RuntimeWarning, match="cannot take"):
        opt2.step([upd, upd])


@pytest.mark.parametrize("backend", BACKENDS)
def test_named_clients_are_matched_by_key(backend):
    """state_dict updates whose keys come in another order give the same step; a missing or extra key raises."""
    w = {"a": torch.zeros(3), "b": torch.zeros(2)}
    u1 = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([4.0, 5.0])}
    u2_reordered = {"b": torch.tensor([6.0, 7.0]), "a": torch.tensor([8.0, 9.0, 10.0])}
    fastagg.fedavg_step([u1, u2_reordered], params=w, backend=backend)
    assert w["a"].tolist() == [4.5, 5.5, 6.5] and w["b"].tolist() == [5.0, 6.0]
    with pytest.raises(ValueError, match="lacks parameter entries 'b'"):
        fastagg.fedavg_step([u1, {"a": torch.zeros(3)}], params=w, backend=backend)
    with pytest.raises(ValueError, match="'c'"):
        fastagg.fedavg_step([u1, {**u1, "c": torch.zeros(1)}], params=w, backend=backend)


# ---- threads -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulator_add_from_four_threads(backend):
    d, per_thread = 5_003, 25
    acc = fastagg.Accumulator(torch.zeros(d), backend=backend)
    updates = [[_randn(d, seed=100 * t + k) for k in range(per_thread)] for t in range(4)]

    def work(t):
        for k, u in enumerate(updates[t]):
            acc.add(u, weight=1.0 + k % 3)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    flat = [(u, 1.0 + k % 3) for t in range(4) for k, u in enumerate(updates[t])]
    ref = sum(w * u.double() for u, w in flat)
    assert acc.num_clients == 100 and acc.total_weight == sum(w for _, w in flat)
    assert_close(acc.weighted_sum, ref, rtol=1e-5, atol=1e-4, name="weighted sum")
    # float32 sums within a block, float64 across: 1e-6 (one lost or doubled client would be off by ~1e-2)
    assert_close(acc.weighted_sq_norm_sum, sum(w * u.double().square().sum() for u, w in flat), rtol=1e-6, atol=0,
                 name="weighted squared norms")


def test_numpy_from_another_framework():
    """numpy arrays (as Flower ships them): deltas and params, float32 and read-only."""
    d = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    w = np.zeros(8, np.float32)
    res = fastagg.fedexp_step(d, eps=1e-3, params=w)
    assert isinstance(res.eval_params, np.ndarray) and np.all(np.isfinite(w)) and np.any(w != 0)
    ro = np.zeros(8, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fastagg.fedexp_step(d, eps=1e-3, params=ro)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d.flags.writeable = False  # read-only deltas are fine: never written
        fastagg.fedexp_step(d, eps=1e-3)
