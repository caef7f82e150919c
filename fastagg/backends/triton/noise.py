"""Counter-based Gaussian noise on the GPU (the definition: csrc/noise.h): Triton's own Philox4x32-10 (the same
words as the C++ and reference backends, tested), then Box-Muller with the device's float32 log / sin / cos.

Each element computes the Philox block of its own coordinate (``j // 4``) and takes its lane: four times the
integer work of sharing a block between four lanes, in exchange for any alignment of a segment's offset.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.random import philox

_TWO_M32 = tl.constexpr(2.3283064365386963e-10)  # 2^-32 (a constexpr: triton rejects plain globals in kernels)
_TWO_M33 = tl.constexpr(1.1641532182693481e-10)  # 2^-33


@triton.jit
def normal_at(coords, seed, round_lo, round_hi):
    """N(0, 1) float32 noise of the int64 flat coordinates ``coords`` in round ``round_hi * 2^32 + round_lo``."""
    blk = coords >> 2
    lane = coords & 3
    c0 = (blk & 0xFFFFFFFF).to(tl.uint32)
    c1 = (blk >> 32).to(tl.uint32)
    c2 = (blk * 0 + round_lo).to(tl.uint32)
    c3 = (blk * 0 + round_hi).to(tl.uint32)
    x0, x1, x2, x3 = philox(seed, c0, c1, c2, c3, 10)
    upper = lane >= 2
    a = tl.where(upper, x2, x0)
    b = tl.where(upper, x3, x1)
    u1 = a.to(tl.float32) * _TWO_M32 + _TWO_M33
    u2 = b.to(tl.float32) * _TWO_M32
    r = tl.sqrt(-2.0 * tl.log(u1))
    theta = 6.283185307179586 * u2
    return tl.where((lane & 1) == 1, r * tl.sin(theta), r * tl.cos(theta))


@triton.jit
def _gaussian_kernel(out, n, first, seed, round_lo, round_hi, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    tl.store(out + j, normal_at(first + j, seed, round_lo, round_hi), mask=j < n)


def gaussian_noise(*, out: torch.Tensor, seed: int, round: int, first: int = 0) -> None:
    n = out.numel()
    if n:
        block = 1024
        _gaussian_kernel[(triton.cdiv(n, block),)](out, n, int(first), int(seed), int(round) & 0xFFFFFFFF,
                                                   int(round) >> 32, BLOCK=block)
