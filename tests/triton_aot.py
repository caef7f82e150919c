"""Compile every Triton kernel ahead of time for NVIDIA GPUs, with no GPU present.

Run as a script (without TRITON_INTERPRET): the launchers are driven with small CPU tensors, each kernel launch
is captured instead of run, and the captured signature is compiled with ``triton.compile`` for the given
targets down to a cubin (ptxas ships with triton). This checks that the real launch arguments type-check and
compile on this triton version, which the interpreter cannot show.

    python tests/triton_aot.py 90 80              # compute capabilities
    python tests/triton_aot.py 90 --shard=1/2     # every other variant from the second (parallel processes)
"""
from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import importlib  # noqa: E402

# the package re-exports the launchers under the modules' names: fetch the modules themselves
stats_mod = importlib.import_module("fastagg.backends.triton.round_stats")
momentum_mod = importlib.import_module("fastagg.backends.triton.momentum_apply")
adam_mod = importlib.import_module("fastagg.backends.triton.adam_apply")

TYPES = {torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16", torch.bfloat16: "bf16",
         torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}

captured = []


class Capture:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            captured.append((self.fn, args, kwargs))
        return launch


def signature(fn, args, kwargs):
    names = fn.arg_names
    sig, const = {}, {}
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + TYPES[a.dtype]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i64"
        elif isinstance(a, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={a!r}")
    options = {}
    for name, v in kwargs.items():
        if name in ("num_warps", "num_stages"):
            options[name] = v
        else:
            sig[name] = "constexpr"
            const[(names.index(name),)] = v
    return sig, const, options


def drive_launchers():
    """Every launcher variant: dtypes, base/init/aux, one or many segments, every apply-pass option."""
    from fastagg.passes import like_params
    from fastagg.rows import client_rows, compute_dtype, param_rows, with_base

    from fastagg.rowtable import RowTable

    f64 = dict(dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        cdt = compute_dtype(dtype)
        for per_layer in (False, True):
            x = torch.zeros(3, 10, dtype=dtype)
            rows = client_rows([[r[:4], r[4:]] for r in x] if per_layer else x, name="deltas")
            for base in (False, True):
                r = with_base(rows, param_rows(torch.zeros(10, dtype=dtype))) if base else rows
                for init, aux in ((None, None), (torch.zeros(10, dtype=cdt), None), (None, torch.zeros(10, dtype=cdt))):
                    stats_mod.round_stats(rows=r, weights=torch.ones(3, **f64), mean_init=init, aux=aux, aux_coef=0.9,
                                          mean_out=torch.zeros(10, dtype=cdt), sq_norms_out=torch.zeros(3, **f64),
                                          nonfinite_out=torch.zeros(3, dtype=torch.bool),
                                          mean_sq_out=torch.zeros((), **f64))
            params = [torch.zeros(4, dtype=dtype), torch.zeros(6, dtype=dtype)] if per_layer else torch.zeros(10, dtype=dtype)
            p = param_rows(params)
            one, finite, mean = torch.ones((), **f64), torch.ones((), dtype=torch.bool), torch.zeros(10, dtype=cdt)
            for buf in (None, torch.zeros(10, dtype=cdt)):
                for extra in (None, like_params(p, torch.zeros(10, dtype=dtype))):
                    for nesterov in (False, True):
                        for skip in (None, one):
                            for start in (None, like_params(p, torch.zeros(10, dtype=dtype)).parts):
                                for scale in (None, one):
                                    momentum_mod.momentum_apply(params=p, mean=mean, lr=one, finite=finite, buf=buf,
                                                                momentum=0.9, nesterov=nesterov, extra_out=extra,
                                                                extra_coef=one, extra_coef_skip=skip,
                                                                overflow_out=torch.zeros(1, dtype=torch.int32),
                                                                start=start, mean_scale=scale)
            for d, schedule in ((10, "row"), (40_000, "row"), (40_000, "chunks"), (40_000, "grouped")):
                block = min(4096, triton.next_power_of_2(d))
                local_mod.local_config = lambda m, n, s=schedule, b=block: dict(
                    schedule=s, BLOCK=b, CHUNK=None if s == "row" else 4 * b, GROUP_ROWS=2, num_warps=8)
                xs = torch.zeros(3, d, dtype=dtype)
                rows, shared = RowTable.rows(xs), RowTable.broadcast(torch.zeros(d, dtype=dtype), 3)
                vec = torch.zeros(3, **f64)
                for anchor, control, ci in ((None, None, None), (shared, torch.zeros(d, dtype=cdt),
                                                                 RowTable.rows(torch.zeros(3, d, dtype=cdt)))):
                    for rule in ("fixed", "sps"):
                        for mode, first in (("none", None), ("heavy", None), ("nesterov", None), ("mass", vec)):
                            buf = None if mode == "none" else RowTable.rows(torch.zeros(3, d, dtype=cdt))
                            local_mod.local_step(x=rows, g=rows, anchor=anchor, control=control, ci=ci, buf=buf,
                                                 lr=vec, loss=vec, l_star=vec, sps_c=vec, cap=vec, first=first,
                                                 prox=0.1, clip_norm=1.0, weight_decay=0.0, momentum=0.9, eta2=0.0,
                                                 tiny=1e-30, rule=rule, mode=mode, step_out=vec)
            for rule in ("adam", "yogi", "adagrad", "ams"):
                adam_mod.adam_apply(params=p, mean=mean, finite=finite, m=torch.zeros(10, dtype=cdt),
                                    v=torch.zeros(10, dtype=cdt), vhat=torch.zeros(10, dtype=cdt), rule=rule, lr=one,
                                    beta1=0.9, beta2=0.99, tau=1e-3, ams_eps=1e-8,
                                    overflow_out=torch.zeros(1, dtype=torch.int32))


    drive_later_launchers()
    drive_pipeline_variants()


def drive_pipeline_variants():
    """The stats pass's and the client step's ways of keeping loads in flight (launch.STATS_PIPELINE and
    LOCAL_PIPELINE), each in the tiles and calls that bench/gpu_bench.py and tests/test_on_device_stats.py run."""
    from fastagg.rowtable import RowTable
    from fastagg.rows import client_rows

    f64 = dict(dtype=torch.float64)
    chosen = stats_mod.stats_config
    for dtype, (bm, bd, warps), variants in (
            (torch.bfloat16, (1, 8192, 4), ((1, True, None), (2, True, None), (2, False, None), (0, False, 3),
                                             (0, False, 4), (0, True, 4), (1, True, 3))),
            (torch.bfloat16, (1, 8192, 8), ((0, False, 3), (2, True, None))),
            (torch.bfloat16, (1, 4096, 4), ((0, False, 4),)),
            (torch.float32, (2, 2048, 4), ((2, False, None), (0, False, 3)))):
        for prefetch, raw, stages in variants:
            stats_mod.stats_config = lambda M, n, es=4, p=prefetch, r=raw, s=stages: dict(
                BLOCK_M=bm, BLOCK_D=bd, num_warps=warps, PREFETCH=p, RAW=r, STAGES=s)
            rows = client_rows(torch.zeros(3, 64, dtype=dtype), name="deltas")  # 16-byte-aligned rows
            stats_mod.round_stats(rows=rows, weights=torch.ones(3, **f64), mean_init=None, aux=None, aux_coef=0.0,
                                  mean_out=torch.zeros(64), sq_norms_out=torch.zeros(3, **f64),
                                  nonfinite_out=torch.zeros(3, dtype=torch.bool), mean_sq_out=torch.zeros((), **f64))
    stats_mod.stats_config = chosen
    d, vec = 40_000, torch.zeros(3, **f64)
    for schedule in ("grouped", "chunks", "row"):
        for prefetch, stages in ((1, None), (0, 2), (0, 3), (1, 3)):
            local_mod.local_config = lambda m, n, s=schedule, p=prefetch, st=stages: dict(
                schedule=s, BLOCK=4096, CHUNK=None if s == "row" else 16384, GROUP_ROWS=2, num_warps=8,
                PREFETCH=p, STAGES=st)
            rows = RowTable.rows(torch.zeros(3, d))
            calls = [(None, "sps", "none")] if schedule == "grouped" else []  # the benchmark's FedSPS
            calls += [(RowTable.broadcast(torch.zeros(d), 3), "sps", "none"), (None, "fixed", "heavy")]
            for anchor, rule, mode in calls:
                buf = None if mode == "none" else RowTable.rows(torch.zeros(3, d))
                local_mod.local_step(x=rows, g=RowTable.rows(torch.zeros(3, d)), anchor=anchor, control=None, ci=None,
                                     buf=buf, lr=vec, loss=vec, l_star=vec, sps_c=vec, cap=vec, first=None, prox=0.1,
                                     clip_norm=1.0, weight_decay=0.0, momentum=0.9, eta2=0.0, tiny=1e-30, rule=rule,
                                     mode=mode, step_out=vec)


def drive_later_launchers():
    """The kernels of issues 22-25: the stats pass writing DP noise, the noise alone, the robust passes, the client
    quantizers and the compressed folds (every dtype and option their launchers pass)."""
    from fastagg.rows import client_rows

    f64 = dict(dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        rows = client_rows(torch.zeros(3, 10, dtype=dtype), name="deltas")
        stats_mod.round_stats(rows=rows, weights=torch.ones(3, **f64), mean_init=None, aux=None, aux_coef=0.0,
                              mean_out=torch.zeros(10), sq_norms_out=torch.zeros(3, **f64),
                              nonfinite_out=torch.zeros(3, dtype=torch.bool), mean_sq_out=torch.zeros((), **f64),
                              noise=(0.5, 2 ** 64 - 1, 2 ** 40 + 3))
        # the select pass: few clients (norms by shuffles) and 17 (norms by tl.dot, but from 16-bit rows), the
        # window and MeaMed's nearest rule; at fp32 the configs bench/gpu_bench.py times beside the default
        for m in (3, 17):
            sel_rows = client_rows(torch.zeros(m, 10, dtype=dtype), name="deltas")
            configs = [None] + [dict(BLOCK_D=512), dict(TL_SORT=True)] * (dtype == torch.float32 and m == 17)
            for rule, config in [(r, c) for r in ("window", "nearest") for c in configs]:
                robust_mod.coord_select(rows=sel_rows, rule=rule, first=1, count=1, out=torch.zeros(10),
                                        sq_norms_out=torch.zeros(m, **f64),
                                        nonfinite_out=torch.zeros(m, dtype=torch.bool), _config=config)
        robust_mod.gram(rows=rows, gram_out=torch.zeros(3, 3, **f64), nonfinite_out=torch.zeros(3, dtype=torch.bool))
        if dtype != torch.float64:
            x = torch.zeros(3, 1000, dtype=dtype)
            for block in (256, 100):  # tiled (a power of two) and one block a program
                nb = -(-1000 // block)
                for stochastic in (False, True):
                    quantize_mod.quantize_int8_rows(x=x, block=block, stochastic=stochastic, seed=2 ** 63 + 1,
                                                    round=4, clients=[0, 1, 2],
                                                    codes_out=torch.zeros(3, 1000, dtype=torch.int8),
                                                    scales_out=torch.zeros(3, nb))
                quantize_mod.quantize_fp8_rows(x=x, block=block, codes_out=torch.zeros(3, 1000, dtype=torch.uint8),
                                               scales_out=torch.zeros(3, nb))
    noise_mod.gaussian_noise(out=torch.zeros(10), seed=2 ** 64 - 1, round=7, first=3)
    noise_mod.gaussian_noise(out=torch.zeros(10), seed=1, round=7, first=3, _paired=False)  # (the benchmark's)
    for dtype in (torch.float32, torch.float64):  # segment offsets not known to be multiples of 4: chosen per block
        rows = client_rows([[r[:3], r[3:]] for r in torch.zeros(3, 10, dtype=dtype)], name="deltas")
        stats_mod.round_stats(rows=rows, weights=torch.ones(3, **f64), mean_init=None, aux=None, aux_coef=0.0,
                              mean_out=torch.zeros(10, dtype=dtype), sq_norms_out=torch.zeros(3, **f64),
                              nonfinite_out=torch.zeros(3, dtype=torch.bool), mean_sq_out=torch.zeros((), **f64),
                              noise=(0.5, 1, 2))
    for init in (None, torch.zeros(1000)):
        # a power-of-two block (per-block scales and integer squares) and any other; aligned codes and not
        for block, offset in ((256, 0), (100, 0), (256, 1)):
            codes = [torch.zeros(1001, dtype=torch.int8)[offset:offset + 1000] for _ in range(2)]
            scales = [torch.ones(10) for _ in range(2)]
            for table, e4m3 in ((None, False), (None, True), (torch.zeros(256), False)):
                for prefetch in (True, False):  # (bench/gpu_bench.py times both on the card)
                    quantized_mod.blockwise_fold(codes=codes, scales=scales, block=block, table=table, e4m3=e4m3,
                                                 coef=torch.ones(2, **f64), init=init, out=torch.zeros(1000),
                                                 sq_out=torch.zeros(2, **f64),
                                                 bad_out=torch.zeros(2, dtype=torch.bool),
                                                 msq_out=torch.zeros((), **f64), _prefetch=prefetch)
                for tile, warps in FOLD_TILES:  # (the benchmark's tile / warps variants of the fold)
                    quantized_mod.blockwise_fold(codes=codes, scales=scales, block=block, table=table, e4m3=e4m3,
                                                 coef=torch.ones(2, **f64), init=init, out=torch.zeros(1000),
                                                 sq_out=torch.zeros(2, **f64),
                                                 bad_out=torch.zeros(2, dtype=torch.bool),
                                                 msq_out=torch.zeros((), **f64), _tile=tile, _warps=warps)
        quantized_mod.sparse_fold(indices=[torch.arange(5)], values=[torch.ones(5)], coef=torch.ones(1, **f64),
                                  init=init, out=torch.zeros(1000), sq_out=torch.zeros(1, **f64))
    # the checks before a fold: scales and sparse parts with int32 and int64 indices (one kernel variant each)
    quantized_mod.compressed_scan(scales=[torch.ones(10)], values=[torch.ones(5), torch.ones(5)],
                                  indices=[torch.arange(5, dtype=torch.int32), torch.arange(5)])


FOLD_TILES = ((4096, 4), (4096, 8), (8192, 8), (8192, 16), (2048, 4))  # bench/gpu_bench.py's, and both defaults


local_mod = importlib.import_module("fastagg.backends.triton.local_step")
robust_mod = importlib.import_module("fastagg.backends.triton.robust")
noise_mod = importlib.import_module("fastagg.backends.triton.noise")
quantize_mod = importlib.import_module("fastagg.backends.triton.quantize")
quantized_mod = importlib.import_module("fastagg.backends.triton.quantized")
MODULES = (stats_mod, momentum_mod, adam_mod, local_mod, robust_mod, noise_mod, quantize_mod, quantized_mod)


def capture_launches():
    """Replace every kernel (a jitted function named *_kernel in the Triton backend's modules) by a Capture."""
    from triton.runtime.jit import JITFunction

    names = []
    for mod in MODULES:
        for name, fn in vars(mod).items():
            if isinstance(fn, JITFunction) and name.endswith("_kernel"):
                setattr(mod, name, Capture(fn))
                names.append(name)
    return names


def main(capabilities, shard=0, shards=1):
    """Compile every distinct launch for each capability; with ``shards`` > 1 only every shards-th variant from
    ``shard`` (processes in parallel split the work: compiling is single-threaded)."""
    kernels = capture_launches()
    drive_launchers()
    launched = {fn.__name__ for fn, _, _ in captured}
    assert launched == set(kernels), f"kernels no launcher drove: {sorted(set(kernels) - launched)}"
    seen = {}
    for fn, args, kwargs in captured:
        sig, const, options = signature(fn, args, kwargs)
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in const.items())),
               tuple(sorted(options.items())))  # num_warps too: the same constexprs at other warps compile apart
        seen.setdefault(key, (fn, sig, const, options))
    mine = list(seen.values())[shard::shards]
    for fn, sig, const, options in mine:
        for cc in capabilities:
            try:
                k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                                   target=GPUTarget("cuda", cc, 32), options=options)
            except Exception:
                print(f"FAILED: {fn.__name__} sm_{cc} {sig} {const} {options}", file=sys.stderr)
                raise
            assert len(k.asm["cubin"]) > 0
    print(f"compiled {len(mine)} of {len(seen)} kernel variants for sm_{', sm_'.join(map(str, capabilities))} "
          f"with triton {triton.__version__}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--shard=")]
    part = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--shard=")]  # --shard=i/n
    shard, shards = map(int, part[0].split("/")) if part else (0, 1)
    main([int(c) for c in args] or [90], shard, shards)
