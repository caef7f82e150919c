"""The CPU backend: one call into the compiled C++/OpenMP module per primitive (``csrc/``).

Arguments travel as addresses, so torch CPU tensors and numpy-backed tensors go through without copies.
Results are bit-identical run after run for a given input (block order is fixed, independent of threads).
"""
from __future__ import annotations

import torch

from ..rows import DTYPE_CODE, ClientRows, ParamRows

name = "cpu"

try:
    from .. import _C
except ImportError as e:  # keep the cause; never fall back silently
    _C = None
    IMPORT_ERROR: ImportError | None = e
else:
    IMPORT_ERROR = None


def compiled():
    """The compiled module, or an ImportError that says how to build it."""
    if _C is None:
        raise ImportError(
            "fastagg's compiled CPU module (fastagg._C) is not importable: "
            f"{IMPORT_ERROR}. Rebuild it with `pip install --no-build-isolation -e .` in the source tree."
        ) from IMPORT_ERROR
    return _C


def round_stats(*, rows: ClientRows, weights: torch.Tensor, mean_init: torch.Tensor | None, mean_out: torch.Tensor,
                sq_norms_out: torch.Tensor, nonfinite_out: torch.Tensor, mean_sq_out: torch.Tensor) -> None:
    row_ptrs = rows.row_ptrs()
    base_ptrs = rows.base_ptrs()
    lens, offs = rows.segments.tables()
    compiled().round_stats(
        rows.num_clients, len(rows.segments), DTYPE_CODE[rows.dtype], row_ptrs.data_ptr(),
        0 if base_ptrs is None else base_ptrs.data_ptr(), lens.data_ptr(), offs.data_ptr(), weights.data_ptr(),
        0 if mean_init is None else mean_init.data_ptr(), mean_out.data_ptr(), sq_norms_out.data_ptr(), nonfinite_out.data_ptr(), mean_sq_out.data_ptr(),
    )


def apply_update(*, params: ParamRows, mean: torch.Tensor, eta: torch.Tensor, finite: torch.Tensor,
                 eval_out: ParamRows | None, eval_scale: float) -> None:
    lens, offs = params.segments.tables()
    param_ptrs = params.ptrs()
    eval_ptrs = None if eval_out is None else eval_out.ptrs()
    compiled().apply_update(
        len(params.segments), DTYPE_CODE[params.dtype], DTYPE_CODE[mean.dtype], param_ptrs.data_ptr(),
        0 if eval_ptrs is None else eval_ptrs.data_ptr(), lens.data_ptr(), offs.data_ptr(), mean.data_ptr(),
        eta.data_ptr(), finite.data_ptr(), float(eval_scale),
    )
