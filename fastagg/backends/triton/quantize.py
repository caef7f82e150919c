"""Client rows quantized blockwise on the GPU (the definitions: fastagg/compress/int8.py and fp8.py, whose C++ twins
are in csrc/quantized.h): one program per (row, block) reads the block twice, first for its absmax (float64) and a
count of NaN/Inf, then for the codes. int8: ``q = round_half_even(x / s)`` or, stochastic, ``floor(x / s + u_j)``
with ``u_j`` the ``(j mod 4)``-th word of Triton's Philox4x32-10 (counter ``(j // 4 low, high, round, client)``, key
``seed``: the same words as the C++ and reference backends, tested), times 2^-32. fp8: ``clamp(x / s, +-448)`` to
float32, then to e4m3 by integer steps (round to nearest even, c10's rule; no hardware conversion, so the
interpreter and every card give the same bytes). Every step in float64, so the codes and scales equal the
definition's bit for bit."""
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
    s = tl.where(top > 0.0, (top / top_code).to(tl.float32), 1.0)
    tl.store(scales + pid, s)
    tl.store(nonfinite + pid, tl.sum(bad, axis=0))
    return s.to(tl.float64)


@triton.jit
def _quantize_int8_kernel(x, codes, scales, nonfinite, clients, d, nb, block, seed, rnd,
                          STOCHASTIC: tl.constexpr, TILE: tl.constexpr):
    pid, i, lo, hi = _program_block(d, nb, block)
    row = x + i * d
    sd = _block_scale(row, lo, hi, scales, nonfinite, pid, 127.0, TILE)
    client = tl.load(clients + i).to(tl.uint32)
    for start in range(lo, hi, TILE):
        cols = start + tl.arange(0, TILE).to(tl.int64)
        inside = cols < hi
        q = tl.load(row + cols, mask=inside, other=0.0).to(tl.float64) / sd
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
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(codes + i * d + cols, q.to(tl.int8), mask=inside)


@triton.jit
def _quantize_fp8_kernel(x, codes, scales, nonfinite, d, nb, block, TILE: tl.constexpr):
    pid, i, lo, hi = _program_block(d, nb, block)
    row = x + i * d
    sd = _block_scale(row, lo, hi, scales, nonfinite, pid, 448.0, TILE)
    for start in range(lo, hi, TILE):
        cols = start + tl.arange(0, TILE).to(tl.int64)
        inside = cols < hi
        q = tl.load(row + cols, mask=inside, other=0.0).to(tl.float64) / sd
        v = tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float32)
        every = v.to(tl.uint32, bitcast=True)
        sign = every & 0x80000000
        bits = every ^ sign
        # below 2^-6: the float adder rounds (|v| + 2^14) to the subnormal step 2^-9, half to even
        sub = (bits.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)
        normal = (bits + 0xC407FFFF + ((bits >> 20) & 1)) >> 20  # rebias 127 -> 7, 3 mantissa bits, half to even
        code = tl.where(bits < (121 << 23), sub, normal)
        code = tl.where(bits >= (1087 << 20), 0x7F, code)
        tl.store(codes + i * d + cols, ((code | (sign >> 24)) & 0xFF).to(tl.uint8), mask=inside)


def quantize_fp8_rows(*, x: torch.Tensor, block: int, codes_out: torch.Tensor, scales_out: torch.Tensor) -> int:
    """``x`` [M, d] (contiguous, any float dtype) into ``codes_out`` (e4m3 bytes, uint8 [M, d]) and ``scales_out``
    float32 [M, ceil(d / block)]; returns the number of blocks holding a NaN or Inf."""
    m, d = x.shape
    nb = triton.cdiv(d, block)
    if m * nb == 0:
        return 0
    bad = torch.zeros(m * nb, dtype=torch.int32, device=x.device)
    _quantize_fp8_kernel[(m * nb,)](x, codes_out, scales_out, bad, d, nb, block,
                                    TILE=min(1024, triton.next_power_of_2(block)))
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
    tile = min(1024, triton.next_power_of_2(block))
    _quantize_int8_kernel[(m * nb,)](x, codes_out, scales_out, bad, ids, d, nb, block, int(seed), int(round),
                                     STOCHASTIC=bool(stochastic), TILE=tile)
    return int(bad.sum())
