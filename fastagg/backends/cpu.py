"""The CPU backend: one call into the compiled C++/OpenMP module per primitive (``csrc/``).

Arguments travel as addresses, so torch CPU tensors and numpy-backed tensors go through without copies.
Results are bit-identical run after run for a given input (block order is fixed, independent of threads).
"""
from __future__ import annotations

import importlib
import os

import torch

from ..rows import DTYPE_CODE, ClientRows, ParamRows

name = "cpu"
ADAM_RULES = {"adam": 0, "yogi": 1, "adagrad": 2, "ams": 3}

ISA_ENV = "FASTAGG_CPU_ISA"  # "default" forces the portable build


def wanted_module() -> str:
    """``_C_avx2`` on CPUs torch reports as AVX2/AVX512 capable (unless FASTAGG_CPU_ISA=default), else ``_C``."""
    if os.environ.get(ISA_ENV, "").lower() == "default":
        return "_C"
    return "_C_avx2" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "_C"


def load(name: str):
    return importlib.import_module(f"fastagg.{name}")


MODULE_NAME = wanted_module()
try:
    _C = load(MODULE_NAME)
except ImportError as e:  # keep the cause; never fall back silently
    _C = None
    IMPORT_ERROR: ImportError | None = e
else:
    IMPORT_ERROR = None


def compiled():
    """The compiled module, or an ImportError that says how to build it."""
    if _C is None:
        raise ImportError(
            f"fastagg's compiled CPU module (fastagg.{MODULE_NAME}) is not importable: "
            f"{IMPORT_ERROR}. Rebuild it with `pip install --no-build-isolation -e .` in the source tree."
        ) from IMPORT_ERROR
    return _C


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def round_stats(*, rows: ClientRows, weights: torch.Tensor, mean_init: torch.Tensor | None,
                aux: torch.Tensor | None, aux_coef: float, mean_out: torch.Tensor, sq_norms_out: torch.Tensor,
                nonfinite_out: torch.Tensor, mean_sq_out: torch.Tensor) -> None:
    row_ptrs, base_ptrs = rows.row_ptrs(), rows.base_ptrs()
    lens, offs = rows.segments.tables()
    compiled().round_stats(
        rows.num_clients, len(rows.segments), DTYPE_CODE[rows.dtype], row_ptrs.data_ptr(), _addr(base_ptrs),
        lens.data_ptr(), offs.data_ptr(), weights.data_ptr(), _addr(mean_init), _addr(aux), float(aux_coef),
        mean_out.data_ptr(), sq_norms_out.data_ptr(), nonfinite_out.data_ptr(), mean_sq_out.data_ptr(),
    )


def momentum_apply(*, params: ParamRows, mean: torch.Tensor, lr: torch.Tensor, finite: torch.Tensor,
                   buf: torch.Tensor | None, momentum: float, nesterov: bool, extra_out: ParamRows | None,
                   extra_coef: torch.Tensor | None, extra_coef_skip: torch.Tensor | None) -> None:
    lens, offs = params.segments.tables()
    param_ptrs = params.ptrs()
    extra_ptrs = None if extra_out is None else extra_out.ptrs()
    compiled().momentum_apply(
        len(params.segments), DTYPE_CODE[params.dtype], DTYPE_CODE[mean.dtype], param_ptrs.data_ptr(),
        _addr(extra_ptrs), lens.data_ptr(), offs.data_ptr(), mean.data_ptr(), _addr(buf), lr.data_ptr(),
        _addr(extra_coef), _addr(extra_coef_skip), finite.data_ptr(), float(momentum), bool(nesterov),
    )


def adam_apply(*, params: ParamRows, mean: torch.Tensor, finite: torch.Tensor, m: torch.Tensor | None,
               v: torch.Tensor, vhat: torch.Tensor | None, rule: str, lr: torch.Tensor, beta1: float, beta2: float,
               tau: float, ams_eps: float) -> None:
    lens, offs = params.segments.tables()
    param_ptrs = params.ptrs()
    compiled().adam_apply(
        len(params.segments), DTYPE_CODE[params.dtype], DTYPE_CODE[mean.dtype], param_ptrs.data_ptr(),
        lens.data_ptr(), offs.data_ptr(), mean.data_ptr(), _addr(m), v.data_ptr(), _addr(vhat), lr.data_ptr(),
        finite.data_ptr(), ADAM_RULES[rule], float(beta1), float(beta2), float(tau), float(ams_eps),
    )


LOCAL_RULES = {"fixed": 0, "sps": 1}
LOCAL_MODES = {"none": 0, "heavy": 1, "nesterov": 2, "mass": 3}


def local_step(*, x, g, anchor, control, ci, buf, lr, loss, l_star, sps_c, cap, first, prox: float, clip_norm: float,
               weight_decay: float, momentum: float, eta2: float, tiny: float, rule: str, mode: str,
               step_out: torch.Tensor) -> None:
    compiled().local_step(
        x.num_rows, x.base.shape[1], DTYPE_CODE[x.dtype], *x.addressing(), *g.addressing(), *_table(anchor),
        _addr(control), *_table(ci), *_table(buf), *_per_row(lr), *_per_row(loss), *_per_row(l_star),
        *_per_row(sps_c), *_per_row(cap), _addr(first), float(prox), float(clip_norm), float(weight_decay),
        float(momentum), float(eta2), float(tiny), LOCAL_RULES[rule], LOCAL_MODES[mode], step_out.data_ptr(),
    )


def _table(t) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else t.addressing()


def _per_row(v) -> tuple[int, float]:
    """(address of a float64 [M] tensor, 0.0), or (0, the number every row uses)."""
    return (v.data_ptr(), 0.0) if isinstance(v, torch.Tensor) else (0, float(v))
