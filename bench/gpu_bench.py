"""GPU throughput of every fastagg Triton path against the card's copy bandwidth and against torch, in one run.

    python bench/gpu_bench.py --out DIR [--sections copy,round,...] [--quick | --dry-run]

Every time is the median of ``triton.testing.do_bench`` (CUDA events; the L2 is flushed before every rep), with
buffers far above the L2. Bandwidth counts bytes read plus bytes written, for the copy too, so "x copy" is the
fraction of the card's copy bandwidth a kernel reaches. Writes DIR/gpu_bench.md (tables) and DIR/gpu_bench.json
(every row); paste the tables, with the card's name, into bench/RESULTS.md. No number here is a test.

Sections:
  copy     device-to-device copy (the bandwidth reference) and a plain read (``x.sum()``)
  round    FedExP rounds (M=16, d=1e8 and M=100, d=1e7; fp32 and bf16): fastagg's default and tuned calls
           against the best eager torch (several variants; the fastest is the reference)
  compile  the same torch round under torch.compile(mode="max-autotune-no-cudagraphs") (fp32)
  sweep    stats-pass launch configurations and the alignment hints off, on both round shapes (SWEEP_DTYPES)
  apply    apply-pass launch configurations, in the tuned FedExP round at M=16, d=1e8 (fp32 and bf16)
  server   all server optimizers (M=16, d=5e7) against the time of their own traffic at copy bandwidth, and
           FedAdam against mean-by-torch + torch.optim.Adam(fused=True); one FedAdam step replayed in a CUDA graph
  client   batched FedSPS (M=1000, d=1e5 and M=100, d=1e6): each schedule and block size, X.add_(G), torch
  feed     HostFeeder (host updates folded on the card) against the bare pinned host-to-device copy
  queue    queued adds folded in one Triton sweep (add_many), k + 2 d-vectors against the copy
  sim      pfl-research's CIFAR-10 workload (1000 clients, 50 a round, the pfl CNN, 5 local steps of batch 10):
           a simulator round against a per-client loop of plain torch
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import time
import warnings

import torch

ROWS: list[dict] = []
COPY_BW: dict = {}
DEV = "cuda"  # --dry-run: "cpu" (tiny sizes, Triton through the interpreter): checks this script, measures nothing
SCALE = 1.0   # --quick / --dry-run shrink every size


def size(n: int) -> int:
    return max(1, int(n * SCALE))


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def bench(fn, *, rep_ms: int = 200) -> float:
    if DEV != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def wall(fn, *, reps: int = 3, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` (synchronized after each call): for work whose host side is part of
    what is measured (feeding from host memory, a whole simulator round), where ``bench`` times the device alone."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def record(section: str, name: str, ms: float, nbytes: float | None = None, **extra) -> dict:
    row = dict(section=section, name=name, ms=round(ms, 4), **extra)
    if nbytes:
        bw = nbytes / ms / 1e6
        row.update(GB=round(nbytes / 1e9, 3), GBps=round(bw), x_copy=round(bw / COPY_BW["GBps"], 3))
    ROWS.append(row)
    shown = "  ".join(f"{k}={v}" for k, v in row.items() if k not in ("section",))
    print(f"[{section}] {shown}", flush=True)
    return row


def free():
    import gc

    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------


def section_copy() -> None:
    _copy()
    free()


def _copy() -> None:
    n = size(1_600_000_000)  # 6.4 GB of float32, the size of the largest round's updates
    x = torch.randn(n, device=DEV)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    COPY_BW["GBps"] = 2 * x.numel() * 4 / ms / 1e6
    record("copy", f"d2d copy {n * 4 / 1e9:.1f} GB", ms, 2 * n * 4)
    record("copy", "plain read x.sum()", bench(lambda: x.sum()), n * 4)


def torch_rounds():
    """Eager torch FedExP rounds: (name, fn(x, p, w, eval_out, eps) -> None). The first two are the same math
    with the weighted sum as a matrix-vector or a matrix-matrix product."""

    def finish(x, p, w, eval_out, eps, mean):
        sq = torch.linalg.vector_norm(x, dim=1, dtype=torch.float32).double().square()
        avg = (p.double() * sq).sum()
        msq = torch.linalg.vector_norm(mean, dtype=torch.float32).double().square()
        eta = torch.clamp(0.5 * avg / (msq + eps), min=1.0).to(torch.float32)
        w.add_(mean * eta.to(mean.dtype))
        torch.sub(w, mean * (0.5 * eta).to(mean.dtype), out=eval_out)

    def mv(x, p, w, eval_out, eps):
        finish(x, p, w, eval_out, eps, torch.mv(x.t(), p.to(x.dtype)))

    def mm(x, p, w, eval_out, eps):
        finish(x, p, w, eval_out, eps, torch.mm(p.to(x.dtype)[None], x)[0])

    def fused_addcmul(x, p, w, eval_out, eps):
        mean = torch.mv(x.t(), p.to(x.dtype))
        sq = torch.linalg.vector_norm(x, dim=1, dtype=torch.float32).double().square()
        avg = (p.double() * sq).sum()
        msq = torch.dot(mean, mean).double()
        eta = torch.clamp(0.5 * avg / (msq + eps), min=1.0).to(w.dtype)
        w.addcmul_(mean, eta)
        torch.addcmul(w, mean, -0.5 * eta, out=eval_out)

    return [("torch mv + vector_norm", mv), ("torch mm + vector_norm", mm), ("torch mv + addcmul", fused_addcmul)]


ROUND_SHAPES = [(16, 100_000_000), (100, 10_000_000)]


def _round_bytes(m, d, es, with_params: bool) -> int:
    """Bytes a FedExP round must move: read the updates, write the float32 mean; with params also read the mean,
    read and write params, write the eval model."""
    b = m * d * es + 4 * d
    if with_params:
        b += 4 * d + 3 * d * es
    return b


def section_round() -> None:
    for m, d in ROUND_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            _round(m, size(d), dtype)
            free()


def _round(m: int, d: int, dtype: torch.dtype) -> None:
    import fastagg

    es = torch.finfo(dtype).bits // 8
    tag = f"M={m} d={d:.0e} {str(dtype)[6:]}"
    x = torch.randn(m, d, device=DEV).to(dtype)
    p = torch.full((m,), 1.0 / m, device=DEV)
    w = torch.zeros(d, device=DEV, dtype=dtype)
    mean = torch.empty(d, device=DEV)
    eval_out = torch.empty(d, device=DEV, dtype=dtype)
    full, stats_only = _round_bytes(m, d, es, True), _round_bytes(m, d, es, False)
    cases = [
        ("fastagg default: fedexp_step(x, eps, params=w)",
         lambda: fastagg.fedexp_step(x, eps=1e-3, params=w), full),
        ("fastagg skip: on_nonfinite='skip' (no host sync)",
         lambda: fastagg.fedexp_step(x, eps=1e-3, params=w, on_nonfinite="skip"), full),
        ("fastagg tuned: skip + mean_out= + eval_out=",
         lambda: fastagg.fedexp_step(x, eps=1e-3, params=w, on_nonfinite="skip", mean_out=mean,
                                     eval_out=eval_out), full),
        ("fastagg stats only: fedexp_step(x, eps)", lambda: fastagg.fedexp_step(x, eps=1e-3), stats_only),
        ("fastagg stats only, tuned: skip + mean_out=",
         lambda: fastagg.fedexp_step(x, eps=1e-3, on_nonfinite="skip", mean_out=mean), stats_only),
    ]
    launch = importlib.import_module("fastagg.backends.triton.launch")

    def masked_stores(fn):  # the apply pass with per-element masked stores (before select stores), same run
        def run():
            launch.SELECT_STORES = False
            try:
                fn()
            finally:
                launch.SELECT_STORES = True
        return run

    cases += [("fastagg skip, per-element masked stores (the old apply stores)", masked_stores(cases[1][1]), full),
              ("fastagg tuned, per-element masked stores (the old apply stores)", masked_stores(cases[2][1]), full)]
    cases += [(name, (lambda f=f: f(x, p, w, eval_out, 1e-3)), full) for name, f in torch_rounds()]
    for name, fn, nbytes in cases:
        record("round", f"{tag}: {name}", bench(fn), nbytes, M=m, d=d, dtype=str(dtype)[6:])
    if dtype == torch.bfloat16:
        _round_pipelines(tag, x, mean, stats_only, m, d)


# the stats pass's ways of keeping loads in flight (launch.STATS_PIPELINE: PREFETCH, RAW, STAGES), the default first;
# a tile (BLOCK_M, BLOCK_D, warps) replaces the chosen one. ptxas (sm_90, triton 3.6) on the chosen 1 x 8192 at 4
# warps: the default 255 registers + 108 bytes spilled a thread, RAW 12 spilled, STAGES=3 204 registers, none
# spilled; at 8 warps PREFETCH=2 RAW 205 registers, none spilled
STATS_PIPELINES = [(1, False, None, None), (1, True, None, None), (2, True, None, None), (0, False, 3, None),
                   (0, False, 4, None), (0, False, 3, (1, 8192, 8)), (2, True, None, (1, 8192, 8)),
                   (0, False, 4, (1, 4096, 4))]


def _round_pipelines(tag, x, mean, stats_only, m, d) -> None:
    """The tuned bf16 stats pass under each STATS_PIPELINES variant, in the same run as the copy; each variant's
    mean and squared norms checked bit for bit against the default's where the tile is the same (the same chunks in
    the same order: any difference is a wrong kernel), to rounding where it is not."""
    import fastagg

    stats_mod = importlib.import_module("fastagg.backends.triton.round_stats")
    chosen = stats_mod.stats_config
    want = {}
    for prefetch, raw, stages, tile in STATS_PIPELINES:
        c = chosen(m, d, 2)
        if tile:
            c = dict(BLOCK_M=tile[0], BLOCK_D=tile[1], num_warps=tile[2])
        stats_mod.stats_config = lambda M, n, es=4, c=c, p=prefetch, r=raw, s=stages: dict(c, PREFETCH=p, RAW=r,
                                                                                           STAGES=s)
        name = f"{tag}: stats pass {c['BLOCK_M']}x{c['BLOCK_D']} at {c['num_warps']} warps, PREFETCH={prefetch} " \
            f"RAW={raw} STAGES={stages}, stats only tuned"
        try:
            res = fastagg.fedexp_step(x, eps=1e-3, on_nonfinite="skip", mean_out=mean)
            mean_now, sq = mean.clone(), res.sq_norms.clone()
            same_tile = want.setdefault("tile", c) == c  # a block's float64 sum is ordered by the tile and warps
            mean_want, sq_want = want.setdefault("mean", mean_now), want.setdefault("sq", sq)
            if c["BLOCK_M"] == want["tile"]["BLOCK_M"]:  # the mean: clients added in the same order
                check = "the mean's bits of the default" if torch.equal(mean_now, mean_want) else "MEAN DIFFERS"
            else:
                check = "the mean to 1e-5" if torch.allclose(mean_now, mean_want, rtol=1e-5, atol=1e-7) else \
                    "MEAN DIFFERS"
            if same_tile:
                check += ", its sq_norms' bits" if torch.equal(sq, sq_want) else ", SQ_NORMS DIFFER"
            else:
                check += ", its sq_norms to 1e-12" if torch.allclose(sq, sq_want, rtol=1e-12, atol=0) else \
                    ", SQ_NORMS DIFFER"
            record("round", name, bench(lambda: fastagg.fedexp_step(x, eps=1e-3, on_nonfinite="skip", mean_out=mean)),
                   stats_only, M=m, d=d, dtype="bfloat16", check=check)
        except Exception as e:  # a variant that does not compile or fit is a finding, not a crash
            record("round", f"{name} FAILED {e!r:.200}", 0.0)
        finally:
            stats_mod.stats_config = chosen


def section_apply() -> None:
    """Apply-pass launch configurations (BLOCK_D columns, warps): the tuned FedExP round (stats pass + apply pass
    with params and the eval model) timed per configuration, its params checked bit for bit against the chosen
    configuration's (the pass is elementwise, so any configuration must give the same bits)."""
    launch = importlib.import_module("fastagg.backends.triton.launch")
    import fastagg

    chosen = launch.apply_config
    m, d = ROUND_SHAPES[0][0], size(ROUND_SHAPES[0][1])
    for dtype in (torch.float32, torch.bfloat16):
        es = torch.finfo(dtype).bits // 8
        x = torch.randn(m, d, device=DEV).to(dtype)
        w0 = torch.randn(d, device=DEV).to(dtype)
        w = w0.clone()
        mean = torch.empty(d, device=DEV)
        eval_out = torch.empty(d, device=DEV, dtype=dtype)

        def step():
            return fastagg.fedexp_step(x, eps=1e-3, params=w, on_nonfinite="skip", mean_out=mean, eval_out=eval_out)

        step()
        expected = w.clone()
        for bd, nw in [(4096, 8), (1024, 4), (2048, 4), (4096, 4), (8192, 8), (2048, 8), (8192, 4), (16384, 8)]:
            launch.apply_config = lambda n, bd=bd, nw=nw: dict(BLOCK_D=bd, num_warps=nw)
            try:
                w.copy_(w0)
                step()
                same = "same bits" if torch.equal(w, expected) else "DIFFERENT"
                ms = bench(step)
            finally:
                launch.apply_config = chosen
            record("apply", f"M={m} d={d:.0e} {str(dtype)[6:]} round, apply BLOCK_D={bd} warps={nw}", ms,
                   _round_bytes(m, d, es, True), check=same)
        free()


def section_compile() -> None:
    """The eager torch rounds under torch.compile (max-autotune-no-cudagraphs), fp32."""
    for m, d in ROUND_SHAPES:
        _compiled_round(m, size(d))
        free()


def _compiled_round(m: int, d: int) -> None:
    eager = dict(torch_rounds())
    x = torch.randn(m, d, device=DEV)
    p = torch.full((m,), 1.0 / m, device=DEV)
    w = torch.zeros(d, device=DEV)
    eval_out = torch.empty(d, device=DEV)
    for name in ("torch mv + vector_norm", "torch mv + addcmul"):
        torch._dynamo.reset()
        compiled = torch.compile(eager[name], mode="max-autotune-no-cudagraphs", dynamic=False)
        t0 = time.perf_counter()
        compiled(x, p, w, eval_out, 1e-3)
        sync()
        took = time.perf_counter() - t0
        record("compile", f"M={m} d={d:.0e} float32: torch.compile({name})",
               bench(lambda: compiled(x, p, w, eval_out, 1e-3)), _round_bytes(m, d, 4, True), M=m, d=d,
               compile_s=round(took, 1))


def section_sweep() -> None:
    """Stats-pass launch configurations (BLOCK_M clients x BLOCK_D columns, warps) and the hints off."""
    names = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for tag in os.environ.get("SWEEP_DTYPES", "fp32,bf16").split(","):
        for m, d in ROUND_SHAPES:
            _sweep(m, size(d), names[tag])
            free()


# (BLOCK_M, BLOCK_D, warps); fp32's full sweep is in bench/RESULTS.md (2 x 2048 at 4 warps chosen)
SWEEP_CONFIGS = {torch.float32: [(2, 2048, 4), (2, 4096, 4)],
                 torch.bfloat16: [(2, 2048, 4), (1, 8192, 4), (1, 4096, 4), (1, 4096, 2), (1, 8192, 2),
                                  (1, 16384, 4), (1, 16384, 8), (2, 8192, 4), (2, 4096, 4),
                                  (1, 8192, 8), (2, 8192, 8), (4, 4096, 8), (4, 8192, 8)]}


def _sweep(m: int, d: int, dtype: torch.dtype) -> None:
    """Each configuration is timed and its mean and squared norms checked against float64 torch."""
    import fastagg
    from fastagg.testing import assert_close, tolerance

    stats_mod = importlib.import_module("fastagg.backends.triton.round_stats")
    launch = importlib.import_module("fastagg.backends.triton.launch")
    chosen, chosen_finalize, real_finalize = stats_mod.stats_config, stats_mod.finalize_config, \
        stats_mod._finalize_kernel
    x = torch.randn(m, d, device=DEV).to(dtype)
    mean = torch.empty(d, device=DEV)
    tag = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    ref_mean = torch.zeros(d, dtype=torch.float64, device=DEV)
    for i in range(m):
        ref_mean += x[i].double()
    ref_mean /= m
    ref_sq = torch.stack([x[i].double().square().sum() for i in range(m)])

    class Skipped:  # stage 1 alone: the finalize launch becomes a no-op
        def __getitem__(self, grid):
            return lambda *a, **k: None

    extra = ["hints off", "stage 1 alone"] if dtype == torch.float32 else []
    for cfg in SWEEP_CONFIGS[dtype] + extra:
        check = True
        if cfg == "hints off":
            launch.HINTS = False
            name = f"chosen {chosen(m, d, x.element_size())} with the alignment hints off"
        elif cfg == "stage 1 alone":
            stats_mod._finalize_kernel = Skipped()
            name = f"chosen {chosen(m, d, x.element_size())}, stage 1 alone (finalize skipped)"
            check = False
        else:
            bm, bd, nw = cfg
            stats_mod.stats_config = lambda M, n, es=4, bm=bm, bd=bd, nw=nw: dict(BLOCK_M=min(bm, M), BLOCK_D=bd,
                                                                                    num_warps=nw)
            name = f"BLOCK_M={bm} BLOCK_D={bd} warps={nw}"
        try:
            ms = bench(lambda: fastagg.fedexp_step(x, eps=1e-3, on_nonfinite="skip", mean_out=mean))
            verdict = ""
            if check:
                res = fastagg.fedexp_step(x, eps=1e-3, on_nonfinite="skip", mean_out=mean)
                try:
                    assert_close(mean.double().cpu(), ref_mean.cpu(), rtol=tolerance(dtype, "mean")[0],
                                 atol=tolerance(dtype, "mean")[1], name="mean")
                    assert_close(res.sq_norms.cpu(), ref_sq.cpu(), rtol=tolerance(dtype, "norm")[0], atol=0,
                                 name="sq_norms")
                    verdict = "matches fp64"
                except AssertionError as e:
                    verdict = f"WRONG: {e}"[:300]
            record("sweep", f"{tag} M={m} d={d:.0e} stats pass: {name}", ms,
                   _round_bytes(m, d, x.element_size(), False), M=m, d=d, check=verdict or "not checked")
        finally:
            stats_mod.stats_config, stats_mod.finalize_config = chosen, chosen_finalize
            stats_mod._finalize_kernel = real_finalize
            launch.HINTS = True


# traffic of each server step beyond the stats pass (read M*d, write the mean): in units of d-vectors of 4 bytes
# read or written by the apply pass (mean read, params read+write, each state buffer read+write, extra output
# written), plus extra stats reads (FedExP-M's aux) and second stats passes (SCAFFOLD's control deltas)
SERVER = {
    "FedAvg": (dict(), 3), "FedAvgM": (dict(momentum=0.9), 5), "FedExP": (dict(eps=1e-3), 4),
    "FedExPM": (dict(eps=1e-3), 1 + 6), "FedACG": (dict(), 6), "FedAdam": (dict(), 7), "FedYogi": (dict(), 7),
    "FedAdagrad": (dict(), 5), "FedAMS": (dict(), 9), "Scaffold": (dict(num_clients=100), 3 + 3),
    "ScaffoldExP": (dict(num_clients=100, eps=1e-3), 4 + 3),
}


def section_server() -> None:
    m, d = 16, size(50_000_000)
    x = torch.randn(m, d, device=DEV) * 0.01
    c = torch.randn(m, d, device=DEV) * 0.01
    for name in SERVER:
        _server_step(name, x, c)
        free()
    _torch_adam(x)
    free()
    if DEV == "cuda":
        for dd in (100_000, d):
            _graphed_adam(m, dd)
            free()


def _server_step(name: str, x: torch.Tensor, c: torch.Tensor) -> None:
    from fastagg import server

    (m, d), (hyper, vectors) = x.shape, SERVER[name]
    opt = getattr(server, name)(torch.randn(d, device=DEV), on_nonfinite="skip", **hyper)
    scaffold = name.startswith("Scaffold")
    nbytes = (2 if scaffold else 1) * (m * d * 4 + 4 * d) + vectors * 4 * d
    ms = bench((lambda: opt.step(x, c)) if scaffold else (lambda: opt.step(x)))
    row = record("server", f"M={m} d={d:.0e} fp32: {name}", ms, nbytes)
    row["x_traffic_at_copy_bw"] = round(ms / (nbytes / COPY_BW["GBps"] / 1e6), 3)
    print(f"    {name}: {row['x_traffic_at_copy_bw']} x the time of its traffic at copy bandwidth", flush=True)


def _torch_adam(x: torch.Tensor) -> None:
    """FedAdam's torch equivalent: the mean by torch, then fused Adam on the global model with grad = -mean."""
    m, d = x.shape
    w = torch.randn(d, device=DEV, requires_grad=True)
    p = torch.full((m,), 1.0 / m, device=DEV)
    adam = torch.optim.Adam([w], lr=0.1, betas=(0.9, 0.99), eps=1e-3, fused=True)
    w.grad = torch.empty_like(w)

    def step():
        torch.mv(x.t(), p, out=w.grad)
        w.grad.neg_()
        adam.step()

    record("server", f"M={m} d={d:.0e} fp32: torch mean (mv) + Adam(fused=True)", bench(step),
           m * d * 4 + 4 * d + 2 * 4 * d + 7 * 4 * d)


def _graphed_adam(m: int, d: int) -> None:
    """One FedAdam step eager and replayed from a CUDA graph (the same kernels, no launch overhead)."""
    from fastagg import server

    xs = torch.randn(m, d, device=DEV) * 0.01
    opt = server.FedAdam(torch.randn(d, device=DEV), on_nonfinite="skip")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step(xs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step(xs)
    nbytes = m * d * 4 + 4 * d + 7 * 4 * d
    record("server", f"M={m} d={d:.0e} fp32: FedAdam eager step", bench(lambda: opt.step(xs)), nbytes)
    record("server", f"M={m} d={d:.0e} fp32: FedAdam step replayed from a CUDA graph", bench(graph.replay), nbytes)


def section_client() -> None:
    for m, d in [(1000, 100_000), (100, 1_000_000)]:
        _client(max(2, size(m)), size(d))
        free()


# (schedule, BLOCK, CHUNK, warps, MB of gradient per group of the grouped schedule, select stores)
CLIENT_VARIANTS = [("chunks", 4096, 16384, 8, None, False), ("chunks", 4096, 16384, 8, None, True),
                   ("row", 4096, None, 8, None, True)]
CLIENT_VARIANTS += [("grouped", 4096, chunk, 8, mb, True) for chunk in (16384, 4096) for mb in (4, 8, 16, 32)]
CLIENT_VARIANTS += [("grouped", 2048, 8192, 4, 8, True)]
# (..., PREFETCH, STAGES): the sweeps' loads in flight (launch.LOCAL_PIPELINE); 32768-column chunks: two a slot
CLIENT_VARIANTS += [("grouped", 4096, 16384, 8, 8, True, 1, None), ("grouped", 4096, 16384, 8, 8, True, 0, 3),
                    ("grouped", 4096, 16384, 8, 8, True, 0, 2), ("grouped", 4096, 16384, 8, 4, True, 1, None),
                    ("grouped", 4096, 32768, 8, 8, True), ("grouped", 4096, 32768, 8, 8, True, 1, None)]


def _client(m: int, d: int) -> None:
    """Batched FedSPS (c = 0.5, l_star = 0, cap 1e-3): each schedule is timed, and one step of it from the same
    start is checked against the same step in float64 torch."""
    from fastagg import client
    from fastagg.testing import assert_close

    local_mod = importlib.import_module("fastagg.backends.triton.local_step")
    chosen = local_mod.local_config
    x0 = torch.randn(m, d, device=DEV)
    x = x0.clone()
    g = 1e-3 * torch.randn(m, d, device=DEV)
    f = 1.0 + torch.rand(m, device=DEV, dtype=torch.float64)
    sq = g.double().square().sum(1)
    ref = (x0.double() - torch.clamp(f / (0.5 * sq), max=1e-3)[:, None] * g.double()).cpu()
    nbytes = 3 * m * d * 4  # read x, read g, write x: what any step must move
    tag = f"M={m} d={d:.0e} fp32"
    record("client", f"{tag}: X.add_(G)", bench(lambda: x.add_(g, alpha=1e-9)), nbytes)

    def sps():
        client.sps_step(params=x, grads=g, losses=f, gamma_b=1e-3)

    def checked(name):
        x.copy_(x0)
        sps()
        try:
            assert_close(x.cpu(), ref, rtol=1e-5, atol=1e-6, name=name)
            return "matches fp64"
        except AssertionError as e:
            return f"WRONG: {e}"[:300]

    launch = importlib.import_module("fastagg.backends.triton.launch")
    record("client", f"{tag}: fastagg sps_step (chosen: {chosen(m, d)})", bench(sps), nbytes,
           check=checked("chosen"))
    for schedule, block, chunk, warps, mb, select, *pipe in CLIENT_VARIANTS:
        rows = max(1, (mb << 20) // (d * 4)) if mb else None
        pipe = dict(zip(("PREFETCH", "STAGES"), pipe))
        local_mod.local_config = lambda M, n, s=schedule, b=block, c=chunk, w=warps, r=rows, pp=pipe: dict(
            schedule=s, BLOCK=b, CHUNK=c, GROUP_ROWS=r, num_warps=w, **pp)
        launch.SELECT_STORES = select
        name = f"{tag}: fastagg sps {schedule} BLOCK={block} CHUNK={chunk} warps={warps}" + \
            (f" group={rows} rows ({mb} MB of g)" if mb else "") + ("" if select else " masked stores") + \
            "".join(f" {k}={v}" for k, v in pipe.items())
        try:
            record("client", name, bench(sps), nbytes, check=checked(name))
        except Exception as e:  # a configuration that does not compile or fit is a finding, not a crash
            record("client", f"{name} FAILED {e!r:.200}", 0.0)
        finally:
            local_mod.local_config = chosen
            launch.SELECT_STORES = True

    def torch_batched():
        sq = torch.linalg.vector_norm(g, dim=1).double().square()
        gamma = torch.clamp(f / (0.5 * sq), max=1e-3)
        x.addcmul_(gamma.to(x.dtype)[:, None], g, value=-1.0)

    record("client", f"{tag}: torch batched (vector_norm + addcmul_)", bench(torch_batched), nbytes)


def section_sim() -> None:
    """One round of pfl-research's CIFAR-10 benchmark workload: the simulator's batched round (fastagg.sim's
    data, model, client steps and server step), eager and with each local step (forward, backward, fused client
    step) replayed from a CUDA graph, against a per-client loop of plain torch on the same card, with cuDNN's
    autotuner on and TF32 matmuls off (torch's default) and on (the same settings for all contenders; cuDNN's
    convolutions use TF32 by default either way). SIM_SETTINGS="bench:tf32,..." picks them. First, the vmapped
    layer that dominates the round (the second convolution as a 50-group convolution) against its alternatives."""
    torch.backends.cudnn.benchmark = True
    try:
        _conv_variants()
    finally:
        torch.backends.cudnn.benchmark = False
    free()
    settings = os.environ.get("SIM_SETTINGS", "1:0,1:1").split(",")
    for setting in settings:
        tuned, tf32 = (bool(int(v)) for v in setting.split(":"))
        torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32 = tuned, tf32
        try:
            _sim_round()
        finally:
            torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32 = False, False
        free()


def _conv_variants() -> None:
    """pfl-cnn's second convolution (32 -> 64 channels, 3x3, on 30x30) for 50 clients x 10 images, forward and
    backward (input and weight gradients): as vmap runs it (one grouped convolution, NCHW), channels-last, and as
    im2col by views (Tensor.unfold) + one batched matrix product, fp32 and with TF32 matmuls."""
    m, b, c, o, hw = 50, 10, 32, 64, 30
    if DEV != "cuda":
        m, b, hw = 2, 2, 6
    x = torch.randn(m, b, c, hw, hw, device=DEV)
    w = torch.randn(m, o, c, 3, 3, device=DEV) * 0.1
    go = torch.randn(m, b, o, hw - 2, hw - 2, device=DEV)
    flops = 3 * 2 * m * b * (hw - 2) ** 2 * o * c * 9

    def grouped(channels_last):
        xg = x.transpose(0, 1).reshape(b, m * c, hw, hw).detach().requires_grad_()
        wg = w.reshape(m * o, c, 3, 3).detach().requires_grad_()
        gg = go.transpose(0, 1).reshape(b, m * o, hw - 2, hw - 2)
        if channels_last:
            xg = xg.detach().to(memory_format=torch.channels_last).requires_grad_()
            wg = wg.detach().to(memory_format=torch.channels_last).requires_grad_()
            gg = gg.contiguous(memory_format=torch.channels_last)

        def run():
            out = torch.nn.functional.conv2d(xg, wg, groups=m)
            out.backward(gg)
            return out
        return run

    def unfolded():
        xu = x.detach().requires_grad_()
        wu = w.reshape(m, o, c * 9).detach().requires_grad_()
        gu = go.permute(0, 1, 3, 4, 2).reshape(m, b * (hw - 2) ** 2, o)

        def run():
            cols = xu.unfold(3, 3, 1).unfold(4, 3, 1).permute(0, 1, 3, 4, 2, 5, 6).reshape(m, -1, c * 9)
            out = torch.bmm(cols, wu.transpose(1, 2))
            out.backward(gu)
            return out.view(m, b, hw - 2, hw - 2, o).permute(0, 1, 4, 2, 3)
        return run

    def as_ref(out):  # [m, b, o, h, w]
        if out.shape[0] == b and out.dim() == 4:  # the grouped convolution's [b, m * o, h, w]
            return out.detach().view(b, m, o, hw - 2, hw - 2).transpose(0, 1)
        return out.detach()

    ref = as_ref(grouped(False)())
    for name, fn, tf32 in [("grouped conv (vmap's), NCHW", grouped(False), False),
                           ("grouped conv, channels-last", grouped(True), False),
                           ("unfold views + bmm, fp32", unfolded(), False),
                           ("unfold views + bmm, TF32 matmul", unfolded(), True)]:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            got = as_ref(fn())
            err = float((got.double() - ref.double()).norm() / ref.double().norm())
            ms = bench(fn)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
        record("sim", f"conv2 fwd+bwd, {m} clients x {b} images: {name}", ms, None,
               TFLOPs=round(flops / ms / 1e9, 1), rel_err_vs_grouped=f"{err:.1e}")


def _sim_round() -> None:
    from fastagg import server
    from fastagg.sim import algorithms, data as datasets, models, runner

    clients = max(60, size(1000))
    data = datasets.cifar_synthetic(num_clients=clients).to(DEV, torch.float32)
    cfg = runner.Config(dataset="cifar-synthetic", algorithms=("fedavg",), device=DEV, cuda_graph=False).resolved(data)
    m = 50
    alg = algorithms.resolve("fedavg", cfg)
    gen = torch.Generator().manual_seed(0)
    model = models.make("pfl-cnn", data)
    w = model.init(torch.float32, DEV)
    opt = server.FedAvg(w, on_nonfinite="skip")

    def draw():
        return torch.sort(torch.randperm(clients, generator=gen)[:m]).values.to(DEV)

    def batched_round():
        ids = draw()
        x = runner._local_steps(alg, cfg, model, data, ids, w, None, cfg.lr, gen)
        opt.step(x - w, weights=data.counts[ids].to(torch.float64))

    def timed(fn, reps):
        return wall(fn, reps=reps, warmup=2)

    batched = timed(batched_round, 5)
    if DEV == "cuda" and os.environ.get("SIM_PROFILE"):  # where a batched round spends its GPU time
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            batched_round()
            sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=70),
              flush=True)

    graphed, graph_note = None, ""
    graphs = runner.step_graphs_for(alg, dataclasses.replace(cfg, cuda_graph=True), model, torch.device(DEV))
    if graphs is not None:  # the simulator's own path: each local step replayed from a CUDA graph (sim/graphs.py)
        def graphed_round():
            ids = draw()
            x = runner._local_steps(alg, cfg, model, data, ids, w, None, cfg.lr, gen, graphs=graphs)
            opt.step(x - w, weights=data.counts[ids].to(torch.float64))

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graphed = timed(graphed_round, 5)
        graph_note = "; ".join(str(c.message)[:200] for c in caught)

    net = models.pfl_cnn_module().to(DEV)
    global_state = {k: v.clone() for k, v in net.state_dict().items()}

    def per_client_round():
        ids = torch.randperm(clients, generator=gen)[:m].tolist()
        states = []
        for i in ids:
            net.load_state_dict(global_state)
            sgd = torch.optim.SGD(net.parameters(), lr=cfg.lr)
            for _ in range(cfg.local_steps):
                idx = torch.randint(0, data.x.shape[1], (cfg.batch_size,), generator=gen).to(DEV)
                xb_ = data.x[i, idx].view(-1, 3, 32, 32)
                sgd.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(net(xb_), data.y[i, idx]).backward()
                sgd.step()
            states.append({k: v.detach().clone() for k, v in net.state_dict().items()})
        for k in global_state:
            global_state[k].copy_(torch.stack([s[k] for s in states]).mean(0))

    loop = timed(per_client_round, 3)
    bench_mode = ("on" if torch.backends.cudnn.benchmark else "off") + \
        (", TF32 matmuls" if torch.backends.cuda.matmul.allow_tf32 else "")
    record("sim", f"pfl CIFAR-10 round ({clients} clients, 50 a round, 5 steps of batch 10, cudnn.benchmark "
           f"{bench_mode}): fastagg.sim batched", batched * 1e3, speedup_over_loop=round(loop / batched, 1))
    if graphed is not None:
        record("sim", f"same round, fastagg.sim replaying each local step from a CUDA graph ({bench_mode})"
               + (f" [{graph_note}]" if graph_note else ""), graphed * 1e3, speedup_over_loop=round(loop / graphed, 1))
    record("sim", f"same round: per-client loop of plain torch (nn.Module + SGD, stacked mean, cudnn.benchmark "
           f"{bench_mode})", loop * 1e3)


def section_feed() -> None:
    """Client updates in host memory folded into a GPU Accumulator (fastagg.HostFeeder), per client, wall clock
    (host work is part of it): d = 1e8 fp32 and bf16, 16 clients, against the bare pinned host-to-device copy of the
    same bytes (the PCIe bound). Contenders: the copy then the fold one after the other; HostFeeder from pageable
    host tensors (what a receive hands a server) with 1 and 4 feeding threads (a feeder each); HostFeeder from its
    own pinned buffers (a receive writing into feeder.buffer()). Also: the host's
    copy of one update into pinned memory alone, and the pinned bytes the feeders hold."""
    for dtype in (torch.float32, torch.bfloat16):
        _feed(size(100_000_000), 16, dtype)
        free()


def _feed(d: int, m: int, dtype: torch.dtype) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import fastagg

    es = torch.finfo(dtype).bits // 8
    tag = f"d={d:.0e} {str(dtype)[6:]}, {m} clients"
    block = (torch.randn(1 << 16) * 0.01).to(dtype)
    host = [block.repeat(d // block.numel() + 1)[:d].clone() * (1 + k) for k in range(4)]  # pageable, 4 distinct
    pinned = host[0].pin_memory() if DEV == "cuda" else host[0]
    dev = torch.empty(d, dtype=dtype, device=DEV)
    like = torch.zeros(d, dtype=dtype, device=DEV)
    acc = fastagg.Accumulator(like=like)

    def per_client(fn):  # ms per client of m
        return wall(fn) / m * 1e3

    def h2d():
        for _ in range(m):
            dev.copy_(pinned, non_blocking=True)

    def host_copy():
        for i in range(m):
            pinned.copy_(host[i % 4])

    def serial():
        acc.reset()
        for i in range(m):
            dev.copy_(pinned, non_blocking=True)
            acc.add(dev, 1.0 + i)

    feeders: list = []

    def fed(threads: int, from_pinned: bool = False):
        local = __import__("threading").local()

        def feeder():
            if not hasattr(local, "f"):
                local.f = fastagg.HostFeeder(acc)
                feeders.append(local.f)
            return local.f

        def part(ids):
            f = feeder()
            for i in ids:
                f.add(f.buffer(dtype) if from_pinned and DEV == "cuda" else host[i % 4], 1.0 + i)
            return len(f.flush().folded)

        pool = ThreadPoolExecutor(threads) if threads > 1 else None

        def run():
            acc.reset()
            if pool is None:
                assert part(range(m)) == m
            else:
                assert sum(pool.map(part, [range(t, m, threads) for t in range(threads)])) == m
        return run, pool

    nbytes = d * es
    base = per_client(h2d)
    record("feed", f"{tag}: pinned H2D copy alone, {nbytes / 1e9:.2f} GB per client", base, nbytes)
    hc = per_client(host_copy)
    record("feed", f"{tag}: host copy of a pageable update into pinned memory alone ({torch.get_num_threads()} "
           "threads)", hc, None, host_GBps=round(nbytes / hc / 1e6, 1), x_h2d_alone=round(hc / base, 3))
    record("feed", f"{tag}: H2D copy then Accumulator.add, serial", per_client(serial), nbytes)
    for threads, from_pinned in [(1, False), (4, False), (1, True)]:
        run, pool = fed(threads, from_pinned)
        try:
            ms = per_client(run)
        finally:
            if pool is not None:
                pool.shutdown()
        what = "its pinned buffers (receive into feeder.buffer())" if from_pinned else "pageable host tensors"
        held = [[p for p in getattr(f, "_pinned", []) if p is not None] for f in feeders]  # none on a CPU acc
        record("feed", f"{tag}: HostFeeder, {threads} thread(s), from {what}", ms, nbytes,
               x_h2d_alone=round(ms / base, 3), pinned_buffers_per_feeder=max(len(h) for h in held),
               pinned_GB=round(sum(p.numel() * p.element_size() for h in held for p in h) / 1e9, 2))
        feeders.clear()


def section_pageable() -> None:
    """Ways to move a pageable host update to the card without the host's copy into pinned memory (d = 1e8 fp32,
    per client, against the pinned copy): the driver's own staging (copy_ from pageable memory), and pinning the
    update in place (cudaHostRegister, copy, cudaHostUnregister)."""
    d, m = size(100_000_000), 8
    host = [torch.full((d,), 0.5 + k) for k in range(2)]
    pinned = host[0].pin_memory() if DEV == "cuda" else host[0]
    dev = torch.empty(d, device=DEV)

    def per_client(fn):  # ms per client of m
        return wall(fn) / m * 1e3

    def pinned_copy():
        for _ in range(m):
            dev.copy_(pinned, non_blocking=True)

    def pageable_copy():
        for i in range(m):
            dev.copy_(host[i % 2], non_blocking=True)

    def registered_copy():
        cudart = torch.cuda.cudart()
        for i in range(m):
            t = host[i % 2]
            assert int(cudart.cudaHostRegister(t.data_ptr(), t.numel() * 4, 0)) == 0
            dev.copy_(t, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            assert int(cudart.cudaHostUnregister(t.data_ptr())) == 0

    base = per_client(pinned_copy)
    record("pageable", "d=1e8 fp32: pinned H2D copy", base, d * 4)
    ms = per_client(pageable_copy)
    record("pageable", "d=1e8 fp32: H2D copy from pageable memory (driver staging)", ms, d * 4,
           x_pinned=round(ms / base, 3))
    if DEV == "cuda":
        ms = per_client(registered_copy)
        record("pageable", "d=1e8 fp32: cudaHostRegister in place, copy, unregister", ms, d * 4,
               x_pinned=round(ms / base, 3))


def section_queue() -> None:
    """Queued adds folded in one Triton sweep (Accumulator.add_many: what flat combining runs for k queued adds):
    k client rows read, the running sum read and the new sum written, k + 2 d-vectors, against the copy. Each
    fold is checked against one-by-one adds of the same clients (float64)."""
    for dtype in (torch.float32, torch.bfloat16):
        for k in (2, 4, 8, 16):
            _queue(size(100_000_000), k, dtype)
        free()


def _queue(d: int, k: int, dtype: torch.dtype) -> None:
    import fastagg
    from fastagg.testing import assert_close, tolerance

    es = torch.finfo(dtype).bits // 8
    xs = (0.01 * torch.randn(k, d, device=DEV)).to(dtype)
    weights = [1.0 + i for i in range(k)]
    acc = fastagg.Accumulator(like=torch.zeros(d, dtype=dtype, device=DEV), backend="triton")
    acc.add_many(xs, weights)
    one = fastagg.Accumulator(like=torch.zeros(d, dtype=dtype, device=DEV), backend="triton")
    for x, w in zip(xs, weights):
        one.add(x, w)
    try:
        rtol, atol = tolerance(dtype, "mean")
        assert_close(acc.weighted_sum, one.weighted_sum.double(), rtol=rtol, atol=atol * k, name="sum")
        verdict = "same sums as one-by-one adds"
    except AssertionError as e:
        verdict = f"WRONG: {e}"[:300]
    del one

    def fold():
        acc.reset()
        acc.add_many(xs, weights)

    nbytes = k * d * es + 2 * 4 * d
    record("queue", f"d={d:.0e} {str(dtype)[6:]}: {k} queued adds folded in one sweep (add_many)", bench(fold),
           nbytes, check=verdict)
    from fastagg.passes import run_stats
    from fastagg.rows import client_rows

    rows = client_rows(list(xs), name="deltas")
    coef = torch.tensor(weights, dtype=torch.float64, device=DEV)
    record("queue", f"d={d:.0e} {str(dtype)[6:]}: the fold's sweep alone ({k} rows onto the sum, no host read)",
           bench(lambda: run_stats(rows, coef, acc._backend, mean_init=acc._sum, mean_out=acc._scratch)), nbytes)
    if k == 4:
        def adds():
            acc.reset()
            for x, w in zip(xs, weights):
                acc.add(x, w)
        record("queue", f"d={d:.0e} {str(dtype)[6:]}: the same {k} clients added one by one", bench(adds),
               k * (d * es + 2 * 4 * d))


def section_robust() -> None:
    """Issues 22 / 48: the coordinate-select pass against copy bandwidth (issue 48: >= 0.7 at M = 16 and M = 100)
    and against torch.median / a torch.sort trimmed mean, its configs side by side (the previous tl.sort pass
    included); the Gram pass and a whole Krum round against X @ X.T + selection."""
    for m, d in ((16, 50_000_000), (32, 25_000_000), (100, 5_000_000)):
        _robust(m, size(d))
        free()


# the coordinate-select pass's configs measured beside the default (select_config) on the median: columns a
# thread, warps, and the previous pass (tl.sort; at M = 100 with the clients across warps, BLOCK_D = 4096 / 128)
# with this wave's norms (each config is one more compile on the card: few)
SELECT_CONFIGS = {16: [dict(BLOCK_D=512), dict(TL_SORT=True)],
                  100: [dict(BLOCK_D=256, num_warps=8), dict(TL_SORT=True, BLOCK_D=32)]}


def _robust(m: int, d: int) -> None:
    from fastagg import robust
    from fastagg.backends import reference
    from fastagg.rows import client_rows

    trobust = importlib.import_module("fastagg.backends.triton.robust")
    tag = f"M={m} d={d:.0e} fp32"
    x = torch.randn(m, d, device=DEV)
    rows = client_rows(x, name="deltas")
    out = torch.empty(d, device=DEV)
    read = m * d * 4 + 4 * d  # the updates read once, the estimate written
    n = min(d, 1 << 20)  # the rows checked against torch.sort on the first n columns
    s = torch.sort(x[:, :n].double(), 0).values
    for name, rule in (("median", robust.Median()), ("trimmed mean 0.2", robust.TrimmedMean(0.2)),
                       (f"MeaMed f={max(1, m // 8)}", robust.MeaMed(max(1, m // 8)))):
        sel = rule.positions(m)
        robust._select_coords(rows, sel, "triton", out)
        want = reference.select_sorted(s.T, *sel).float()
        assert torch.allclose(out[:n], want, rtol=1e-6, atol=1e-7), f"{tag} {name}: wrong estimate"
        record("robust", f"{tag}: fastagg coord_select {name}",
               bench(lambda: robust._select_coords(rows, sel, "triton", out)), read)
        sq = torch.empty(m, dtype=torch.float64, device=DEV)
        bad = torch.zeros(m, dtype=torch.bool, device=DEV)
        for cfg in SELECT_CONFIGS.get(m, []) if name == "median" else []:
            alt = torch.empty(d, device=DEV)
            call = lambda: trobust.coord_select(rows=rows, rule=sel[0], first=sel[1], count=sel[2], out=alt,  # noqa: E731
                                                sq_norms_out=sq, nonfinite_out=bad, _config=cfg)
            call()
            assert torch.allclose(alt, out, rtol=1e-6, atol=1e-7), f"{tag} {name} {cfg}: wrong estimate"
            record("robust", f"{tag}: fastagg coord_select {name} {cfg}", bench(call), read)
    record("robust", f"{tag}: torch.median(X, 0) (lower median)", bench(lambda: torch.median(x, 0)), read)
    k = int(0.2 * m)
    record("robust", f"{tag}: torch.sort(X, 0) trimmed mean 0.2",
           bench(lambda: torch.sort(x, 0).values[k:m - k].mean(0)), read)
    record("robust", f"{tag}: fastagg gram (float64 products)", bench(lambda: robust.gram(rows, "triton")),
           m * d * 4)
    record("robust", f"{tag}: torch X @ X.T (float32)", bench(lambda: x @ x.T), m * d * 4)
    f = max(1, (m - 3) // 4)

    def torch_krum():
        g = (x @ x.T).double()
        d2 = (g.diagonal()[:, None] + g.diagonal()[None, :] - 2 * g).fill_diagonal_(float("inf"))
        best = torch.topk(d2, m - f - 2, dim=1, largest=False).values.sum(1).argmin()
        return x[best].clone()

    record("robust", f"{tag}: fastagg Krum(f={f}) round (gram + weighted sum)",
           bench(lambda: robust.aggregate(x, robust.Krum(f), backend="triton")), 2 * m * d * 4 + 4 * d)
    record("robust", f"{tag}: torch Krum (X @ X.T, topk, copy of the winner)", bench(torch_krum), m * d * 4)


def section_dp() -> None:
    """Issue 23: the noise generated in the stats kernel hidden under the memory time (a noised FedAvg step, client
    side, within 1.15x of the plain step; the server-side step reads the updates twice); the noise alone against
    torch.randn."""
    from fastagg import privacy, server

    for m, d in ((16, 50_000_000), (4, 100_000_000)):
        d = size(d)
        tag = f"M={m} d={d:.0e} fp32"
        x = torch.randn(m, d, device=DEV) * 1e-3
        p = torch.zeros(d, device=DEV)
        c = float(x[0].norm()) * 0.8
        steps = {"FedAvg step": server.FedAvg(p, backend="triton"),
                 "client-side DP + FedAvg step": server.FedAvg(
                     p, backend="triton", aggregate=privacy.ClientSideFixedClipping(1.0, 10 * c, m, seed=1)),
                 "server-side DP + FedAvg step": server.FedAvg(
                     p, backend="triton", aggregate=privacy.ServerSideFixedClipping(1.0, c, m, seed=1))}
        for name, opt in steps.items():
            record("dp", f"{tag}: {name}", bench(lambda: opt.step(x)), m * d * 4 + 8 * d)
        # issue 48: the stats pass alone, with and without the noise written into the mean (one Philox call per 4
        # coordinates, one Box-Muller pair per 2); then the noise alone, shared vs per-element (the old normal_at)
        from fastagg.backends import resolve
        from fastagg.backends.triton import noise as tnoise
        from fastagg.passes import run_stats
        from fastagg.rows import client_rows

        rows, be = client_rows(x, name="deltas"), resolve("triton", torch.device(DEV))
        coefs, mean = torch.full((m,), 1.0 / m, dtype=torch.float64, device=DEV), torch.empty(d, device=DEV)
        for label, noise in (("stats pass", None), ("stats pass + noise", (0.01, 1, 0))):
            record("dp", f"{tag}: {label}", bench(lambda: run_stats(rows, coefs, be, mean_out=mean, noise=noise)),
                   m * d * 4 + 4 * d)
        z = torch.empty(d, device=DEV)
        for label, paired in (("shared Philox", True), ("per-element (old)", False)):
            record("dp", f"{tag}: gaussian_noise {label} (materialized)", bench(
                lambda: tnoise.gaussian_noise(out=z, seed=1, round=0, first=1, _paired=paired)), 4 * d)
        record("dp", f"{tag}: torch.randn", bench(lambda: torch.randn(d, device=DEV)), 4 * d)
        ref = privacy.gaussian_noise(size(1_000_003), seed=1, round=0, first=1, backend="reference")
        tnoise.gaussian_noise(out=z[:ref.numel()], seed=1, round=0, first=1)
        print(f"  dp: shared-Philox noise vs the reference, max |diff| = "
              f"{float((z[:ref.numel()].cpu() - ref).abs().max()):.2e}")
        del x, p, steps, rows, mean, z
        free()


# the blockwise fold's (columns a program, warps) measured beside its default (2048 at 4 for blocks up to 2048
# columns, else 4096 at 8): tests/triton_aot.py compiles the same list
FOLD_TILES = ((4096, 4), (4096, 8), (8192, 8), (8192, 16), (2048, 4))


def section_compress() -> None:
    """Issue 25: compressed clients folded where they lie (int8, fp8, code-book, top-k), against the copy bandwidth
    on the compressed bytes (target >= 0.8) and the same round on float32 clients."""
    import fastagg
    from fastagg.compress import Codebook8, quantize_fp8, quantize_int8, sparsify_topk

    m, d = 16, size(50_000_000)
    tag = f"M={m} d={d:.0e}"
    floats = [torch.randn(d, device=DEV) for _ in range(m)]
    mean = torch.empty(d, device=DEV)
    code = torch.sort(torch.rand(256, device=DEV) * 2 - 1).values
    kinds = {"int8 block 256": [quantize_int8(x, 256) for x in floats],
             "fp8 block 256": [quantize_fp8(x, 256) for x in floats]}
    kinds["code-book block 4096"] = [Codebook8(u.codes.view(torch.uint8), torch.rand(-(-d // 4096), device=DEV) + 0.5,
                                               4096, code=code) for u in kinds["int8 block 256"]]
    record("compress", f"{tag}: fedexp_step fp32", bench(lambda: fastagg.fedexp_step(
        floats, eps=1e-3, backend="triton", mean_out=mean)), m * d * 4 + 4 * d)
    for name, us in kinds.items():
        nbytes = sum(u.nbytes for u in us) + 4 * d
        record("compress", f"{tag}: fedexp_step {name}", bench(lambda: fastagg.fedexp_step(
            us, eps=1e-3, backend="triton", mean_out=mean)), nbytes)
    sparse = [sparsify_topk(x, 0.01) for x in floats]
    record("compress", f"{tag}: fedexp_step top-1% sparse (mean written: 4d bytes)", bench(lambda: fastagg.fedexp_step(
        sparse, eps=1e-3, backend="triton", mean_out=mean)), sum(u.nbytes for u in sparse) + 8 * d)
    # issue 48: FLARE's form (every client its own book tensor: one host read of the distinct books a round), the
    # fold kernel alone in both variants (codes of the next client prefetched: the default; or not), and the one
    # scan of every client's scales / values / indices that replaced the per-client checks
    own = [Codebook8(u.codes, u.scales, 4096, code=code.clone()) for u in kinds["code-book block 4096"]]
    record("compress", f"{tag}: fedexp_step code-book block 4096, a book tensor per client", bench(
        lambda: fastagg.fedexp_step(own, eps=1e-3, backend="triton", mean_out=mean)),
        sum(u.nbytes for u in own) + 4 * d)
    qmod = importlib.import_module("fastagg.backends.triton.quantized")
    coef = torch.full((m,), 1 / m, dtype=torch.float64, device=DEV)
    sq, bad = torch.empty(m, dtype=torch.float64, device=DEV), torch.empty(m, dtype=torch.bool, device=DEV)
    msq = torch.empty((), dtype=torch.float64, device=DEV)
    for name, us in (("int8 block 256", kinds["int8 block 256"]), ("fp8 block 256", kinds["fp8 block 256"]),
                     ("code-book block 4096", kinds["code-book block 4096"])):
        first = us[0]
        for prefetch in (True, False):
            record("compress", f"{tag}: blockwise_fold kernel alone, {name}, prefetch={prefetch}", bench(
                lambda: qmod.blockwise_fold(codes=[u.code_bytes() for u in us], scales=[u.scales for u in us],
                                            block=first.block, table=first.table(),
                                            e4m3=name.startswith("fp8"), coef=coef, init=None, out=mean, sq_out=sq,
                                            bad_out=bad, msq_out=msq, _prefetch=prefetch)),
                sum(u.nbytes for u in us) + 4 * d)
        for tile, warps in FOLD_TILES:  # columns a program and warps (the default: 4096 at 8)
            alt = torch.empty_like(mean)
            fold = (lambda tile=tile, warps=warps: qmod.blockwise_fold(
                codes=[u.code_bytes() for u in us], scales=[u.scales for u in us], block=first.block,
                table=first.table(), e4m3=name.startswith("fp8"), coef=coef, init=None, out=alt, sq_out=sq,
                bad_out=bad, msq_out=msq, _tile=tile, _warps=warps))
            try:
                fold()
                qmod.blockwise_fold(codes=[u.code_bytes() for u in us], scales=[u.scales for u in us],
                                    block=first.block, table=first.table(), e4m3=name.startswith("fp8"), coef=coef,
                                    init=None, out=mean, sq_out=sq, bad_out=bad, msq_out=msq)
                check = "the mean's bits of the default" if torch.equal(alt, mean) else "MEAN DIFFERS"
                record("compress", f"{tag}: blockwise_fold kernel alone, {name}, {tile} columns at {warps} warps "
                       f"({check})", bench(fold), sum(u.nbytes for u in us) + 4 * d)
            except Exception as e:  # a variant that does not compile or fit is a finding, not a crash
                record("compress", f"{tag}: blockwise_fold {name} {tile}x{warps} FAILED {e!r:.200}", 0.0)
            del alt
    ints = kinds["int8 block 256"]
    record("compress", f"{tag}: compressed_scan of the int8 clients' scales (the checks; no host read)", bench(
        lambda: qmod.compressed_scan(scales=[u.scales for u in ints], values=[], indices=[])),
        sum(4 * u.scales.numel() for u in ints))
    record("compress", f"{tag}: compressed_scan of the top-1% clients' values and indices", bench(
        lambda: qmod.compressed_scan(scales=[], values=[u.values for u in sparse],
                                     indices=[u.indices for u in sparse])), sum(u.nbytes for u in sparse))
    del own, coef, sq, bad, msq
    rows = torch.stack(floats[:4])  # the client side: rows quantized on the device (read 4 B, write 1 B + scales)
    from fastagg.compress import int8

    for stochastic in (False, True):
        label = "stochastic" if stochastic else "round half to even"
        record("compress", f"4 rows x {d:.0e}: quantize_int8_rows triton ({label})", bench(
            lambda: int8.quantize_int8_rows(rows, 256, stochastic=stochastic)), rows.numel() * 5)
        record("compress", f"4 rows x {d:.0e}: quantize_int8_rows torch ops ({label})", bench(
            lambda: int8.quantize_int8_rows(rows, 256, stochastic=stochastic, backend="reference")), rows.numel() * 5)
    from fastagg.compress import fp8

    record("compress", f"4 rows x {d:.0e}: quantize_fp8_rows triton", bench(
        lambda: fp8.quantize_fp8_rows(rows, 256)), rows.numel() * 5)
    record("compress", f"4 rows x {d:.0e}: quantize_fp8_rows torch ops", bench(
        lambda: fp8.quantize_fp8_rows(rows, 256, backend="reference")), rows.numel() * 5)
    del floats, kinds, sparse, mean, rows
    free()
    _torchft_fp8(m, d)


def _torchft_fp8(m: int, d: int) -> None:
    """torchft's fused fp8 all-reduce kernels (torchft/quantization.py, BSD; not installed on the card: the file is
    loaded from FASTAGG_TORCHFT_QUANT) on the same bytes: quantize 4 rows of d (rowwise scales over 4096-column
    rows, its layout for a parameter) and the reduce of m ranks' fp8 copies of d (each of the m per-rank reduces
    reads its 1/m share of every rank's copy: m * d fp8 bytes read, d written), against fastagg's fp8 quantizer and
    fp8 fold of m clients of d (m * d fp8 bytes + scales read, the fp32 mean written)."""
    path = os.environ.get("FASTAGG_TORCHFT_QUANT")
    if not path or not os.path.exists(path):
        print("[compress] torchft comparison not run: FASTAGG_TORCHFT_QUANT names no file", flush=True)
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location("torchft_quantization", path)
    tq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tq)
    import fastagg
    from fastagg.compress import fp8, quantize_fp8

    cols = min(4096, d)  # 4096 on the card; the dry run's rows are shorter
    rows = torch.randn(4 * d // cols, cols, device=DEV)
    record("compress", f"4 x {d:.0e} fp32: torchft fused_quantize_into_fp8 (rowwise, {cols} columns)",
           bench(lambda: tq.fused_quantize_into_fp8([rows], 1)), rows.numel() * 5)
    flat = rows.view(4, -1)
    record("compress", f"4 x {d:.0e} fp32: fastagg quantize_fp8_rows (block {cols})",
           bench(lambda: fp8.quantize_fp8_rows(flat, cols)), rows.numel() * 5)
    del rows, flat
    free()
    everything = torch.randn(m * d // cols, cols, device=DEV)  # m ranks' worth of d, quantized once
    packed = tq.fused_quantize_into_fp8([everything], m)

    def reduce_all_ranks():
        for r in range(m):
            tq.fused_reduce_fp8([everything], packed, m, r, tq.ReduceOp.AVG)

    record("compress", f"{m} ranks x {d:.0e}: torchft fused_reduce_fp8 (every rank's reduce, requantized)",
           bench(reduce_all_ranks), m * d + d)
    del everything, packed
    free()
    clients = [quantize_fp8(torch.randn(d, device=DEV), cols) for _ in range(m)]
    mean = torch.empty(d, device=DEV)
    record("compress", f"{m} clients x {d:.0e}: fastagg fedexp_step fp8 block {cols} (fp32 mean written)",
           bench(lambda: fastagg.fedexp_step(clients, eps=1e-3, backend="triton", mean_out=mean)),
           sum(u.nbytes for u in clients) + 4 * d)
    del clients, mean
    free()


SECTIONS = {"copy": section_copy, "compress": section_compress, "robust": section_robust, "dp": section_dp, "feed": section_feed, "pageable": section_pageable, "queue": section_queue, "round": section_round,
            "apply": section_apply, "compile": section_compile, "sweep": section_sweep, "server": section_server,
            "client": section_client, "sim": section_sim}


def main() -> None:
    global DEV, SCALE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="every size / 16 (a smoke run on a GPU)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU through the Triton interpreter "
                    "(set TRITON_INTERPRET=1): checks this script, measures nothing")
    args = ap.parse_args()
    if args.dry_run:
        DEV, SCALE = "cpu", 1e-5
    elif args.quick:
        SCALE = 1 / 16
    import triton

    if DEV == "cuda":
        assert torch.cuda.is_available(), "needs a CUDA GPU (or --dry-run)"
        props = torch.cuda.get_device_properties(0)
        env = dict(card=torch.cuda.get_device_name(0), sms=props.multi_processor_count,
                   memory_GB=round(props.total_memory / 1e9), torch=torch.__version__, triton=triton.__version__,
                   date=datetime.date.today().isoformat())
    else:
        env = dict(card="CPU dry run (interpreter)", sms=0, memory_GB=0, torch=torch.__version__,
                   triton=triton.__version__, date=datetime.date.today().isoformat())
    print(env, flush=True)
    wanted = args.sections.split(",")
    if "copy" not in wanted:
        wanted.insert(0, "copy")
    for name in wanted:
        t0 = time.perf_counter()
        try:
            SECTIONS[name]()
        except Exception as e:  # keep the other sections' numbers
            import traceback

            traceback.print_exc()
            record(name, f"SECTION FAILED: {e!r:.300}", 0.0)
        print(f"== section {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        write(args.out, env)


def write(out: str, env: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_bench.json"), "w") as f:
        json.dump(dict(env=env, copy=COPY_BW, rows=ROWS), f, indent=1)
    lines = [f"card: {env['card']} ({env['sms']} SMs, {env['memory_GB']} GB); torch {env['torch']}, "
             f"triton {env['triton']}; {env['date']}", ""]
    section = None
    for r in ROWS:
        if r["section"] != section:
            section = r["section"]
            lines += ["", f"### {section}", "", "| what | ms | GB moved | GB/s | x copy BW |",
                      "|---|---:|---:|---:|---:|"]
        extra = {k: v for k, v in r.items() if k not in ("section", "name", "ms", "GB", "GBps", "x_copy", "M", "d",
                                                           "dtype")}
        note = f" ({', '.join(f'{k} {v}' for k, v in extra.items())})" if extra else ""
        lines.append(f"| {r['name']}{note} | {r['ms']:.3f} | {r.get('GB', '')} | {r.get('GBps', '')} | "
                     f"{r.get('x_copy', '')} |")
    with open(os.path.join(out, "gpu_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
