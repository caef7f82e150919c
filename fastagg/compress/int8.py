"""int8 blockwise absmax: the format, the quantizer and the float64 dequantizer (the oracle).

Layout: a client's update ``x`` (the flat vector of d elements, in the order :func:`fastagg.flat.flatten` gives
the model's entries) is cut into blocks of ``block`` consecutive elements (the last one may be shorter). Block
``b`` stores one float32 scale ``s_b = max_{j in b} |x_j| / 127`` (``1.0`` for an all-zero block, so that every
scale is finite and > 0) and the int8 codes

    q_j = round(x_j / s_b)  in [-127, 127]      (round half to even; -128 is never written and is refused)

or, with ``stochastic=True``, ``q_j = floor(x_j / s_b + u_j)`` where ``u_j`` in [0, 1) is the first... fourth
32-bit word (``j mod 4``) of Philox4x32-10 with counter ``(j // 4 low, high 32 bits, round, client)`` and key
``seed`` (two 32-bit words), times 2^-32: unbiased (``E[s_b q_j] = x_j``), and the same codes for the same
(seed, round, client) on any machine.

and the update it stands for is ``x~_j = s_b * q_j`` (what every fold reads: sums and squared norms are those
of ``x~``). Exact: ``|x_j - x~_j| <= s_b / 2``; an all-zero block and the block's absmax elements are exact.
Bytes: d + 4 * ceil(d / block), against 4d for float32 (block 256: 3.94x smaller).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..flat import flatten

__all__ = ["Int8Blockwise", "quantize_int8", "dequantize"]

MAX_BLOCK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Int8Blockwise:
    """One client's update in int8 blockwise absmax form (module docstring): ``codes`` int8 ``[d]``, ``scales``
    float32 ``[ceil(d / block)]``, ``block`` elements per scale. Built checked: dtypes, shapes, device, block."""

    codes: torch.Tensor
    scales: torch.Tensor
    block: int

    def __post_init__(self):
        check_format(self, "the update")

    @property
    def numel(self) -> int:
        return self.codes.numel()

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the codes and the scales."""
        return self.codes.numel() + 4 * self.scales.numel()


def check_format(u: Any, name: str) -> None:
    """Shapes, dtypes, device and block of an :class:`Int8Blockwise` (values are checked by the fold)."""
    if isinstance(u.block, bool) or not isinstance(u.block, int) or not 1 <= u.block <= MAX_BLOCK:
        raise ValueError(f"{name}: block must be an integer in [1, {MAX_BLOCK}], got {u.block!r}")
    for field, t, dtype in (("codes", u.codes, torch.int8), ("scales", u.scales, torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {field} must be a torch tensor, got {type(t).__name__}")
        if t.dtype != dtype or t.dim() != 1:
            raise TypeError(f"{name}: {field} must be a 1-D {dtype} tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if u.scales.device != u.codes.device:
        raise ValueError(f"{name}: codes are on {u.codes.device} but scales on {u.scales.device}")
    blocks = math.ceil(u.codes.numel() / u.block)
    if u.scales.numel() != blocks:
        raise ValueError(f"{name}: {u.codes.numel()} codes in blocks of {u.block} need {blocks} scales, got "
                         f"{u.scales.numel()}")


def quantize_int8(update: Any, block: int = 256, *, stochastic: bool = False, seed: int = 0, round: int = 0,
                  client: int = 0) -> Int8Blockwise:
    """``update`` (a flat tensor, a list of tensors, a state_dict or a module's parameters: flattened as
    :func:`fastagg.flat.flatten` orders them) in int8 blockwise absmax form (module docstring): round half to
    even, or with ``stochastic=True`` unbiased stochastic rounding keyed by ``(seed, round, client)`` (integers in
    [0, 2^64), [0, 2^32), [0, 2^32)). A NaN or Inf in the update raises (it has no int8 code)."""
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"block must be an integer in [1, {MAX_BLOCK}], got {block!r}")
    for name, value, bits in (("seed", seed, 64), ("round", round, 32), ("client", client, 32)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** bits:
            raise ValueError(f"{name} must be an integer in [0, 2^{bits}), got {value!r}")
    x = update if isinstance(update, torch.Tensor) and update.dim() == 1 else flatten(update)[0]
    x = x.detach()
    if not x.is_floating_point():
        raise TypeError(f"the update must be floating point, got {x.dtype}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("the update holds NaN or Inf: it has no int8 code")
    d = x.numel()
    blocks = math.ceil(d / block)
    padded = torch.zeros(blocks * block, dtype=torch.float64, device=x.device)
    padded[:d] = x.to(torch.float64)
    tiles = padded.view(blocks, block)
    absmax = tiles.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax)).to(torch.float32)
    # codes from the float32 scale actually stored, so that s_b * q_j is the closest value the format can write
    scaled = tiles / scales.to(torch.float64)[:, None]
    if stochastic:
        u = _uniforms(blocks * block, seed=seed, round=round, client=client, device=x.device).view(blocks, block)
        q = torch.floor(scaled + u).clamp_(-127, 127)
    else:
        q = torch.round(scaled).clamp_(-127, 127)
    return Int8Blockwise(q.reshape(-1)[:d].to(torch.int8).contiguous(), scales.contiguous(), block)


def _uniforms(n: int, *, seed: int, round: int, client: int, device) -> torch.Tensor:
    """u_j in [0, 1), float64, j = 0 .. n-1 (module docstring)."""
    from ..backends.reference import philox4x32_10

    blocks = torch.arange((n + 3) // 4, dtype=torch.int64, device=device)
    zero = torch.zeros_like(blocks)
    words = philox4x32_10((blocks & 0xFFFFFFFF, blocks >> 32, zero + round, zero + client),
                          (seed & 0xFFFFFFFF, seed >> 32))
    return (torch.stack(words, dim=1).reshape(-1)[:n].to(torch.float64) * 2.0 ** -32)


def dequantize(u: Int8Blockwise, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``x~_j = s_b * q_j`` as a flat ``dtype`` tensor (float64 by default: the oracle every fold is tested
    against)."""
    check_format(u, "the update")
    s = u.scales.to(torch.float64).repeat_interleave(u.block)[:u.numel]
    return (s * u.codes.to(torch.float64)).to(dtype)
