"""Client rows quantized blockwise on the GPU (the definitions: fastagg/compress/int8.py and fp8.py, whose C++ twins
are in csrc/quantized.h): one program per (row, block) reads the block twice, first for its absmax (float64) and a
count of NaN/Inf, then for the codes. int8: ``q = round_half_even(x / s)`` or, stochastic, ``floor(x / s + u_j)``
with ``u_j`` the ``(j mod 4)``-th word of Triton's Philox4x32-10 (counter ``(j // 4 low, high, round, client)``, key
``seed``: the same words as the C++ and reference backends, tested), times 2^-32. fp8: ``clamp(x / s, +-448)`` to
float32, then to e4m3 by integer steps (round to nearest even, c10's rule; no hardware conversion, so the
interpreter and every card give the same bytes). Every step in float64, so the codes and scales equal the
definition's bit for bit. A power-of-two block up to 1024 is tiled: 4096 / block whole blocks of a row per program,
read once (``_tile_scales``); any other block takes one program per block, read twice."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.random import philox

_TWO_M32 = tl.constexpr(2.3283064365386963e-10)  # 2^-32 (a constexpr: triton rejects plain globals in kernels)
_ROUNDER = tl.constexpr(6755399441055744.0)  # 1.5 * 2^52: (q + it) - it rounds q half to even for |q| < 2^51


@triton.jit
def _program_block(d, nb, block):
    """This program's (index, row, first column, end column): one program per (row, block), row-major."""
    pid = tl.program_id(0).to(tl.int64)
    lo = (pid % nb) * block
    return pid, pid // nb, lo, tl.minimum(d, lo + block)


@triton.jit
def _scale_of(top, top_code):
    """float32(top / top_code) (1 for a zero block); a subnormal scale that rounded down (to 0 for the tiniest
    blocks) one float32 step up, as fastagg.compress.blockwise.float32_scales (the step added in float64: exact)."""
    s = tl.where(top > 0.0, (top / top_code).to(tl.float32), 1.0)
    low = (s < 1.1754943508222875e-38) & (s.to(tl.float64) * top_code < top)
    return tl.where(low, (s.to(tl.float64) + 1.401298464324817e-45).to(tl.float32), s)


@triton.jit
def _block_scale(row, lo, hi, scales, nonfinite, pid, top_code, TILE: tl.constexpr):
    """The block's float32 scale ``absmax / top_code`` (float64 quotient; 1 for a zero block), stored, and its count
    of NaN/Inf; returns the scale in float64."""
    amax = tl.zeros([TILE], dtype=tl.float64)
    bad = tl.zeros([TILE], dtype=tl.int32)
    for start in range(lo, hi, TILE):
        cols = start + tl.arange(0, TILE).to(tl.int64)
        a = tl.abs(tl.load(row + cols, mask=cols < hi, other=0.0).to(tl.float64))
        bad += (a - a != 0.0).to(tl.int32)  # NaN for NaN and Inf
        amax = tl.maximum(amax, tl.where(a == a, a, 0.0))
    top = tl.max(amax, axis=0)
    s = _scale_of(top, top_code)
    tl.store(scales + pid, s)
    tl.store(nonfinite + pid, tl.sum(bad, axis=0))
    return s.to(tl.float64)


@triton.jit
def _tile_scales(x, d, nb, scales, nonfinite, top_code, G: tl.constexpr, BLOCK_C: tl.constexpr):
    """G whole blocks of one row per program (BLOCK_C, the block, a power of two): the tile ``[G, BLOCK_C]`` read
    once, each block's scale and NaN/Inf count stored as ``_block_scale`` does; returns (row, columns, in-bounds
    mask, the values / their block's scale in float64)."""
    pid = tl.program_id(0).to(tl.int64)
    per_row = (nb + G - 1) // G
    i = pid // per_row
    b = (pid % per_row) * G + tl.arange(0, G).to(tl.int64)
    cols = b[:, None] * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)[None, :]
    inside = (b < nb)[:, None] & (cols < d)
    v = tl.load(x + i * d + cols, mask=inside, other=0.0).to(tl.float64)
    a = tl.abs(v)
    top = tl.max(tl.where(a == a, a, 0.0), axis=1)
    s = _scale_of(top, top_code)
    tl.store(scales + i * nb + b, s, mask=b < nb)
    tl.store(nonfinite + i * nb + b, tl.sum((a - a != 0.0).to(tl.int32), axis=1), mask=b < nb)
    return i, cols, inside, v / s.to(tl.float64)[:, None]


@triton.jit
def _int8_codes(q, cols, seed, rnd, client, STOCHASTIC: tl.constexpr):
    """int8 codes of ``q = x / s`` (float64) at row columns ``cols``."""
    if STOCHASTIC:
        blk = cols >> 2
        lane = cols & 3
        c0 = (blk & 0xFFFFFFFF).to(tl.uint32)
        c1 = (blk >> 32).to(tl.uint32)
        c2 = (blk * 0 + rnd).to(tl.uint32)
        c3 = (blk * 0).to(tl.uint32) + client
        w0, w1, w2, w3 = philox(seed, c0, c1, c2, c3, 10)
        w = tl.where(lane == 0, w0, tl.where(lane == 1, w1, tl.where(lane == 2, w2, w3)))
        q = tl.floor(q + w.to(tl.float64) * _TWO_M32)
    else:
        q = (q + _ROUNDER) - _ROUNDER
    return tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)


@triton.jit
def _e4m3_codes(q):
    """e4m3 bytes of ``clamp(q, +-448)`` (``q = x / s`` in float64) rounded to float32."""
    v = tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float32)
    every = v.to(tl.uint32, bitcast=True)
    sign = every & 0x80000000
    bits = every ^ sign
    # below 2^-6: the float adder rounds (|v| + 2^14) to the subnormal step 2^-9, half to even
    sub = (bits.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)
    normal = (bits + 0xC407FFFF + ((bits >> 20) & 1)) >> 20  # rebias 127 -> 7, 3 mantissa bits, half to even
    code = tl.where(bits < (121 << 23), sub, normal)
    code = tl.where(bits >= (1087 << 20), 0x7F, code)
    return ((code | (sign >> 24)) & 0xFF).to(tl.uint8)


@triton.jit
def _quantize_int8_kernel(x, codes, scales, nonfinite, clients, d, nb, block, seed, rnd,
                          STOCHASTIC: tl.constexpr, TILE: tl.constexpr, G: tl.constexpr, BLOCK_C: tl.constexpr):
    if BLOCK_C > 0:  # G blocks a program, read once
        i, cols, inside, q = _tile_scales(x, d, nb, scales, nonfinite, 127.0, G, BLOCK_C)
        client = tl.load(clients + i).to(tl.uint32)
        tl.store(codes + i * d + cols, _int8_codes(q, cols, seed, rnd, client, STOCHASTIC), mask=inside)
    else:  # one block a program, read twice (its absmax, then its codes)
        pid, i, lo, hi = _program_block(d, nb, block)
        row = x + i * d
        sd = _block_scale(row, lo, hi, scales, nonfinite, pid, 127.0, TILE)
        client = tl.load(clients + i).to(tl.uint32)
        for start in range(lo, hi, TILE):
            cols = start + tl.arange(0, TILE).to(tl.int64)
            inside = cols < hi
            q = tl.load(row + cols, mask=inside, other=0.0).to(tl.float64) / sd
            tl.store(codes + i * d + cols, _int8_codes(q, cols, seed, rnd, client, STOCHASTIC), mask=inside)


@triton.jit
def _quantize_fp8_kernel(x, codes, scales, nonfinite, d, nb, block, TILE: tl.constexpr, G: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    if BLOCK_C > 0:
        i, cols, inside, q = _tile_scales(x, d, nb, scales, nonfinite, 448.0, G, BLOCK_C)
        tl.store(codes + i * d + cols, _e4m3_codes(q), mask=inside)
    else:
        pid, i, lo, hi = _program_block(d, nb, block)
        row = x + i * d
        sd = _block_scale(row, lo, hi, scales, nonfinite, pid, 448.0, TILE)
        for start in range(lo, hi, TILE):
            cols = start + tl.arange(0, TILE).to(tl.int64)
            inside = cols < hi
            q = tl.load(row + cols, mask=inside, other=0.0).to(tl.float64) / sd
            tl.store(codes + i * d + cols, _e4m3_codes(q), mask=inside)


_TILE_ELEMENTS = 4096  # a program's share when blocks are tiled (G = 4096 / block blocks of a power-of-two block)
_MAX_TILED_BLOCK = 1024  # an H200: block 256 tiled 1.38 -> 0.78 ms (fp8, 4 x 5e7), block 4096 tiled 0.62 -> 0.86 ms


def _launch(m: int, d: int, block: int) -> tuple:
    """(grid, constexprs): G whole blocks a program for a power-of-two block up to 1024, else one block a program
    (its loop of 1024-column pieces read twice: faster for long blocks on the card)."""
    nb = triton.cdiv(d, block)
    if block & (block - 1) == 0 and block <= _MAX_TILED_BLOCK:
        g = min(_TILE_ELEMENTS // block, triton.next_power_of_2(nb))
        return (m * triton.cdiv(nb, g),), dict(TILE=1, G=g, BLOCK_C=block, num_warps=8 if g * block >= 2048 else 4)
    return (m * nb,), dict(TILE=min(1024, triton.next_power_of_2(block)), G=1, BLOCK_C=0)


def quantize_fp8_rows(*, x: torch.Tensor, block: int, codes_out: torch.Tensor, scales_out: torch.Tensor) -> int:
    """``x`` [M, d] (contiguous, any float dtype) into ``codes_out`` (e4m3 bytes, uint8 [M, d]) and ``scales_out``
    float32 [M, ceil(d / block)]; returns the number of blocks holding a NaN or Inf."""
    m, d = x.shape
    nb = triton.cdiv(d, block)
    if m * nb == 0:
        return 0
    bad = torch.zeros(m * nb, dtype=torch.int32, device=x.device)
    grid, cfg = _launch(m, d, block)
    _quantize_fp8_kernel[grid](x, codes_out, scales_out, bad, d, nb, block, **cfg)
    return int(bad.sum())


def quantize_int8_rows(*, x: torch.Tensor, block: int, stochastic: bool, seed: int, round: int, clients: list,
                       codes_out: torch.Tensor, scales_out: torch.Tensor) -> int:
    """``x`` [M, d] (contiguous, any float dtype) into ``codes_out`` int8 [M, d] and ``scales_out`` float32
    [M, ceil(d / block)]; returns the number of blocks holding a NaN or Inf (their codes are meaningless)."""
    m, d = x.shape
    nb = triton.cdiv(d, block)
    if m * nb == 0:
        return 0
    bad = torch.zeros(m * nb, dtype=torch.int32, device=x.device)
    ids = torch.tensor(clients, dtype=torch.int64, device=x.device)
    grid, cfg = _launch(m, d, block)
    _quantize_int8_kernel[grid](x, codes_out, scales_out, bad, ids, d, nb, block, int(seed), int(round),
                                STOCHASTIC=bool(stochastic), **cfg)
    return int(bad.sum())
