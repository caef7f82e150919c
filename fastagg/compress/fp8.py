"""fp8 e4m3 blockwise scaled (the layout: :mod:`.blockwise`; torchft's convention, ``torch.float8_e4m3fn``).

Block ``b`` stores one float32 scale ``s_b = max_{j in b} |x_j| / 448`` (448 is e4m3's largest finite value;
``1.0`` for an all-zero block; a subnormal scale as :mod:`.int8` rounds it) and the codes ``q_j = e4m3(float32(x_j / s_b))``: the quotient clamped to [-448, 448], rounded to float32,
then to the nearest e4m3 number (ties to even; torch's conversion). The update it stands for is ``x~_j = s_b * float(q_j)``: 3 mantissa bits,
so ``|x_j - x~_j| <= 2^-4 |x_j|`` for ``|x_j / s_b| >= 2^-6`` (e4m3's normal range), ``<= 2^-10 s_b`` below it.
Rowwise scaling (one scale per row of a ``[r, c]`` layer, torchft's choice) is ``block = c`` over that layer.
The two NaN codes (0x7F, 0xFF) are never written and are refused. Bytes: d + 4 * ceil(d / block). A NaN or Inf, or
a block whose scale times 448 lies beyond float32, raises.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from .blockwise import (Blockwise, as_rows, check_block, check_representable, float32_scales, quantizer,
                        raise_nonfinite, tiles)

__all__ = ["Fp8Blockwise", "quantize_fp8", "quantize_fp8_rows", "E4M3_MAX"]

E4M3_MAX = 448.0


@functools.lru_cache(maxsize=None)
def e4m3_table(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """The value of every e4m3 byte (float32 ``[256]``, NaN at 0x7F and 0xFF)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).to(device)


@dataclasses.dataclass(frozen=True)
class Fp8Blockwise(Blockwise):
    """One client's update in fp8 e4m3 blockwise form (module docstring): ``codes`` ``torch.float8_e4m3fn``
    ``[d]``, ``scales`` float32 ``[ceil(d / block)]``."""

    CODE_DTYPE = torch.float8_e4m3fn
    FORMAT = "fp8"
    INVALID_CODES = "holds a NaN code (0x7F or 0xFF; fp8 e4m3 codes are finite)"

    def table(self) -> torch.Tensor:
        return e4m3_table(self.device)

    def code_bytes(self) -> torch.Tensor:
        return self.codes.view(torch.uint8)


def quantize_fp8(update: Any, block: int = 256) -> Fp8Blockwise:
    """``update`` (a flat tensor, a list of tensors, a state_dict or a module's parameters) in fp8 e4m3 blockwise
    form (module docstring). A NaN or Inf in the update raises."""
    if isinstance(update, torch.Tensor) and update.dim() == 2:
        raise ValueError("quantize_fp8 takes one update; quantize_fp8_rows takes an [M, d] batch")
    return quantize_fp8_rows(as_rows(update, finite=False), block)[0]


def quantize_fp8_rows(rows: torch.Tensor, block: int = 256, *, backend: str = "auto") -> list:
    """Each row of an ``[M, d]`` batch quantized as :func:`quantize_fp8`, in one pass: fused in C++ for CPU
    float32/float64 rows (csrc/quantized.h) and in Triton for CUDA rows (fastagg/backends/triton/quantize.py), the
    same codes and scales bit for bit; the torch ops of the definition elsewhere (``backend="reference"``)."""
    block = check_block(block)
    x = as_rows(rows, "the updates", finite=False)
    kernel = quantizer(backend, x, "quantize_fp8_rows")
    if kernel is not None:
        x = x.contiguous()
        m, d = x.shape
        codes = torch.empty(m, d, dtype=torch.uint8, device=x.device)
        scales = torch.empty(m, -(-d // block), dtype=torch.float32, device=x.device)
        if kernel(x=x, block=block, codes_out=codes, scales_out=scales):
            raise_nonfinite("the updates")
        check_representable(scales, E4M3_MAX, "the updates")
        codes = codes.view(torch.float8_e4m3fn)
        return [Fp8Blockwise(codes[i], scales[i], block) for i in range(m)]
    as_rows(x, "the updates")
    return _torch_rows(x, block)


def _torch_rows(x: torch.Tensor, block: int) -> list:
    """The definition in torch ops (any device): float64 tiles, absmax, the float32 scale, then the codes."""
    m, d = x.shape
    t = tiles(x, block)
    scales = float32_scales(t.abs().amax(dim=2), E4M3_MAX)
    check_representable(scales, E4M3_MAX, "the updates")
    scaled = (t / scales.to(torch.float64)[:, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    codes = scaled.to(torch.float32).to(torch.float8_e4m3fn).reshape(m, -1)[:, :d]
    return [Fp8Blockwise(codes[i].contiguous(), scales[i].contiguous(), block) for i in range(m)]
