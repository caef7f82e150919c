"""The CPU backend: one call into the compiled C++/OpenMP module per primitive (``csrc/``).

Buffers travel as DLPack capsules, which the binding checks itself (csrc/views.h), so torch CPU tensors and
numpy-backed tensors go through without copies and no address is taken on trust.
Results are bit-identical run after run for a given input (block order is fixed, independent of threads).
"""
from __future__ import annotations

import importlib
import os

import torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

from .. import _facts
from ..flat import memory_spans
from ..rows import ClientRows, ParamRows, row_entries

name = "cpu"
ADAM_RULES = {"adam": 0, "yogi": 1, "adagrad": 2, "ams": 3}

ISA_ENV = "FASTAGG_CPU_ISA"  # "default" forces the portable build, "asan" the sanitized one


def wanted_module() -> str:
    """``_C_avx2`` on CPUs torch reports as AVX2/AVX512 capable (unless FASTAGG_CPU_ISA=default), else ``_C``;
    FASTAGG_CPU_ISA=asan picks the AddressSanitizer/UBSan build of ``make test-asan``."""
    if os.environ.get(ISA_ENV, "").lower() == "asan":
        return "_C_asan"
    if os.environ.get(ISA_ENV, "").lower() == "default":
        return "_C"
    return "_C_avx2" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "_C"


def load(name: str):
    return importlib.import_module(f"fastagg.{name}")


# Bytes of a pass per thread of its team (csrc/segments.h, threads_for): below two units a kernel runs on the
# calling thread alone. Unset: the module's measured 16 MB.
THREADS_ENV = "FASTAGG_CPU_BYTES_PER_THREAD"


def bytes_per_thread_from_env() -> int | None:
    """FASTAGG_CPU_BYTES_PER_THREAD as an int in [1, 2^62] written in ASCII digits, None when unset; a ValueError
    naming it otherwise (Python's int() would also take '1_000', '+4096', ' 65536 ' or other scripts' digits, and a
    value beyond int64 would reach the binding as a TypeError naming nothing)."""
    raw = os.environ.get(THREADS_ENV)
    if raw is None:
        return None
    value = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 19 else 0
    if not 1 <= value <= 2**62:
        raise ValueError(f"{THREADS_ENV} must be a whole number of bytes in [1, 2^62] written in digits, got {raw!r}")
    return value


MODULE_NAME = wanted_module()
try:
    _C = load(MODULE_NAME)
except ImportError as e:  # keep the cause; never fall back silently
    _C = None
    IMPORT_ERROR: ImportError | None = e
else:
    IMPORT_ERROR = None
    if bytes_per_thread_from_env() is not None:
        _C.set_bytes_per_thread(bytes_per_thread_from_env())


def compiled():
    """The compiled module, or an ImportError that says how to build it."""
    if _C is None:
        raise ImportError(
            f"fastagg's compiled CPU module (fastagg.{MODULE_NAME}) is not importable: "
            f"{IMPORT_ERROR}. Rebuild it with `pip install --no-build-isolation -e .` in the source tree."
        ) from IMPORT_ERROR
    return _C


def _dl(t: torch.Tensor | None):
    """A tensor as the DLPack capsule the binding reads its address, dtype, shape and strides from (None stays
    None). bool tensors travel as uint8 views. ``torch.utils.dlpack.to_dlpack``, not ``Tensor.__dlpack__``: the same
    capsule at a tenth of the cost (0.6 against 5.2 us; a compressed round of 16 clients exports ~50), with the
    one check of ``__dlpack__`` that applies to real tensors kept."""
    if t is None:
        return None
    if t.requires_grad:
        raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")
    return _to_dlpack(t.view(torch.uint8) if t.dtype == torch.bool else t)


def _rows(rows: ClientRows):
    """The client rows as the bindings take them: the [M, d] matrix's capsule, or L lists of M row capsules (the
    contiguous entries the rows view, when they were built from state_dict entries: the binding checks each one's
    element count and contiguity). Rows are floating and never require grad (rows.py detaches or refuses them), so
    ``_dl``'s two cases do not arise: the capsules come straight from ``_to_dlpack``, ~2,000 a ResNet-18 round of 16
    clients. Where :mod:`fastagg._facts` is used, the rows travel as one row table instead (made and freed in
    ~0.1 ms, where the capsules cost ~0.4)."""
    if rows.matrix is not None and len(rows.segments) == 1:
        return _dl(rows.matrix)
    entries = row_entries(rows)
    table = _facts.row_table(entries) if rows.device.type == "cpu" else None
    if table is not None:
        return table
    _still_in_storage([r for seg in entries for r in seg], "client")
    return [list(map(_to_dlpack, seg)) for seg in entries]


def _base(rows: ClientRows):
    """The base segments of full client models as the bindings take them: one row table (a model of L segments),
    or a capsule a segment."""
    if rows.base is None:
        return None
    table = _facts.row_table([[t] for t in rows.base]) if rows.device.type == "cpu" else None
    if table is not None:
        return table
    _still_in_storage(rows.base, "base")
    return _segments(rows.base)


def _still_in_storage(ts: list, what: str) -> None:
    """The rows' memory checks made again just before the kernel reads them, where they travel as DLPack capsules
    (which carry no storage size): user code that ran after the round's checks -- a weights object's
    ``__array__``, a ``__float__`` -- may have shrunk or freed a storage under a row. A row table makes these checks
    itself as it is built (csrc/tensor_facts.cpp). Nothing is read when one fails."""
    if memory_spans(ts) is None:
        raise ValueError(f"a {what} row no longer lies inside its storage (resized or freed after the round's checks, "
                         "while the weights or another argument were read): nothing was read or written")


def _segments(parts) -> list:
    return [_dl(t) for t in parts]


def round_stats(*, rows: ClientRows, weights: torch.Tensor, mean_init: torch.Tensor | None,
                aux: torch.Tensor | None, aux_coef: float, mean_out: torch.Tensor | None, sq_norms_out: torch.Tensor,
                nonfinite_out: torch.Tensor, mean_sq_out: torch.Tensor, noise=None) -> None:
    sigma, seed, rnd = (0.0, 0, 0) if noise is None else noise
    compiled().round_stats(
        _rows(rows), _base(rows), list(rows.segments.lens), _dl(weights),
        _dl(mean_init), _dl(aux), float(aux_coef), _dl(mean_out), _dl(sq_norms_out), _dl(nonfinite_out),
        _dl(mean_sq_out), float(sigma), int(seed), int(rnd),
    )


def blockwise_fold(*, codes: list, scales: list, block: int, table: torch.Tensor | None, e4m3: bool = False,
                   coef: torch.Tensor, init: torch.Tensor | None, out: torch.Tensor, sq_out: torch.Tensor | None,
                   bad_out: torch.Tensor, msq_out: torch.Tensor) -> None:
    compiled().blockwise_fold([_dl(c) for c in codes], [_dl(s) for s in scales], int(block), _dl(table), bool(e4m3),
                              _dl(coef), _dl(init), _dl(out), _dl(sq_out), _dl(bad_out), _dl(msq_out))


def sparse_fold(*, indices: list, values: list, coef: torch.Tensor, init: torch.Tensor | None, out: torch.Tensor,
                sq_out: torch.Tensor, msq_out: torch.Tensor | None = None) -> None:
    compiled().sparse_fold([_dl(i) for i in indices], [_dl(v) for v in values], _dl(coef), _dl(init), _dl(out),
                           _dl(sq_out), _dl(msq_out))


def quantize_int8_rows(*, x: torch.Tensor, block: int, stochastic: bool, seed: int, round: int, clients: list,
                       codes_out: torch.Tensor, scales_out: torch.Tensor) -> int:
    """csrc/quantized.h (float32 / float64 rows); returns the number of blocks holding a NaN or Inf."""
    return compiled().quantize_int8_rows(_dl(x), int(block), bool(stochastic), int(seed), int(round), list(clients),
                                         _dl(codes_out), _dl(scales_out))


def quantize_fp8_rows(*, x: torch.Tensor, block: int, codes_out: torch.Tensor, scales_out: torch.Tensor) -> int:
    """csrc/quantized.h (float32 / float64 rows; codes as bytes); returns the number of blocks holding a NaN or
    Inf."""
    return compiled().quantize_fp8_rows(_dl(x), int(block), _dl(codes_out.view(torch.int8)), _dl(scales_out))


def gaussian_noise(*, out: torch.Tensor, seed: int, round: int, first: int = 0) -> None:
    compiled().gaussian_noise(_dl(out), int(seed), int(round), int(first))


def philox4x32_10(counter, key) -> list:
    return compiled().philox4x32_10(list(counter), list(key))


def sparse_scan(*, indices: list, values: list) -> list:
    return compiled().sparse_scan([_dl(i) for i in indices], [_dl(v) for v in values])


def scale_scan(*, scales: list) -> list:
    return compiled().scale_scan([_dl(s) for s in scales])


SELECT_RULES = {"window": 0, "nearest": 1}


def coord_select(*, rows: ClientRows, rule: str, first: int, count: int, out: torch.Tensor,
                 sq_norms_out: torch.Tensor, nonfinite_out: torch.Tensor) -> None:
    compiled().coord_select(_rows(rows), _base(rows), list(rows.segments.lens),
                            SELECT_RULES[rule], int(first), int(count), _dl(out), _dl(sq_norms_out),
                            _dl(nonfinite_out))


def gram(*, rows: ClientRows, gram_out: torch.Tensor, nonfinite_out: torch.Tensor) -> None:
    compiled().gram(_rows(rows), _base(rows), list(rows.segments.lens),
                    _dl(gram_out), _dl(nonfinite_out))


def momentum_apply(*, params: ParamRows, mean: torch.Tensor, lr: torch.Tensor, finite: torch.Tensor,
                   buf: torch.Tensor | None, momentum: float, nesterov: bool, extra_out: ParamRows | None,
                   extra_coef: torch.Tensor | None, extra_coef_skip: torch.Tensor | None,
                   overflow_out: torch.Tensor, start: list | None = None,
                   mean_scale: torch.Tensor | None = None) -> None:
    compiled().momentum_apply(
        _segments(params.parts), None if extra_out is None else _segments(extra_out.parts), _dl(mean), _dl(buf),
        _dl(lr.reshape(1)), _dl(None if extra_coef is None else extra_coef.reshape(1)),
        _dl(None if extra_coef_skip is None else extra_coef_skip.reshape(1)), _dl(finite.reshape(1)),
        float(momentum), bool(nesterov), _dl(overflow_out), None if start is None else _segments(start),
        _dl(None if mean_scale is None else mean_scale.reshape(1)),
    )


def adam_apply(*, params: ParamRows, mean: torch.Tensor, finite: torch.Tensor, m: torch.Tensor | None,
               v: torch.Tensor, vhat: torch.Tensor | None, rule: str, lr: torch.Tensor, beta1: float, beta2: float,
               tau: float, ams_eps: float, overflow_out: torch.Tensor) -> None:
    compiled().adam_apply(
        _segments(params.parts), _dl(mean), _dl(m if rule != "adagrad" else None), _dl(v),
        _dl(vhat if rule == "ams" else None), _dl(lr.reshape(1)), _dl(finite.reshape(1)), ADAM_RULES[rule],
        float(beta1), float(beta2), float(tau), float(ams_eps), _dl(overflow_out),
    )


LOCAL_RULES = {"fixed": 0, "sps": 1}
LOCAL_MODES = {"none": 0, "heavy": 1, "nesterov": 2, "mass": 3}


def local_step(*, x, g, anchor, control, ci, buf, lr, loss, l_star, sps_c, cap, first, prox: float, clip_norm: float,
               weight_decay: float, momentum: float, eta2: float, tiny: float, rule: str, mode: str,
               step_out: torch.Tensor) -> None:
    compiled().local_step(
        x.num_rows, x.base.shape[1], _table(x), _table(g), _table(anchor), _dl(control), _table(ci), _table(buf),
        *(_per_row(v) for v in (lr, loss, l_star, sps_c, cap)), _dl(first), float(prox), float(clip_norm),
        float(weight_decay), float(momentum), float(eta2), float(tiny), LOCAL_RULES[rule], LOCAL_MODES[mode],
        _dl(step_out),
    )


def _table(t):
    """A RowTable as (base capsule, index capsule or None, shared)."""
    return None if t is None else (_dl(t.base), _dl(t.index), bool(t.shared))


def _per_row(v):
    """A float64 [M] tensor's capsule, or the number every row uses."""
    return _dl(v) if isinstance(v, torch.Tensor) else float(v)
