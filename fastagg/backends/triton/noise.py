"""Counter-based Gaussian noise on the GPU (the definition: csrc/noise.h): Triton's own Philox4x32-10 (the same
words as the C++ and reference backends, tested), then Box-Muller in float32: the device's log and sqrt, and the
cosine and sine of 2 pi u2 from one exact quadrant reduction and Cephes' polynomials (csrc/noise.cpp's sincos_2pi).

Coordinate j takes lane ``j mod 4`` of the Philox block ``j // 4``, whose four words give two Box-Muller pairs
(x0, x1) -> (n0, n1) and (x2, x3) -> (n2, n3). ``normal_block`` computes a run of coordinates starting at a
multiple of 4 as a [BLOCK/4, 4] tile: one Philox call per four coordinates and one log, sqrt and cosine-sine
reduction per pair, the four lanes interleaved back in place (``tl.join`` / ``tl.reshape``). A run starting elsewhere (a segment
offset not a multiple of 4) falls back to ``normal_at``, where each element computes its own block's Philox call
and its pair's transform: four times the Philox work and twice the transcendental work, for any alignment.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.random import philox

_TWO_M32 = tl.constexpr(2.3283064365386963e-10)  # 2^-32 (a constexpr: triton rejects plain globals in kernels)
_TWO_M33 = tl.constexpr(1.1641532182693481e-10)  # 2^-33


@triton.jit
def _philox_words(blk, seed, round_lo, round_hi):
    """The four Philox4x32-10 words of the int64 block indices ``blk`` (counter (blk, round), key seed)."""
    c0 = (blk & 0xFFFFFFFF).to(tl.uint32)
    c1 = (blk >> 32).to(tl.uint32)
    c2 = (blk * 0 + round_lo).to(tl.uint32)
    c3 = (blk * 0 + round_hi).to(tl.uint32)
    return philox(seed, c0, c1, c2, c3, 10)


@triton.jit
def _sincos_2pi(u):
    """(cos(2 pi u), sin(2 pi u)) for float32 u in [0, 1], as csrc/noise.cpp's sincos_2pi: u = k/4 + t with t in
    [-1/8, 1/8] (exact), x = 2 pi t in [-pi/4, pi/4], Cephes' sinf / cosf polynomials there, then k quarter turns.
    One exact reduction for both (libdevice's sinf and cosf each reduce their argument, with a slow path for large
    ones that this range never takes)."""
    k = (u * 4.0 + 0.5).to(tl.int32)  # the nearest quadrant (u >= 0)
    x = (u - k.to(tl.float32) * 0.25) * 6.283185307179586
    z = x * x
    sp = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * x + x
    cp = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z - 0.5 * z + 1.0
    odd = (k & 1) != 0  # odd k swaps cos and sin; cos changes sign for k = 1, 2, sin for k = 2, 3
    c = tl.where(odd, sp, cp)
    s = tl.where(odd, cp, sp)
    return tl.where(((k + 1) & 2) != 0, -c, c), tl.where((k & 2) != 0, -s, s)


@triton.jit
def _box_muller(a, b):
    """(r cos(2 pi u2), r sin(2 pi u2)) with r = sqrt(-2 ln u1), u1 = a 2^-32 + 2^-33, u2 = b 2^-32 (float32)."""
    u1 = a.to(tl.float32) * _TWO_M32 + _TWO_M33
    u2 = b.to(tl.float32) * _TWO_M32
    r = tl.sqrt(-2.0 * tl.log(u1))
    c, s = _sincos_2pi(u2)
    return r * c, r * s


@triton.jit
def normal_at(coords, seed, round_lo, round_hi):
    """N(0, 1) float32 noise of the int64 flat coordinates ``coords`` in round ``round_hi * 2^32 + round_lo``, one
    Philox call and one Box-Muller pair per element (any coordinates)."""
    lane = coords & 3
    x0, x1, x2, x3 = _philox_words(coords >> 2, seed, round_lo, round_hi)
    upper = lane >= 2
    n_cos, n_sin = _box_muller(tl.where(upper, x2, x0), tl.where(upper, x3, x1))
    return tl.where((lane & 1) == 1, n_sin, n_cos)


@triton.jit
def _normal_aligned(first, seed, round_lo, round_hi, BLOCK: tl.constexpr):
    """The noise of coordinates ``first .. first + BLOCK - 1`` for ``first`` a multiple of 4 (not checked): a
    [BLOCK/4] Philox tile, Box-Muller on both of its pairs, the four lanes interleaved to [BLOCK]."""
    blk = (first >> 2) + tl.arange(0, BLOCK // 4).to(tl.int64)
    x0, x1, x2, x3 = _philox_words(blk, seed, round_lo, round_hi)
    n0, n1 = _box_muller(x0, x1)
    n2, n3 = _box_muller(x2, x3)
    # [k, p, q] = (n0, n1 | n2, n3)[2p + q] -> coordinate 4k + 2p + q
    return tl.reshape(tl.join(tl.join(n0, n2), tl.join(n1, n3)), [BLOCK])


@triton.jit
def normal_block(first, seed, round_lo, round_hi, BLOCK: tl.constexpr, FIRST_MULT: tl.constexpr):
    """N(0, 1) float32 noise of the BLOCK coordinates ``first, first + 1, ...`` (``first`` an int64 scalar) in
    round ``round_hi * 2^32 + round_lo``. FIRST_MULT: a known divisor of ``first`` (a multiple of 4 compiles the
    shared path alone; otherwise the path is chosen at run time)."""
    if FIRST_MULT % 4 == 0:
        z = _normal_aligned(first, seed, round_lo, round_hi, BLOCK)
    else:
        if (first & 3) == 0:
            z = _normal_aligned(first, seed, round_lo, round_hi, BLOCK)
        else:
            z = normal_at(first + tl.arange(0, BLOCK).to(tl.int64), seed, round_lo, round_hi)
    return z


@triton.jit
def _gaussian_kernel(out, n, first, seed, round_lo, round_hi, BLOCK: tl.constexpr, PAIRED: tl.constexpr):
    """out[j - head] = noise of coordinate ``first - head + j`` (``head = first mod 4``: every program's run starts
    at a multiple of 4) for j in [head, head + n). PAIRED=False: the per-element ``normal_at`` (for comparison)."""
    head = first & 3
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    start = first - head + tl.program_id(0).to(tl.int64) * BLOCK
    if PAIRED:
        z = _normal_aligned(start, seed, round_lo, round_hi, BLOCK)
    else:
        z = normal_at(start + tl.arange(0, BLOCK).to(tl.int64), seed, round_lo, round_hi)
    tl.store(out + (j - head), z, mask=(j >= head) & (j < head + n))


def gaussian_noise(*, out: torch.Tensor, seed: int, round: int, first: int = 0, _paired: bool = True) -> None:
    """``out`` (float32, contiguous) = the N(0, 1) noise of flat coordinates ``first .. first + numel - 1``.
    ``_paired=False``: the per-element path (a benchmark's comparison; the same values)."""
    n = out.numel()
    if n:
        block = 1024
        _gaussian_kernel[(triton.cdiv(n + (int(first) & 3), block),)](
            out, n, int(first), int(seed), int(round) & 0xFFFFFFFF, int(round) >> 32, BLOCK=block, PAIRED=_paired)
