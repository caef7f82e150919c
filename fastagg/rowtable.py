"""Rows of [N, d] tensors selected by index: how the client-step kernels see params, gradients, anchors and the
population state without gathering copies. A kernel gets each row's address (``ptrs``); the reference backend
gathers and scatters with torch indexing."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class RowTable:
    """Row ``index[i]`` of ``base`` (a 2-D tensor with unit stride along d) is row i of the batch.

    A shared d-vector is ``base = v[None]`` with ``index = 0`` for every row.
    """

    base: torch.Tensor
    index: torch.Tensor  # int64 [M] on base's device

    @classmethod
    def rows(cls, t: torch.Tensor) -> "RowTable":
        return cls(t, torch.arange(t.shape[0], device=t.device))

    @classmethod
    def shared(cls, v: torch.Tensor, num_rows: int) -> "RowTable":
        return cls(v.reshape(1, -1), torch.zeros(num_rows, dtype=torch.int64, device=v.device))

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def ptrs(self) -> torch.Tensor:
        """Addresses of the selected rows, int64 [M], computed on the tensors' device (no host copy)."""
        step = self.base.stride(0) * self.base.element_size() if self.base.shape[0] > 1 else 0
        return self.index * step + self.base.data_ptr()

    def gather(self, dtype: torch.dtype) -> torch.Tensor:
        return self.base[self.index].to(dtype)

    def scatter(self, values: torch.Tensor, rows: torch.Tensor) -> None:
        """``base[index[i]] = values[i]`` for the rows where ``rows`` is True."""
        sel = rows.nonzero().flatten()
        self.base[self.index[sel]] = values[sel].to(self.base.dtype)
