"""Flat parameter buffers: per-layer tensors, numpy arrays, state_dicts and modules <-> one 1-D buffer.

fastagg's kernels see a model as one flat vector. :class:`Layout` records how a model's entries map into
that vector (names, shapes, dtypes, offsets) so that a flat result can be given back in the caller's form,
as views, without copies.

Which entries count (this changes FedExP's eta, since norms run over every counted entry):

* floating tensors and arrays count;
* integer and bool entries (``num_batches_tracked``) never count: they are skipped in state_dicts and
  rejected in plain lists;
* for an ``nn.Module``, its parameters count; its floating buffers (BatchNorm running statistics) count
  only with ``buffers=True``. A bare ``state_dict`` cannot tell parameters from buffers, so every floating
  entry of it counts: pass the module instead to leave buffers out.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["Layout", "flatten", "is_floating", "as_tensor"]


def as_tensor(x: Any) -> torch.Tensor:
    """A torch view of ``x``: tensors pass through, numpy arrays are wrapped without a copy."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if x.flags.writeable:
            return torch.from_numpy(x)
        with warnings.catch_warnings():  # torch warns on read-only arrays; fastagg never writes to them
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(x)
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def is_floating(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.is_floating_point()
    if isinstance(x, np.ndarray):
        return np.issubdtype(x.dtype, np.floating)
    return False


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a model's entries map into one flat vector.

    ``names[k]`` (``None`` for plain lists) has ``shapes[k]`` and ``dtypes[k]`` and occupies
    ``flat[offsets[k] : offsets[k] + numels[k]]``. ``kind`` is ``"flat"``, ``"list"`` or ``"dict"``.
    Two layouts are compatible when their :meth:`signature` is equal.
    """

    kind: str
    names: tuple
    shapes: tuple
    dtypes: tuple
    numpy: bool = False

    @property
    def numels(self) -> tuple:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def offsets(self) -> tuple:
        out, off = [], 0
        for n in self.numels:
            out.append(off)
            off += n
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def signature(self) -> tuple:
        """(name, shape, dtype) per entry; what checkpoints compare."""
        return tuple((n, tuple(s), str(d)) for n, s, d in zip(self.names, self.shapes, self.dtypes))

    def first_difference(self, other: "Layout") -> str | None:
        """A sentence naming the first entry where ``other`` differs, or None if compatible."""
        a, b = self.signature(), other.signature()
        for k, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"entry {k}: {x[0] or k} has shape {y[1]} dtype {y[2]}; expected {x[0] or k} shape {x[1]} dtype {x[2]}"
        if len(a) != len(b):
            return f"{len(b)} entries; expected {len(a)}"
        return None

    @classmethod
    def of(cls, obj: Any, *, buffers: bool = False) -> "Layout":
        """The layout of a flat tensor/array, a list of tensors/arrays, a state_dict or an nn.Module."""
        entries = _entries(obj, buffers=buffers, where="model")
        kind = "flat" if _is_flat(obj) else ("dict" if isinstance(obj, (Mapping, torch.nn.Module)) else "list")
        numpy = any(isinstance(v, np.ndarray) for _, v in entries)
        return cls(
            kind,
            tuple(n for n, _ in entries),
            tuple(tuple(v.shape) for _, v in entries),
            tuple(as_tensor(v).dtype for _, v in entries),
            numpy,
        )

    def unflatten(self, flat: torch.Tensor | np.ndarray) -> Any:
        """Views of ``flat`` in this layout's form: a flat vector, a list, or a dict of name -> view."""
        if self.kind == "flat":
            return flat
        views = [flat[o : o + n].reshape(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]
        if self.kind == "dict":
            return dict(zip(self.names, views))
        return views


def _is_flat(obj: Any) -> bool:
    return isinstance(obj, (torch.Tensor, np.ndarray))


def _entries(obj: Any, *, buffers: bool, where: str) -> list:
    """(name, tensor-or-array) for every counted entry of ``obj``; raises on what cannot count."""
    if _is_flat(obj):
        if obj.ndim != 1:
            raise ValueError(f"{where} must be 1-D when given as one tensor, got shape {tuple(obj.shape)}")
        return [(None, obj)]
    if isinstance(obj, torch.nn.Module):
        items = list(obj.named_parameters())
        if buffers:
            items += [(n, b) for n, b in obj.named_buffers() if b.is_floating_point()]
        return [(n, v.detach()) for n, v in items]
    if isinstance(obj, Mapping):
        return [(k, v) for k, v in obj.items() if is_floating(v)]
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        for k, v in enumerate(obj):
            if not _is_flat(v):
                raise TypeError(f"{where}[{k}] is a {type(v).__name__}; expected a torch.Tensor or numpy.ndarray")
            if not is_floating(v):
                raise TypeError(f"{where}[{k}] has dtype {v.dtype}; expected a floating dtype")
        return [(None, v) for v in obj]
    raise TypeError(
        f"{where} is a {type(obj).__name__}; expected a tensor, numpy array, list of them, state_dict or nn.Module"
    )


def entries(obj: Any, *, where: str, buffers: bool = False) -> list:
    """The counted entries of ``obj`` as torch tensors (numpy wrapped without copies)."""
    return [as_tensor(v) for _, v in _entries(obj, buffers=buffers, where=where)]


def flatten(obj: Any, *, buffers: bool = False, out: torch.Tensor | None = None, dtype: torch.dtype | None = None):
    """Copy a model's counted entries into one flat buffer: ``flat[offsets[k]:...] = entry_k.reshape(-1)``.

    Returns ``(flat, layout)``; ``layout.unflatten(flat)`` gives views in the original form. ``out`` reuses a
    buffer; ``dtype`` defaults to the first entry's. This is a copy: the ops take per-layer input directly
    and never need it.

    >>> flat, layout = flatten([torch.ones(2, 3), torch.zeros(4)])
    >>> flat.shape, [t.shape for t in layout.unflatten(flat)]
    (torch.Size([10]), [torch.Size([2, 3]), torch.Size([4])])
    """
    layout = Layout.of(obj, buffers=buffers)
    tensors = entries(obj, where="model", buffers=buffers)
    if not tensors:
        raise ValueError("model has no floating entries to flatten")
    dtype = dtype or tensors[0].dtype
    if out is None:
        out = torch.empty(layout.numel, dtype=dtype, device=tensors[0].device)
    elif out.shape != (layout.numel,):
        raise ValueError(f"out must have shape ({layout.numel},), got {tuple(out.shape)}")
    for t, o, n in zip(tensors, layout.offsets, layout.numels):
        out[o : o + n].copy_(t.reshape(-1))
    return out, layout
