"""Inputs normalized for the kernels: M client rows cut into L segments, and the parameter buffer.

Every accepted form of client updates -- an ``[M, d]`` tensor (rows may be strided), a list of M flat
tensors, a list of M per-layer lists or state_dicts, numpy arrays of any of these -- becomes a
:class:`ClientRows`: for each segment ``s`` (a layer, or the whole vector) and client ``i`` a 1-D view
``rows[s][i]``. Nothing is copied; validation names the offending client, entry and value.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .flat import Layout, as_tensor, entries

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Per-element math and the mean's dtype: float64 for float64 data, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclasses.dataclass(frozen=True)
class Segments:
    """Lengths and offsets of the segments of a flat vector of ``numel`` elements."""

    lens: tuple
    offs: tuple

    @classmethod
    def of_lengths(cls, lens: Sequence[int]) -> "Segments":
        offs, off = [], 0
        for n in lens:
            offs.append(off)
            off += n
        return cls(tuple(lens), tuple(offs))

    @property
    def numel(self) -> int:
        return sum(self.lens)

    def __len__(self) -> int:
        return len(self.lens)

    def tables(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(lens, offs) as int64 tensors."""
        t = torch.tensor([self.lens, self.offs], dtype=torch.int64).to(device)
        return t[0], t[1]

    def slice(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat vector, one per segment."""
        return [flat[o : o + n] for o, n in zip(self.offs, self.lens)]


def _ptr_table(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


@dataclasses.dataclass
class ClientRows:
    """M client rows in L segments: ``rows[s][i]`` is client i's part of segment s (a 1-D view).

    ``base`` (full client models) holds the global model's part of each segment; deltas are then
    ``rows[s][i] - base[s]``, formed inside the kernels and never stored. ``matrix`` is the original
    ``[M, d]`` tensor when there is one (lets backends skip per-row work).
    """

    rows: list
    segments: Segments
    num_clients: int
    dtype: torch.dtype
    device: torch.device
    form: Layout
    base: list | None = None
    matrix: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.segments.numel

    def row_ptrs(self) -> torch.Tensor:
        """Addresses of every row segment, ``[s * M + i]``, as a CPU int64 tensor."""
        if self.matrix is not None:
            m = self.matrix
            step = m.stride(0) * m.element_size()
            return torch.arange(self.num_clients, dtype=torch.int64) * step + m.data_ptr()
        return _ptr_table([r for seg in self.rows for r in seg])

    def base_ptrs(self) -> torch.Tensor | None:
        return None if self.base is None else _ptr_table(self.base)

    def client(self, i: int) -> list:
        return [seg[i] for seg in self.rows]


@dataclasses.dataclass
class ParamRows:
    """The global model as L writable 1-D views (one per segment), plus its original form."""

    parts: list
    segments: Segments
    dtype: torch.dtype
    device: torch.device
    form: Layout
    original: Any

    def ptrs(self) -> torch.Tensor:
        return _ptr_table(self.parts)

    def flat_view(self) -> torch.Tensor | None:
        """The parameters as one 1-D tensor when they are one (no copy), else None."""
        return self.parts[0] if len(self.parts) == 1 else None


def _check_dtype(t: torch.Tensor, where: str) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        kind = "floating" if not t.is_floating_point() else "supported floating"
        raise TypeError(f"{where} has dtype {t.dtype}; expected a {kind} dtype (float16, bfloat16, float32, float64)")


def _flat_view(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` as a 1-D view; raises instead of copying when its elements are not contiguous."""
    if not t.is_contiguous():
        raise ValueError(
            f"{where} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
            "fastagg reads it in place and never copies: pass .contiguous()"
        )
    return t.reshape(-1)


def _client_parts(x: Any, name: str, i: int) -> list:
    """One client as a list of tensors (per-layer) or one flat tensor."""
    where = f"{name}[{i}]"
    if isinstance(x, (torch.Tensor, np.ndarray)):
        t = as_tensor(x)
        if t.ndim != 1:
            raise ValueError(f"{where} must be a 1-D (flat) vector, got shape {tuple(t.shape)}")
        _check_dtype(t, where)
        return [t]
    if isinstance(x, (Mapping, torch.nn.Module)) or (isinstance(x, Sequence) and not isinstance(x, (str, bytes))):
        parts = entries(x, where=where)
        for k, t in enumerate(parts):
            _check_dtype(t, f"{where}[{k}]")
        if not parts:
            raise ValueError(f"{where} has no floating entries")
        return parts
    raise TypeError(f"{where} is a {type(x).__name__}; expected a tensor, numpy array, list of them or state_dict")


def client_rows(x: Any, *, name: str) -> ClientRows:
    """Validate and normalize M clients' vectors (see module docstring) without copying them."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        m = as_tensor(x)
        if m.ndim != 2:
            raise ValueError(f"{name} must be a 2-D [num_clients, num_params] tensor or a list of clients, "
                             f"got shape {tuple(m.shape)}")
        if m.shape[0] == 0:
            raise ValueError(f"{name} is empty: need at least one client")
        _check_dtype(m, name)
        if m.shape[1] > 1 and m.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along the parameter dimension, got strides "
                             f"{m.stride()}; fastagg never copies inputs: pass .contiguous()")
        form = Layout("flat", (None,), ((m.shape[1],),), (m.dtype,), isinstance(x, np.ndarray))
        return ClientRows([list(m.unbind(0))], Segments.of_lengths([m.shape[1]]), m.shape[0], m.dtype,
                          m.device, form, matrix=m)
    if not isinstance(x, Sequence) or isinstance(x, (str, bytes)):
        raise TypeError(f"{name} is a {type(x).__name__}; expected a [M, d] tensor/array or a list of M clients")
    if len(x) == 0:
        raise ValueError(f"{name} is empty: need at least one client")
    clients = [_client_parts(c, name, i) for i, c in enumerate(x)]
    first = clients[0]
    ref_shapes = [tuple(t.shape) for t in first]
    per_layer = _is_listlike(x[0])
    for i, parts in enumerate(clients):
        if len(parts) != len(first):
            raise ValueError(f"{name}[{i}] has {len(parts)} entries; expected {len(first)} like {name}[0]")
        for k, t in enumerate(parts):
            where = f"{name}[{i}][{k}]" if per_layer else f"{name}[{i}]"
            if tuple(t.shape) != ref_shapes[k]:
                raise ValueError(f"{where} has shape {tuple(t.shape)}; expected {ref_shapes[k]} like {name}[0]")
            if t.dtype != first[0].dtype:
                raise TypeError(f"{where} has dtype {t.dtype}; expected {first[0].dtype} like {name}[0]")
            if t.device != first[0].device:
                raise ValueError(f"{where} is on {t.device}; expected {first[0].device} like {name}[0]")
    rows = [[_flat_view(c[k], f"{name}[{i}][{k}]" if per_layer else f"{name}[{i}]") for i, c in enumerate(clients)]
            for k in range(len(first))]
    numpy_in = isinstance(x[0], np.ndarray) or (per_layer and _any_numpy(x[0]))
    if per_layer:
        form = dataclasses.replace(Layout.of(x[0]), numpy=numpy_in)
    else:
        form = Layout("flat", (None,), (ref_shapes[0],), (first[0].dtype,), numpy_in)
    segs = Segments.of_lengths([r[0].numel() for r in rows])
    return ClientRows(rows, segs, len(clients), first[0].dtype, first[0].device, form)


def _is_listlike(x: Any) -> bool:
    return not isinstance(x, (torch.Tensor, np.ndarray))


def _any_numpy(x: Any) -> bool:
    vals = x.values() if isinstance(x, Mapping) else x
    return any(isinstance(v, np.ndarray) for v in vals) if not isinstance(x, torch.nn.Module) else False


def param_rows(params: Any, *, name: str = "params") -> ParamRows:
    """Validate the global model (flat tensor/array, per-layer list, state_dict or module) as writable views."""
    if isinstance(params, (torch.Tensor, np.ndarray)):
        t = as_tensor(params)
        if t.ndim != 1:
            raise ValueError(f"{name} must be a 1-D (flat) vector or a per-layer list, got shape {tuple(t.shape)}")
        if isinstance(params, np.ndarray) and not params.flags.writeable:
            raise ValueError(f"{name} is a read-only numpy array; it is updated in place")
        parts = [t]
    else:
        parts = entries(params, where=name)
        if not parts:
            raise ValueError(f"{name} has no floating entries")
    first = parts[0]
    for k, t in enumerate(parts):
        where = name if len(parts) == 1 and isinstance(params, (torch.Tensor, np.ndarray)) else f"{name}[{k}]"
        _check_dtype(t, where)
        if t.dtype != first.dtype:
            raise TypeError(f"{where} has dtype {t.dtype}; expected {first.dtype} like {name}[0]")
        if t.device != first.device:
            raise ValueError(f"{where} is on {t.device}; expected {first.device} like {name}[0]")
    flat = [_flat_view(t, name if len(parts) == 1 else f"{name}[{k}]") for k, t in enumerate(parts)]
    form = Layout.of(params)
    return ParamRows(flat, Segments.of_lengths([t.numel() for t in flat]), first.dtype, first.device, form, params)


def check_params_match(p: ParamRows, rows: ClientRows, *, name: str = "params", clients: str = "deltas") -> None:
    """params must have the clients' size and device."""
    if p.segments.numel != rows.numel:
        raise ValueError(f"{name} has {p.segments.numel} elements; expected {rows.numel} (the size of each of {clients})")
    if p.device != rows.device:
        raise ValueError(f"{name} is on {p.device}; expected {rows.device} like {clients}")


def with_base(rows: ClientRows, p: ParamRows) -> ClientRows:
    """Client models whose deltas are ``model - params``: attach params as the base, segment by segment.

    The two segmentations are reconciled without copies: a flat side is sliced at the other side's
    layer boundaries; two per-layer sides must have the same layer sizes.
    """
    check_params_match(p, rows, clients="models")
    if p.dtype != rows.dtype:
        raise TypeError(f"params has dtype {p.dtype}; expected {rows.dtype} like models (deltas are models - params)")
    if len(p.segments) > 1 and len(rows.segments) > 1 and p.segments.lens != rows.segments.lens:
        raise ValueError(f"params has layer sizes {list(p.segments.lens)}; expected {list(rows.segments.lens)} like models")
    if len(rows.segments) >= len(p.segments):
        base = rows.segments.slice(p.parts[0]) if len(p.segments) == 1 else list(p.parts)
        return dataclasses.replace(rows, base=base)
    segs = p.segments
    flat_rows = rows.rows[0]
    new_rows = [[r[o : o + n] for r in flat_rows] for o, n in zip(segs.offs, segs.lens)]
    return dataclasses.replace(rows, rows=new_rows, segments=segs, base=list(p.parts), matrix=None)
