"""The Triton kernels on the device they are for, against the float64 reference.

On a machine with a CUDA GPU this runs the compiled kernels on the GPU (the device check of
bench/device_check.sh) over every kernel family, input dtype and input form, M from 1 to 1000, and one
2^31 + 5-element row. Without one, conftest sets TRITON_INTERPRET=1 and the same checks run the kernels through
the interpreter on CPU tensors at smaller sizes, so these tests stay tested where CI runs. The GPU-only cases
(a CUDA graph capture, the 2^31 + 5-element row, a step with no host sync) say so.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import fastagg
from fastagg import client, server
from fastagg.testing import SweepCounter, add_all_queued, assert_close, tolerance

# Without CUDA the root conftest has set TRITON_INTERPRET=1, so the triton backend runs on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (what it checks does not exist in the interpreter)")

local_mod = importlib.import_module("fastagg.backends.triton.local_step")

INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# (M, d): one client and one element, short ragged rows, many clients, long rows crossing many column blocks
# (3_000_001: the wide one-client tiles of 2-byte inputs).
ROUND_SHAPES = [(1, 1), (1, 4099), (7, 5), (33, 70_001), (1000, 3001), (1000, 1), (5, 3_000_001)] if ON_GPU else \
    [(1, 1), (7, 5), (3, 9000), (37, 130)]


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _forms(x: torch.Tensor, form: str):
    """``x`` ([M, d], on the device) as a matrix, a list of flat rows, or per-layer lists (three ragged layers)."""
    if form == "matrix":
        return x
    if form == "list":
        return list(x.unbind(0))
    d = x.shape[1]
    cuts = [0, d // 3, d // 3 + (d - d // 3) // 2, d] if d >= 3 else [0, d]
    return [[r[a:b] for a, b in zip(cuts, cuts[1:])] for r in x.unbind(0)]


def _layers(w: torch.Tensor, form: str):
    """params in the form matching ``_forms``: flat, or the same layer cut (as separate tensors)."""
    if form != "per-layer":
        return w
    d = w.numel()
    cuts = [0, d // 3, d // 3 + (d - d // 3) // 2, d] if d >= 3 else [0, d]
    return [w[a:b].clone() for a, b in zip(cuts, cuts[1:])]


def _flat(p) -> torch.Tensor:
    return p if isinstance(p, torch.Tensor) else torch.cat([t.reshape(-1) for t in p])


@pytest.mark.parametrize("form", ["matrix", "list", "per-layer"])
@pytest.mark.parametrize("m,d", ROUND_SHAPES, ids=[f"M{m}-d{d}" for m, d in ROUND_SHAPES])
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_fedexp_round_on_device(dtype, m, d, form):
    deltas = 0.1 * _randn(m, d, seed=1, dtype=dtype)
    params = _randn(d, seed=2, dtype=dtype)
    weights = list(range(1, m + 1))
    x_dev = deltas.to(DEVICE)
    w_dev = _layers(params.to(DEVICE, copy=True), form)
    got = fastagg.fedexp_step(_forms(x_dev, form), eps=1e-3, weights=weights, params=w_dev, backend="triton")
    ref_params = params.double()
    ref = fastagg.fedexp_step(deltas.double(), eps=1e-3, weights=weights, params=ref_params, backend="reference")
    for what, a, b, kind in (("mean", got.mean_flat, ref.mean_flat, "mean"),
                             ("sq_norms", got.sq_norms, ref.sq_norms, "norm"), ("eta", got.eta, ref.eta, "norm"),
                             ("params", _flat(w_dev), ref_params.to(dtype), "params"),
                             ("eval", _flat(got.eval_params), ref.eval_params.to(dtype), "params")):
        rtol, atol = tolerance(dtype, kind)
        if kind == "mean" and m > 16:  # float32 sums of M terms: the error grows like sqrt(M) ulps of max|x|
            atol *= (m / 16) ** 0.5
        assert_close(a.cpu(), b, rtol=rtol, atol=atol, name=what)


ROBUST_SHAPES = [(16, 300_007), (33, 70_001), (100, 20_001), (1000, 301)] if ON_GPU else [(5, 40)]
ROBUST_DTYPES = [torch.float32, torch.bfloat16, torch.float64] if ON_GPU else [torch.float32, torch.float64]


@pytest.mark.parametrize("form", ["matrix", "list", "per-layer"])
@pytest.mark.parametrize("m,d", ROBUST_SHAPES, ids=[f"M{m}-d{d}" for m, d in ROBUST_SHAPES])
@pytest.mark.parametrize("dtype", ROBUST_DTYPES, ids=str)
def test_robust_passes_on_device(dtype, m, d, form):
    """The coordinate-select pass (median, trimmed mean, MeaMed's window) and the Gram pass on the device against
    the reference backend on float64 copies; full models against a base included."""
    from fastagg import robust
    from fastagg.rows import attach_base, client_rows

    deltas = 0.1 * _randn(m, d, seed=3, dtype=dtype)
    base = _randn(d, seed=4, dtype=dtype)
    for with_base in (False, True):
        x = (deltas + base) if with_base else deltas
        rows = client_rows(_forms(x.to(DEVICE), form), name="deltas")
        ref_rows = client_rows(x.double() if not with_base else x, name="deltas")
        if with_base:
            rows, _ = attach_base(rows, _layers(base.to(DEVICE), "per-layer" if form == "per-layer" else "flat"))
            ref_rows, _ = attach_base(ref_rows, base)
        for rule in (robust.Median(), robust.TrimmedMean(0.2), robust.MeaMed(m // 4)):
            got = torch.empty(d, dtype=torch.float64, device=DEVICE)
            want = torch.empty(d, dtype=torch.float64)
            sq, bad = robust._select_coords(rows, rule.positions(m), "triton", got)
            robust._select_coords(ref_rows, rule.positions(m), "reference", want)
            assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12, name=f"{rule} base={with_base}")
            assert not bad.any()
        g, bad = robust.gram(rows, "triton")
        g_ref, _ = robust.gram(ref_rows, "reference")
        assert_close(g.cpu(), g_ref, rtol=1e-11, atol=1e-9, name=f"gram base={with_base}")
        assert torch.equal(g, g.T) and not bad.any()


@pytest.mark.parametrize("form", ["matrix", "per-layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dp_noise_and_release_on_device(dtype, form):
    """fastagg.privacy on the device: the generator's noise against the reference's float64 transform of the same
    Philox words (1e-5), and a server-side release (clipped mean + the noise written by the stats kernel) against
    the reference backend's; the noise's first moments on 10^7 samples (GPU) or 10^5 (interpreter)."""
    from fastagg import privacy
    from fastagg.backends import reference

    n = 10_000_000 if ON_GPU else 100_000
    z = privacy.gaussian_noise(n, seed=77, round=5, first=3, device=DEVICE, backend="triton")
    ref = reference.gaussian(n, seed=77, round=5, first=3)
    assert float(((z.cpu().double() - ref.double()).abs() / (1 + ref.double().abs())).max()) < 1e-5
    zz = z.double()
    assert abs(float(zz.mean())) < 5 / n ** 0.5 and abs(float(zz.var()) - 1) < 5 * (2 / n) ** 0.5
    m, d = 9, (300_007 if ON_GPU else 5_003)
    x = 0.01 * _randn(m, d, seed=8, dtype=dtype)
    norms = x.double().norm(dim=1).sort().values
    c = float(norms[m // 2 - 1] + norms[m // 2]) / 2  # between two clients' norms: no client sits on the bound, where
    # the last bit of its float64 squared norm (summed in another order than the reference's) decides clipped or not
    got = privacy.release(_forms(x.to(DEVICE), form), privacy.ServerSideFixedClipping(1.0, c, m, seed=4),
                          backend="triton")
    want = privacy.release(x.double(), privacy.ServerSideFixedClipping(1.0, c, m, seed=4), backend="reference")
    assert torch.equal(got.clipped.cpu(), want.clipped)
    assert_close(got.estimate.cpu().double(), want.estimate, rtol=1e-4, atol=1e-5 * c / m + 1e-6,
                 name=f"DP release {dtype} {form}")


SERVER_CASES = {
    "FedAvg": dict(lr=0.7), "FedAvgM": dict(lr=0.5, momentum=0.9, nesterov=True), "FedExP": dict(eps=1e-3),
    "FedExPM": dict(eps=1e-3, beta=0.9), "FedACG": dict(lam=0.85), "FedAdam": dict(lr=0.1, tau=1e-3),
    "FedYogi": dict(lr=0.01, tau=1e-3), "FedAdagrad": dict(lr=0.1, tau=1e-3), "FedAMS": dict(lr=0.1),
    "Scaffold": dict(num_clients=20), "ScaffoldExP": dict(num_clients=20, eps=1e-3),
}


@pytest.mark.parametrize("layers", ["flat", "per-layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(SERVER_CASES))
def test_server_optimizer_on_device(name, dtype, layers):
    d = 50_003 if ON_GPU else 5_003
    w0 = _randn(d, seed=3, dtype=dtype)
    form = "per-layer" if layers == "per-layer" else "matrix"
    w_dev, w_ref = _layers(w0.to(DEVICE, copy=True), form), w0.double()
    hyper = SERVER_CASES[name]
    opt = getattr(server, name)(w_dev, backend="triton", **hyper)
    ref = getattr(server, name)(w_ref, backend="reference", **hyper)
    rtol, atol = tolerance(dtype, "params")
    for t, m in enumerate((3, 9, 5)):
        deltas = (0.1 * _randn(m, d, seed=10 + t) + 0.01).to(dtype)
        weights = list(range(1, m + 1))
        extra = ((0.05 * _randn(m, d, seed=20 + t)).to(dtype),) if name.startswith("Scaffold") else ()
        opt.step(_forms(deltas.to(DEVICE), form), *(_forms(e.to(DEVICE), form) for e in extra), weights=weights)
        ref.step(deltas.double(), *(e.double() for e in extra), weights=weights)
        # params of dtype are rounded after every step: allow one ulp per round
        assert_close(_flat(w_dev).cpu(), w_ref, rtol=rtol * (t + 1), atol=atol * (t + 1),
                     name=f"{name} params, round {t}")
        assert_close(_flat(opt.eval_params()).cpu(), ref.eval_params(), rtol=rtol * (t + 1), atol=atol * (t + 1),
                     name=f"{name} eval params, round {t}")


SCHEDULES = ["row", "chunks", "grouped"]
CLIENT_SHAPES = [(64, 1_000), (3, 70_001), (1000, 5_000)] if ON_GPU else [(16, 1_000), (3, 20_001)]


def _forced(schedule: str, block: int):
    """``grouped``: groups of 2 rows, so that most groups wait on the one before (M = 3: a ragged last group)."""
    def config(num_rows, numel):
        return dict(schedule=schedule, BLOCK=block, CHUNK=None if schedule == "row" else 4 * block,
                    GROUP_ROWS=2, num_warps=8 if block >= 4096 else 4)
    return config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,d", CLIENT_SHAPES, ids=[f"M{m}-d{d}" for m, d in CLIENT_SHAPES])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_client_steps_on_device(schedule, m, d, dtype, monkeypatch):
    """Every client rule family through each schedule, against the float64 reference, three rounds of steps with
    state; rows whose loss is at l_star take no step (nothing of them written)."""
    block = 4096 if ON_GPU else 8192
    if schedule == "row" and d > 16 * block:
        block = 16384
    monkeypatch.setattr(local_mod, "local_config", _forced(schedule, block))
    x0 = _randn(m, d, seed=4)
    grads = [_randn(m, d, seed=5 + t) for t in range(3)]
    losses = 1.0 + torch.rand(m, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    losses[m // 2] = 0.0  # at l_star: that client takes no SPS step
    ids = torch.arange(m)
    anchor = _randn(d, seed=7)

    def run(device, dt, backend):
        x = x0.to(device, dt, copy=True)
        cdt = torch.float64 if dt == torch.float64 else torch.float32
        state = client.ClientState(m, d, dtype=cdt, device=device)
        steps = []
        for g in grads:
            g = g.to(device, dt)
            steps.append(client.sps_step(params=x, grads=g, losses=losses.to(device), c=0.5, gamma_b=0.3,
                                         prox=(anchor.to(device, dt), 0.01), clip_norm=30.0, backend=backend))
            steps.append(client.local_step(params=x, grads=g, lr=0.05, momentum=0.9, nesterov=True, state=state,
                                           client_ids=ids, weight_decay=1e-3, backend=backend))
            steps.append(client.mass_step(params=x, grads=g, state=state, client_ids=ids, eta1=0.05, gam=0.5,
                                          eta2=0.01, backend=backend))
        return x.cpu(), [s.cpu() for s in steps], {k: v.cpu() for k, v in state.vectors.items()}

    got_x, got_steps, got_state = run(DEVICE, dtype, "triton")
    # the reference sees the same quantized values: it runs in float64 on the dtype's inputs
    ref_x, ref_steps, ref_state = run("cpu", torch.float64, "reference") if dtype == torch.float32 else \
        _reference_in(dtype, run)
    for t, (a, b) in enumerate(zip(got_steps, ref_steps)):
        assert_close(a, b, rtol=1e-4, atol=1e-7, name=f"steps {t}")
    assert got_steps[0][m // 2] == 0.0
    rtol, atol = (1e-4, 1e-5) if dtype == torch.float32 else tolerance(dtype, "params")
    assert_close(got_x, ref_x, rtol=rtol * 9, atol=atol * 9, name="params")  # 9 steps, one rounding each
    for k, v in ref_state.items():
        assert_close(got_state[k], v, rtol=1e-4 if dtype == torch.float32 else rtol * 9,
                     atol=1e-5 if dtype == torch.float32 else atol * 9, name=f"state {k}")


def test_grouped_schedule_gives_the_bits_of_chunks(monkeypatch):
    """The grouped schedule (one launch, rows in L2-sized groups, pass 2 waiting on per-row counts) sums each row's
    chunk partials in the order ``chunks`` does: the same params, steps and momentum, bit for bit, for groups of one
    row, several rows and a ragged last group."""
    m, d = (37, 100_003) if ON_GPU else (5, 20_001)
    block = 4096 if ON_GPU else 8192
    x0, g = _randn(m, d, seed=70).to(DEVICE), (0.1 * _randn(m, d, seed=71)).to(DEVICE)
    losses = (1.0 + torch.rand(m, generator=torch.Generator().manual_seed(72), dtype=torch.float64)).to(DEVICE)
    out = {}
    for schedule, rows in (("chunks", None), ("grouped", 1), ("grouped", 2), ("grouped", m)):
        monkeypatch.setattr(local_mod, "local_config", lambda M, n, s=schedule, r=rows: dict(
            schedule=s, BLOCK=block, CHUNK=4 * block, GROUP_ROWS=r, num_warps=8 if block >= 4096 else 4))
        x = x0.clone()
        state = client.ClientState(m, d, device=DEVICE)
        steps = [client.sps_step(params=x, grads=g, losses=losses, gamma_b=0.3, backend="triton"),
                 client.local_step(params=x, grads=g, lr=0.05, momentum=0.9, state=state,
                                   client_ids=torch.arange(m), backend="triton")]
        out[(schedule, rows)] = (x, steps, state.vector("momentum"))
    ref = out[("chunks", None)]
    for key, (x, steps, buf) in out.items():
        assert torch.equal(x, ref[0]) and torch.equal(buf, ref[2]), key
        assert all(torch.equal(a, b) for a, b in zip(steps, ref[1])), key


def _reference_in(dtype, run):
    """The reference backend run on ``dtype`` params on the CPU (the same per-step rounding of params)."""
    return run("cpu", dtype, "reference")


@gpu_only
def test_server_step_replays_in_a_cuda_graph():
    """A whole server step (stats pass, step size, apply pass) is captured once with on_nonfinite="skip" and
    replayed for 3 rounds; params, state and statistics equal eager steps bit for bit. A round with a NaN client
    replays as skipped (params unchanged), as eagerly."""
    d, m = 300_007, 8
    rounds = [(0.1 * _randn(m, d, seed=40 + t)).cuda() for t in range(4)]
    rounds[3][2, 5] = float("nan")
    weights = [torch.arange(1.0, m + 1, device="cuda") * (t + 1) for t in range(4)]
    for name in ("FedAdam", "FedExPM", "FedAvgM"):
        hyper = {"FedAdam": dict(lr=0.1), "FedExPM": dict(eps=1e-3), "FedAvgM": dict(momentum=0.9)}[name]
        w_eager = _randn(d, seed=41).cuda()
        w_graph = w_eager.clone()
        eager = getattr(server, name)(w_eager, on_nonfinite="skip", **hyper)
        graphed = getattr(server, name)(w_graph, on_nonfinite="skip", **hyper)
        static_x = rounds[0].clone()
        static_w = weights[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles, allocates state, builds the kept tables
            graphed.step(static_x, weights=static_w)
        torch.cuda.current_stream().wait_stream(side)
        eager.step(rounds[0], weights=weights[0])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            stats = graphed.step(static_x, weights=static_w)
        for t in (1, 2, 3):
            static_x.copy_(rounds[t])
            static_w.copy_(weights[t])
            graph.replay()
            ref = eager.step(rounds[t], weights=weights[t])
            torch.cuda.synchronize()
            assert torch.equal(w_graph, w_eager), f"{name}: params differ after replay {t}"
            for k, v in eager.flat_state.items():
                assert torch.equal(graphed.flat_state[k], v), f"{name}: state {k!r} differs after replay {t}"
            assert torch.equal(stats.eta, ref.eta) and torch.equal(stats.finite, ref.finite)
        assert not bool(stats.finite)  # the last round held a NaN: skipped in both


def test_server_state_stays_in_place_across_steps():
    """What makes graph replay correct, checked on any device: a step writes every state tensor in place (a captured
    graph replays into the addresses it saw), and the reused buffers keep their addresses."""
    d = 1_003
    for name, hyper in (("FedAdam", dict(lr=0.1)), ("FedExPM", dict(eps=1e-3)), ("FedAvgM", dict(momentum=0.9)),
                        ("FedAMS", {}), ("FedACG", {})):
        opt = getattr(server, name)(_randn(d, seed=1).to(DEVICE), on_nonfinite="skip", backend="triton", **hyper)
        opt.step((0.1 * _randn(4, d, seed=2)).to(DEVICE))
        where = {k: v.data_ptr() for k, v in opt.flat_state.items()}
        for t in range(3):
            opt.step((0.1 * _randn(4, d, seed=3 + t)).to(DEVICE))
        assert {k: v.data_ptr() for k, v in opt.flat_state.items()} == where, name
        assert opt.round == 4


@gpu_only
def test_an_optimizer_follows_model_cuda_like_torch_optim():
    """A server optimizer built on a CPU module keeps working after ``model.cuda()``: the next step runs on the GPU
    (Triton) with the state moved there, equal to an optimizer that never moved (C++ on the CPU) to float32
    rounding; before, the step wrote the CPU storage the model no longer used."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    twin = copy.deepcopy(model)
    opt, ref = server.FedAdam(model), server.FedAdam(twin)
    g = torch.Generator().manual_seed(1)
    rounds = [[{k: 0.05 * torch.randn(v.shape, generator=g) for k, v in model.named_parameters()} for _ in range(3)]
              for _ in range(3)]
    opt.step(rounds[0])
    ref.step(rounds[0])
    model.cuda()
    for deltas in rounds[1:]:
        opt.step([{k: v.cuda() for k, v in d.items()} for d in deltas])
        ref.step(deltas)
    assert opt.flat_state["m"].device.type == "cuda" and opt.round == 3
    for (k, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-6, msg=k)


@gpu_only
def test_device_weights_need_no_host_sync():
    """With on_nonfinite="skip" and weights already on the GPU, a step reads nothing back to the host (torch's
    sync debug mode raises on any synchronizing call); invalid weights skip the round."""
    d, m = 10_001, 4
    w = _randn(d, seed=1).cuda()
    opt = server.FedAdam(w, on_nonfinite="skip")
    x = (0.1 * _randn(m, d, seed=2)).cuda()
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0], device="cuda")
    negative = torch.tensor([1.0, -2.0, 3.0, 4.0], device="cuda")
    opt.step(x, weights=weights)  # warm-up: kernel compiles and cached tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step(x, weights=weights)
        before = w.clone()
        stats = opt.step(x, weights=negative)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not bool(stats.finite) and torch.equal(w, before)


BIG = 2 ** 31 + 5


def _chunked(fn, n, step=1 << 28):
    """sum over column chunks of fn(a, b) (float64 scalars), to check 2^31-element buffers without fp64 copies."""
    return sum(fn(a, min(n, a + step)) for a in range(0, n, step))


@gpu_only
def test_64bit_offsets_on_device():
    """One row of 2^31 + 5 float32 elements (8.6 GB, offsets past int32) through the stats pass, the momentum apply
    pass (params and eval model), an Adam-family apply pass and the client step; elements past 2^31 are checked
    by value and whole buffers by float64 sums computed chunk by chunk."""
    free = torch.cuda.mem_get_info()[0]
    assert free > 48e9, f"needs ~48 GB of free GPU memory, {free / 1e9:.0f} GB free"
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, BIG, device="cuda", generator=g)
    x[0, -3:] = torch.tensor([1.5, -2.0, 4.0], device="cuda")
    res_head = x[0, :5].cpu().double()
    w = torch.zeros(BIG, device="cuda")
    w[-3:] = 10.0
    res = fastagg.fedexp_step(x, eps=0.0, params=w, on_nonfinite="skip")
    sq = _chunked(lambda a, b: x[0, a:b].double().square().sum().item(), BIG)
    assert_close(res.sq_norms.cpu(), torch.tensor([sq]), rtol=tolerance(torch.float32, "norm")[0], atol=0,
                 name="||x||^2")
    assert float(res.eta) == 1.0  # one client: avg = ||mean||^2, eta = max(1, 1/2)
    assert res.mean_flat[-3:].tolist() == [1.5, -2.0, 4.0]
    assert w[-3:].tolist() == [11.5, 8.0, 14.0]  # w + eta * mean
    assert res.eval_params[-3:].tolist() == [10.75, 9.0, 12.0]  # w_new - eta/2 * mean
    # w was 0 before its last three elements and eta = 1, weight 1: w_new == x exactly there
    assert _chunked(lambda a, b: float(not torch.equal(w[a:b], x[0, a:b])), BIG - 3) == 0
    del res
    opt = server.FedAdagrad(w, lr=0.5, tau=1.0, on_nonfinite="skip")
    opt.step(x)
    # adagrad from v = 0: w += lr * g / (|g| + tau)
    expect = [11.5 + 0.5 * 1.5 / 2.5, 8.0 - 0.5 * 2.0 / 3.0, 14.0 + 0.5 * 4.0 / 5.0]
    assert_close(w[-3:].cpu(), torch.tensor(expect), rtol=1e-6, atol=1e-6, name="adagrad tail")
    del opt
    torch.cuda.empty_cache()
    grads = torch.full_like(x, 1e-3)
    grads[0, -1] = 2.0
    steps = client.local_step(params=x, grads=grads, lr=0.5)
    assert steps.tolist() == [0.5]
    assert_close(x[0, -3:].cpu(), torch.tensor([1.5 - 0.5e-3, -2.0 - 0.5e-3, 4.0 - 1.0]), rtol=1e-6, atol=0,
                 name="client step tail")
    assert_close(x[0, :5].cpu(), res_head - 0.5e-3, rtol=1e-6, atol=1e-6, name="client step head")


def test_distributed_collectives_on_one_rank(monkeypatch):
    """fastagg.distributed on the device: NCCL on one GPU (gloo without one), world size 1.

    Every server optimizer with ``group=``: (1) as shipped, a one-rank group takes the single-process step, bit for
    bit (the group is only asked its size); (2) with the one-rank shortcut off, so every gather and all_reduce runs
    on the tensors' device, each optimizer (client-parallel, and FedAdam / FedAvgM sharded), an Accumulator's step
    and gather() agree with the single-process steps (float32: the mean's bits are the same, ||mean||^2 comes from
    its own pass, so eta agrees to rounding)."""
    import datetime

    import torch.distributed as dist

    from fastagg import distributed
    from fastagg.testing import free_port

    ran = []

    def counted(fn):
        def wrapper(*args, **kw):
            ran.append(fn.__name__)
            return fn(*args, **kw)
        return wrapper

    for fn in ("all_reduce", "all_gather"):
        monkeypatch.setattr(dist, fn, counted(getattr(dist, fn)))
    if ON_GPU:
        torch.cuda.set_device(0)
    assert not dist.is_initialized()
    dist.init_process_group("nccl" if ON_GPU else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        m, d = 6, (1_000_003 if ON_GPU else 10_007)
        x = (0.1 * _randn(m, d, seed=50)).to(DEVICE)
        c = (0.05 * _randn(m, d, seed=53)).to(DEVICE)
        weights = torch.arange(1.0, m + 1, dtype=torch.float64)

        def rounds(opt, name):
            extra = (c,) if name.startswith("Scaffold") else ()
            return [opt.step(x * (t + 1), *extra, weights=weights) for t in range(3)]

        for name, hyper in SERVER_CASES.items():  # (1) the shortcut: bit for bit
            w_ref, w = _randn(d, seed=51).to(DEVICE), _randn(d, seed=51).to(DEVICE)
            before = len(ran)
            for ref, got in zip(rounds(getattr(server, name)(w_ref, **hyper), name),
                                rounds(getattr(server, name)(w, group=group, **hyper), name)):
                assert torch.equal(w, w_ref) and float(got.eta) == float(ref.eta), name
            assert len(ran) == before, f"{name}: a one-rank group ran a collective"
        monkeypatch.setattr(distributed, "ONE_RANK_IS_LOCAL", False)
        cases = [(name, hyper, False) for name, hyper in SERVER_CASES.items()]
        cases += [("FedAdam", SERVER_CASES["FedAdam"], True), ("FedAvgM", SERVER_CASES["FedAvgM"], True)]
        for name, hyper, sharded in cases:  # (2) the collectives on the device
            w_ref, w = _randn(d, seed=51).to(DEVICE), _randn(d, seed=51).to(DEVICE)
            ref_opt = getattr(server, name)(w_ref, **hyper)
            opt = getattr(server, name)(w, group=group, sharded=sharded, **hyper)
            before = len(ran)
            for t, (ref, got) in enumerate(zip(rounds(ref_opt, name), rounds(opt, name))):
                assert float(got.eta) == pytest.approx(float(ref.eta), rel=1e-6), name
                assert_close(got.sq_norms.cpu(), ref.sq_norms.cpu(), rtol=0, atol=0, name=f"{name} norms")
                assert_close(w.cpu(), w_ref.cpu(), rtol=1e-5, atol=1e-6, name=f"{name} params round {t}")
            assert len(ran) > before, f"{name}: no collective ran"
        acc = fastagg.Accumulator(like=x[0])
        for row, n in zip(x, weights):
            acc.add(row, float(n))
        w_ref, w = _randn(d, seed=52).to(DEVICE), _randn(d, seed=52).to(DEVICE)
        ref = acc.fedexp_step(eps=1e-3, params=w_ref)
        got = acc.fedexp_step(eps=1e-3, params=w, group=group)
        assert float(got.eta) == pytest.approx(float(ref.eta), rel=1e-6)
        assert_close(w.cpu(), w_ref.cpu(), rtol=1e-5, atol=1e-6, name="accumulator params")
        assert torch.equal(distributed.gather(w, group), w)
        assert {"all_reduce", "all_gather"} <= set(ran)
    finally:
        dist.destroy_process_group()


@gpu_only
def test_host_feeder_overlaps_copies_and_folds_like_plain_adds():
    """fastagg.HostFeeder on the GPU: 7 bf16 clients from pageable tensors and from its pinned buffers (one with a
    NaN) give the same sums as adding the same clients to a CUDA accumulator directly; the NaN client is reported;
    the feeder holds two pinned buffers, whatever the number of clients."""
    d = 3_000_017
    xs = [(0.1 * _randn(d, seed=60 + i)).to(torch.bfloat16) for i in range(7)]
    xs[3][123] = float("nan")
    like = torch.zeros(d, dtype=torch.bfloat16, device="cuda")
    acc, ref = fastagg.Accumulator(like=like), fastagg.Accumulator(like=like)
    feeder = fastagg.HostFeeder(acc)
    for i, x in enumerate(xs):
        if i % 2:
            buf = feeder.buffer(torch.bfloat16)
            buf.copy_(x)
            feeder.add(buf, float(i + 1), client_id=i)
        else:
            feeder.add(x, float(i + 1), client_id=i)
        ref.add(x.cuda(), float(i + 1), on_nonfinite="skip")
    report = feeder.flush()
    assert report.folded == [0, 1, 2, 4, 5, 6] and [r[0] for r in report.refused] == [3]
    assert torch.equal(acc._sum, ref._sum) and acc.total_weight == ref.total_weight
    assert sum(p is not None for p in feeder._pinned) == 2


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_host_feeders_in_four_threads_fold_every_client_once(dtype):
    """Four threads, each with its own HostFeeder on one CUDA accumulator (pageable updates), fold all 24 clients
    exactly once: the sums equal the float64 sum of the same clients, every id is folded once."""
    from concurrent.futures import ThreadPoolExecutor

    d = 1_000_003
    xs = [(0.1 * _randn(d, seed=90 + i)).to(dtype) for i in range(24)]
    acc = fastagg.Accumulator(like=torch.zeros(d, dtype=dtype, device="cuda"))

    def feed_some(part):
        feeder = fastagg.HostFeeder(acc)
        for i in part:
            feeder.add(xs[i], float(i + 1), client_id=i)
        return feeder.flush()

    with ThreadPoolExecutor(4) as pool:
        reports = list(pool.map(feed_some, [range(t, 24, 4) for t in range(4)]))
    assert sorted(i for r in reports for i in r.folded) == list(range(24))
    assert not any(r.refused for r in reports)
    assert sorted(acc.client_ids) == list(range(24)) and acc.total_weight == sum(range(1, 25))
    want = sum((i + 1) * x.double() for i, x in enumerate(xs))
    rtol, atol = tolerance(dtype, "mean")
    assert_close(acc.weighted_sum.cpu(), want, rtol=rtol, atol=atol * 100, name="weighted sum")  # any fold order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_queued_adds_fold_in_one_sweep_on_device(dtype):
    """Adds from several threads that queue while the accumulator is busy are folded by the Triton kernel in one
    sweep (k rows onto the running sum) and equal the float64 sums; a NaN client among them is refused alone."""
    d = 2_000_003 if ON_GPU else 9_001
    xs = [(0.1 * _randn(d, seed=80 + i)).to(dtype).to(DEVICE) for i in range(5)]
    xs[2][77] = float("nan")
    acc = fastagg.Accumulator(like=torch.zeros(d, dtype=dtype, device=DEVICE), backend="triton")
    counter = SweepCounter(acc)
    ws = [1.0, 2.0, 3.0, 4.0, 5.0]
    out = add_all_queued(acc, [dict(delta=x, weight=w, client_id=i, on_nonfinite="skip")
                               for i, (x, w) in enumerate(zip(xs, ws))])
    assert out == [True, True, False, True, True]
    assert counter.sweeps == 2  # the five together, then the four without the NaN one
    ref = sum(w * x.double() for i, (x, w) in enumerate(zip(xs, ws)) if i != 2)
    rtol, atol = tolerance(dtype, "mean")
    assert_close(acc.weighted_sum, ref, rtol=rtol, atol=atol * 15, name="weighted sum")
    assert sorted(acc.client_ids) == [0, 1, 3, 4] and acc.total_weight == 12.0


@gpu_only
@pytest.mark.parametrize("algorithm", ["fedavg", "fedsps"])
def test_simulator_steps_replayed_from_a_cuda_graph_equal_eager_steps(algorithm, monkeypatch):
    """fastagg.sim on the GPU: the same run with every local step replayed from a CUDA graph (the default for
    stateless client rules) and with eager steps gives the same losses round by round, and the graph was used."""
    from fastagg.sim import data as datasets, runner

    made = []
    real = runner.step_graphs_for
    monkeypatch.setattr(runner, "step_graphs_for", lambda *a: made.append(real(*a)) or made[-1])
    data = datasets.cifar_synthetic(num_clients=40, per_client=20, test_size=100)
    losses = {}
    for graph in (False, True):
        cfg = runner.Config(dataset="cifar-synthetic", model="cnn", algorithms=(algorithm,), rounds=4,
                            participation=0.25, device="cuda", cuda_graph=graph).resolved(data)
        rows = []
        assert runner.run_one(cfg, data, algorithm, 0, on_row=rows.append) is None
        losses[graph] = [r["train_loss"] for r in rows]
    assert made[0] is None and made[1] is not None
    shapes = list(made[1]._shapes.values())
    assert len(shapes) == 1 and shapes[0]._graph is not None and not shapes[0]._failed
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


@gpu_only
def test_an_async_server_called_from_the_main_thread_steps_on_the_callers_stream():
    """AsyncServer's main-thread calls run on fastagg's helper thread: they must use the caller's CUDA device and
    stream (thread-local in torch), so the step lands on the stream the caller synchronizes with."""
    from fastagg import server
    from fastagg._uninterruptible import run_to_completion
    from fastagg.asynchronous import AsyncServer, Constant

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert run_to_completion(torch.cuda.current_stream) == s
        w = torch.zeros(1 << 20, device="cuda")
        srv = AsyncServer(server.FedAvg(w), buffer_size=2, staleness=Constant())
        for _ in range(2):
            srv.submit(torch.ones_like(w), 0)
    s.synchronize()
    assert srv.version == 1 and torch.equal(w, torch.ones_like(w))


@pytest.mark.parametrize("stochastic", [False, True])
def test_compressed_clients_and_the_int8_quantizer_on_device(stochastic):
    """Issue 25's kernels where they run: rows quantized to int8 and fp8 on the device (Triton) equal the CPU
    definition's codes bit for bit (Philox words included); int8 / fp8 / code-book / top-k clients folded on the device give the
    float64 oracle's mean and norms (the oracle dequantizes first, on the CPU)."""
    from fastagg.compress import Codebook8, dequantize, quantize_fp8, quantize_int8_rows, sparsify_topk

    m, d = (16, 3_000_001) if ON_GPU else (3, 5003)
    x = _randn(m, d, seed=25) * 0.01
    kw = dict(stochastic=stochastic, seed=2 ** 63 + 1, round=4, clients=list(range(100, 100 + m)))
    on_dev = quantize_int8_rows(x.to(DEVICE), 256, **kw)
    want = quantize_int8_rows(x, 256, backend="reference", **kw)
    for a, b in zip(on_dev, want):
        assert torch.equal(a.codes.cpu(), b.codes) and torch.equal(a.scales.cpu(), b.scales)
    from fastagg.compress import fp8

    for a, b in zip(fp8.quantize_fp8_rows(x.to(DEVICE), 128), fp8.quantize_fp8_rows(x, 128, backend="reference")):
        assert torch.equal(a.codes.view(torch.uint8).cpu(), b.codes.view(torch.uint8))
        assert torch.equal(a.scales.cpu(), b.scales)
    book = torch.linspace(-1, 1, 256, device=DEVICE)
    for name, clients in [("int8", on_dev),
                          ("fp8", [quantize_fp8(r, 128) for r in x.to(DEVICE)]),
                          ("code book", [Codebook8(u.codes.view(torch.uint8), u.scales, 256, book) for u in on_dev]),
                          ("top-k", [sparsify_topk(r, 0.01) for r in x.to(DEVICE)])]:
        res = fastagg.fedexp_step(clients, eps=1e-3, backend="triton")
        dense = torch.stack([dequantize(u).cpu() for u in clients])
        ref = fastagg.fedexp_step(dense, eps=1e-3, backend="reference")
        assert_close(res.mean.cpu(), ref.mean, rtol=1e-5, atol=1e-6 * float(ref.mean.abs().max()), name=name)
        assert_close(res.sq_norms.cpu(), ref.sq_norms, rtol=1e-9, atol=0, name=f"{name} norms")


@pytest.mark.parametrize("opt_name", ["FedAvg", "FedExP"])
def test_state_dict_clients_of_conv_shaped_entries(opt_name):
    """A ResNet-like state_dict round on the device (issue 42: the rows are the clients' N-D entries, never flattened
    into views; the row table reads their addresses): conv weights, BatchNorm statistics and counters, clients as
    full models from a base, against the float64 reference backend's step."""
    g = torch.Generator().manual_seed(3)
    shapes = {"conv1.weight": (8, 3, 3, 3), "bn1.weight": (8,), "bn1.bias": (8,), "layer.conv.weight": (16, 8, 3, 3),
              "fc.weight": (10, 16), "fc.bias": (10,)}
    glob = {k: torch.randn(s, generator=g, dtype=torch.float64).float() for k, s in shapes.items()}
    glob.update({"bn1.running_mean": torch.zeros(8), "bn1.running_var": torch.ones(8),
                 "bn1.num_batches_tracked": torch.tensor(4)})
    clients = [{k: (v + 1 if not v.is_floating_point() else v + 0.05 * (i + 1) * torch.randn(v.shape, generator=g))
                for k, v in glob.items()} for i in range(5)]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    out = {}
    for backend, dev in (("triton", DEVICE), ("reference", "cpu")):
        model = {k: v.clone().to(dev) for k, v in glob.items()}
        kw = {"eps": 1e-3} if opt_name == "FedExP" else {}
        opt = getattr(server, opt_name)(model, backend=backend, **kw)
        opt.step([{k: v.to(dev) for k, v in c.items()} for c in clients], weights,
                 base={k: v.clone().to(dev) for k, v in glob.items()})
        out[backend] = {k: v.cpu() for k, v in model.items()}
    for k in glob:
        if glob[k].is_floating_point():
            assert_close(out["triton"][k], out["reference"][k], rtol=1e-5, atol=1e-6, name=k)
        else:
            assert torch.equal(out["triton"][k], out["reference"][k]), k
