"""Rows of [N, d] tensors selected by index: how the client-step kernels see params, gradients, anchors and the
population state without gathering copies, and per-row scalars that may be one number for every row.

The C++ backend gets a table as (address, row stride, index address) and forms the row addresses itself; the
Triton backend gets each row's address (``ptrs``); the reference backend gathers and scatters with torch indexing.
Building nothing per call for the common case (all rows of a matrix, a number for every row) matters: on the CPU
each small torch op before a bandwidth-bound kernel costs tens of microseconds once the kernel's sweep has evicted
the interpreter's working set (bench/RESULTS.md).
"""
from __future__ import annotations

import dataclasses
from typing import Union

import torch


@dataclasses.dataclass
class RowTable:
    """Row i of the batch is row ``index[i]`` of ``base`` (a 2-D tensor with unit stride along d), or row i
    itself when ``index`` is None. A d-vector shared by every row is ``base = v[None]`` with ``shared=True``."""

    base: torch.Tensor
    num_rows: int
    index: torch.Tensor | None = None  # int64 [num_rows] on base's device
    shared: bool = False

    @classmethod
    def rows(cls, t: torch.Tensor) -> "RowTable":
        return cls(t, t.shape[0])

    @classmethod
    def select(cls, t: torch.Tensor, index: torch.Tensor) -> "RowTable":
        return cls(t, index.numel(), index)

    @classmethod
    def broadcast(cls, v: torch.Tensor, num_rows: int) -> "RowTable":
        return cls(v.reshape(1, -1), num_rows, shared=True)

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def row_stride_bytes(self) -> int:
        return 0 if self.shared or self.base.shape[0] <= 1 else self.base.stride(0) * self.base.element_size()

    def ptrs(self) -> torch.Tensor:
        """Addresses of the selected rows, int64 [M], computed on the tensors' device (no host copy)."""
        rows = self.index if self.index is not None else torch.arange(self.num_rows, device=self.base.device)
        return rows * self.row_stride_bytes() + self.base.data_ptr()

    def gather(self, dtype: torch.dtype) -> torch.Tensor:
        """The selected rows as a new [M, d] tensor."""
        if self.shared:
            return self.base.to(dtype).expand(self.num_rows, -1).clone()
        if self.index is None:
            return self.base.to(dtype, copy=True)
        return self.base[self.index].to(dtype)

    def scatter(self, values: torch.Tensor, rows: torch.Tensor) -> None:
        """``base[index[i]] = values[i]`` for the rows where ``rows`` is True."""
        sel = rows.nonzero().flatten()
        self.base[sel if self.index is None else self.index[sel]] = values[sel].to(self.base.dtype)


PerRow = Union[float, torch.Tensor]  # a number for every row, or float64 [M]


def per_row_tensor(value, num_rows: int, device) -> torch.Tensor:
    """A per-row scalar (a number for every row, or a float64 [M] tensor) as a float64 [M] tensor."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.full((num_rows,), float(value), dtype=torch.float64, device=device)
