"""The CPU backend: one call into the compiled C++/OpenMP module per primitive (``csrc/``).

Buffers travel as DLPack capsules, which the binding checks itself (csrc/views.h), so torch CPU tensors and
numpy-backed tensors go through without copies and no address is taken on trust.
Results are bit-identical run after run for a given input (block order is fixed, independent of threads).
"""
from __future__ import annotations

import importlib
import os
from operator import methodcaller

import torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

from .. import _facts
from ..flat import check_memory, memory_spans
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
    ~0.1 ms, where the capsules cost ~0.4). Made last of a call's arguments (see :func:`_exported`)."""
    if rows.matrix is not None and len(rows.segments) == 1:
        return _exported(rows.matrix)[0]
    entries = row_entries(rows)
    table = _facts.row_table(entries) if rows.device.type == "cpu" else None
    if table is not None:
        return table
    _still_in_storage([r for seg in entries for r in seg],
                      lambda j: f"client {j % rows.num_clients}'s entry {j // rows.num_clients}")
    return [list(map(_to_dlpack, seg)) for seg in entries]


def _base(rows: ClientRows):
    """The base segments of full client models as the bindings take them: one row table (a model of L segments),
    or a capsule a segment."""
    if rows.base is None:
        return None
    table = _facts.row_table([[t] for t in rows.base]) if rows.device.type == "cpu" else None
    if table is not None:
        return table
    _still_in_storage(rows.base, lambda j: f"the base's entry {j}")
    return [_to_dlpack(t) for t in rows.base]


def _still_in_storage(ts: list, name) -> None:
    """Every tensor of ``ts`` still lies inside its storage, checked just before the kernel reads or writes it:
    user code that ran after the round's checks -- a weights object's ``__array__``, a hyperparameter's
    ``__float__`` -- may have shrunk or freed a storage (DLPack capsules carry no storage size; a row table checks
    its rows itself as it is built, csrc/tensor_facts.cpp). ``name(j)`` names ``ts[j]`` in the error. Nothing is
    read or written when one fails."""
    fine = _facts.in_storage(ts)
    if fine:
        return
    ts = [t for t in ts if t is not None]
    if fine is None and memory_spans(ts) is not None and all(map(_CONTIGUOUS, ts)):
        return
    for j, t in enumerate(ts):  # (find and name the one: the general check, strides and all)
        try:
            check_memory(t, name(j))
        except ValueError as e:
            raise ValueError(f"{e} -- changed after the round's checks, while the weights or another argument "
                             "were read") from None


def _exported(*args) -> list:
    """Capsules of a call's tensor arguments (None stays None; a list gives a list), then every one's memory
    checked at once. Exporting may run user code (a tensor subclass's property), so the check comes after it, and
    a call's rows come after both (:func:`_rows`): once the last check is made nothing of the caller's runs before
    the binding reads the buffers. Scalars are converted before any of it (a ``__float__`` runs there)."""
    out, every = [], []
    for a in args:
        if isinstance(a, list):
            out.append([_dl(t) for t in a])
            every += a
        else:
            out.append(_dl(a))
            every.append(a)
    _still_in_storage(every, lambda j: f"argument {j} of the call")
    return out


_CONTIGUOUS = methodcaller("is_contiguous")


def round_stats(*, rows: ClientRows, weights: torch.Tensor, mean_init: torch.Tensor | None,
                aux: torch.Tensor | None, aux_coef: float, mean_out: torch.Tensor | None, sq_norms_out: torch.Tensor,
                nonfinite_out: torch.Tensor, mean_sq_out: torch.Tensor, noise=None) -> None:
    sigma, seed, rnd = (0.0, 0, 0) if noise is None else noise
    scalars = float(aux_coef), float(sigma), int(seed), int(rnd)  # first: no user code runs after the checks
    w, init, ax, mean, sq, bad, msq = _exported(weights, mean_init, aux, mean_out, sq_norms_out, nonfinite_out,
                                                mean_sq_out)
    compiled().round_stats(_rows(rows), _base(rows), list(rows.segments.lens), w, init, ax, scalars[0], mean, sq, bad,
                           msq, *scalars[1:])


def blockwise_fold(*, codes: list, scales: list, block: int, table: torch.Tensor | None, e4m3: bool = False,
                   coef: torch.Tensor, init: torch.Tensor | None, out: torch.Tensor, sq_out: torch.Tensor | None,
                   bad_out: torch.Tensor, msq_out: torch.Tensor) -> None:
    scalars = int(block), bool(e4m3)  # first: no user code runs after the checks (_exported)
    c, sc, tab, *rest = _exported(list(codes), list(scales), table, coef, init, out, sq_out, bad_out, msq_out)
    compiled().blockwise_fold(c, sc, scalars[0], tab, scalars[1], *rest)


def sparse_fold(*, indices: list, values: list, coef: torch.Tensor, init: torch.Tensor | None, out: torch.Tensor,
                sq_out: torch.Tensor, msq_out: torch.Tensor | None = None) -> None:
    compiled().sparse_fold(*_exported(list(indices), list(values), coef, init, out, sq_out, msq_out))


def quantize_int8_rows(*, x: torch.Tensor, block: int, stochastic: bool, seed: int, round: int, clients: list,
                       codes_out: torch.Tensor, scales_out: torch.Tensor) -> int:
    """csrc/quantized.h (float32 / float64 rows); returns the number of blocks holding a NaN or Inf."""
    scalars = int(block), bool(stochastic), int(seed), int(round), [int(c) for c in clients]
    xc, codes, scales = _exported(x, codes_out, scales_out)
    return compiled().quantize_int8_rows(xc, *scalars, codes, scales)


def quantize_fp8_rows(*, x: torch.Tensor, block: int, codes_out: torch.Tensor, scales_out: torch.Tensor) -> int:
    """csrc/quantized.h (float32 / float64 rows; codes as bytes); returns the number of blocks holding a NaN or
    Inf."""
    b = int(block)
    xc, codes, scales = _exported(x, codes_out.view(torch.int8), scales_out)
    return compiled().quantize_fp8_rows(xc, b, codes, scales)


def gaussian_noise(*, out: torch.Tensor, seed: int, round: int, first: int = 0) -> None:
    scalars = int(seed), int(round), int(first)
    compiled().gaussian_noise(_exported(out)[0], *scalars)


def philox4x32_10(counter, key) -> list:
    return compiled().philox4x32_10(list(counter), list(key))


def sparse_scan(*, indices: list, values: list) -> list:
    return compiled().sparse_scan(*_exported(list(indices), list(values)))


def scale_scan(*, scales: list) -> list:
    return compiled().scale_scan(_exported(list(scales))[0])


SELECT_RULES = {"window": 0, "nearest": 1}


def coord_select(*, rows: ClientRows, rule: str, first: int, count: int, out: torch.Tensor,
                 sq_norms_out: torch.Tensor, nonfinite_out: torch.Tensor) -> None:
    scalars = SELECT_RULES[rule], int(first), int(count)  # first: no user code runs after the checks
    caps = _exported(out, sq_norms_out, nonfinite_out)
    compiled().coord_select(_rows(rows), _base(rows), list(rows.segments.lens), *scalars, *caps)


def gram(*, rows: ClientRows, gram_out: torch.Tensor, nonfinite_out: torch.Tensor) -> None:
    caps = _exported(gram_out, nonfinite_out)
    compiled().gram(_rows(rows), _base(rows), list(rows.segments.lens), *caps)


def momentum_apply(*, params: ParamRows, mean: torch.Tensor, lr: torch.Tensor, finite: torch.Tensor,
                   buf: torch.Tensor | None, momentum: float, nesterov: bool, extra_out: ParamRows | None,
                   extra_coef: torch.Tensor | None, extra_coef_skip: torch.Tensor | None,
                   overflow_out: torch.Tensor, start: list | None = None,
                   mean_scale: torch.Tensor | None = None) -> None:
    scalars = float(momentum), bool(nesterov)  # first: no user code runs after the checks
    caps = _exported(list(params.parts), None if extra_out is None else list(extra_out.parts), mean, buf,
                     lr.reshape(1), None if extra_coef is None else extra_coef.reshape(1),
                     None if extra_coef_skip is None else extra_coef_skip.reshape(1), finite.reshape(1),
                     overflow_out, None if start is None else list(start),
                     None if mean_scale is None else mean_scale.reshape(1))
    compiled().momentum_apply(*caps[:8], *scalars, *caps[8:])


def adam_apply(*, params: ParamRows, mean: torch.Tensor, finite: torch.Tensor, m: torch.Tensor | None,
               v: torch.Tensor, vhat: torch.Tensor | None, rule: str, lr: torch.Tensor, beta1: float, beta2: float,
               tau: float, ams_eps: float, overflow_out: torch.Tensor) -> None:
    scalars = ADAM_RULES[rule], float(beta1), float(beta2), float(tau), float(ams_eps)  # first (see momentum_apply)
    caps = _exported(list(params.parts), mean, m if rule != "adagrad" else None, v, vhat if rule == "ams" else None,
                     lr.reshape(1), finite.reshape(1), overflow_out)
    compiled().adam_apply(*caps[:7], *scalars, caps[7])


LOCAL_RULES = {"fixed": 0, "sps": 1}
LOCAL_MODES = {"none": 0, "heavy": 1, "nesterov": 2, "mass": 3}


def local_step(*, x, g, anchor, control, ci, buf, lr, loss, l_star, sps_c, cap, first, prox: float, clip_norm: float,
               weight_decay: float, momentum: float, eta2: float, tiny: float, rule: str, mode: str,
               step_out: torch.Tensor) -> None:
    per_row = [v if isinstance(v, torch.Tensor) else float(v) for v in (lr, loss, l_star, sps_c, cap)]
    scalars = (float(prox), float(clip_norm), float(weight_decay), float(momentum), float(eta2), float(tiny),
               LOCAL_RULES[rule], LOCAL_MODES[mode], x.num_rows, x.base.shape[1])  # first (see _exported)
    tables = [t for t in (x, g, anchor, ci, buf)]
    shared = [None if t is None else bool(t.shared) for t in tables]
    tensors = [u for t in tables for u in ((None, None) if t is None else (t.base, t.index))]
    vec = [v for v in per_row if isinstance(v, torch.Tensor)]
    caps = _exported(*tensors, control, first, step_out, *vec)
    tab = [None if sh is None else (caps[2 * k], caps[2 * k + 1], sh) for k, sh in enumerate(shared)]
    ctrl, fst, out, vecs = caps[10], caps[11], caps[12], iter(caps[13:])
    rows = [next(vecs) if isinstance(v, torch.Tensor) else v for v in per_row]
    compiled().local_step(scalars[8], scalars[9], tab[0], tab[1], tab[2], ctrl, tab[3], tab[4], *rows, fst,
                          *scalars[:8], out)
