"""One-byte codes read through a 256-entry code book, one absmax per block (the layout: :mod:`.blockwise`), and
updates made of one compressed part per layer.

:class:`Codebook8` is bitsandbytes' ``quantize_blockwise`` form, which NVIDIA FLARE's ``ModelQuantizer`` sends as
``BLOCKWISE8``: per block of ``block`` elements (FLARE: bitsandbytes' default 4096, per parameter tensor) one
float32 ``absmax`` and uint8 codes indexing ``code`` (256 float32 values in [-1, 1]: bitsandbytes' signed dynamic
map), standing for ``x~_j = absmax_b * code[q_j]``. Exact as that formula (the fold reads exactly what
bitsandbytes' ``dequantize_blockwise`` computes, up to float rounding of the product).

:class:`LayerwiseUpdate` holds one compressed part per layer, in the flat order of the model's parameters: FLARE
quantizes each parameter tensor on its own (blocks restart at every tensor), so a model's update is a list of
per-layer parts. Folds sweep layer by layer (all clients of a call at once per layer): the same traffic as one
flat sweep.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from .blockwise import Blockwise
from .sparse import SparseUpdate

__all__ = ["Codebook8", "LayerwiseUpdate"]

LAYER_FORMATS = (Blockwise, SparseUpdate)  # what one layer of a LayerwiseUpdate may be


@dataclasses.dataclass(frozen=True)
class Codebook8(Blockwise):
    """``codes`` uint8 ``[d]``, ``scales`` float32 ``[ceil(d / block)]`` (bitsandbytes' ``absmax``), ``code``
    float32 ``[256]`` (module docstring)."""

    code: torch.Tensor = None

    CODE_DTYPE = torch.uint8
    FORMAT = "codebook8"
    INVALID_CODES = "holds a code whose code-book value is NaN"

    def __post_init__(self):
        super().__post_init__()
        c = self.code
        if not isinstance(c, torch.Tensor) or c.dtype != torch.float32 or c.shape != (256,):
            raise TypeError(f"the update: code must be a float32 tensor of 256 values, got "
                            f"{getattr(c, 'dtype', type(c).__name__)} of shape {tuple(getattr(c, 'shape', ()))}")
        if c.device != self.codes.device:
            raise ValueError(f"the update: code is on {c.device} but codes on {self.codes.device}")

    @property
    def nbytes(self) -> int:
        return super().nbytes + 4 * 256

    def table(self) -> torch.Tensor:
        return self.code


@dataclasses.dataclass(frozen=True)
class LayerwiseUpdate:
    """One compressed part per layer (``parts``: blockwise or sparse updates), their sizes adding up to the model's
    parameter count, in its flat order."""

    parts: tuple

    FORMAT = "layerwise"

    def __post_init__(self):
        if not isinstance(self.parts, (tuple, list)) or not self.parts:
            raise TypeError("a LayerwiseUpdate holds a non-empty tuple of compressed parts, one per layer")
        for i, p in enumerate(self.parts):
            if not isinstance(p, LAYER_FORMATS):
                raise TypeError(f"the update: part {i} is a {type(p).__name__}; expected a compressed update")
        object.__setattr__(self, "parts", tuple(self.parts))
        devices = {p.device for p in self.parts}
        if len(devices) > 1:
            raise ValueError(f"the update's parts are on several devices: {sorted(map(str, devices))}")

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def sizes(self) -> tuple:
        return tuple(p.numel for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])


def flat_tensor(x: Any) -> torch.Tensor:
    """A numpy array (or array-like) or a tensor as a flat contiguous tensor, without a copy where it already is
    one (numpy memory shared)."""
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(-1)
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x)).reshape(-1))


def from_bitsandbytes(codes: Any, absmax: Any, code: Any, block: int = 4096) -> Codebook8:
    """A :class:`Codebook8` of bitsandbytes' ``quantize_blockwise`` output (numpy arrays or tensors, any shape for
    the codes: flattened as the tensor is)."""
    return Codebook8(flat_tensor(codes), flat_tensor(absmax), block, code=flat_tensor(code))
