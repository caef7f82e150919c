"""Compressed clients folded into a sum on the GPU (the definitions: csrc/quantized.h).

Blockwise (int8, or one-byte codes read through a 256-entry table): one program per tile of columns adds every
client's ``(coef_i * s_ib) * v(q_ij)`` in client order (the C++ backend's arithmetic), writes the sum once, and
leaves per-program partials (squared norms, an invalid-code flag, the sum's squares) that are added in program
order on the device. Sparse: one launch per client (its indices are strictly increasing, so no two programs of a
launch touch one element), in client order."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import address_table, addresses_aligned

_TILE = 4096  # columns per program (int8 codes: 16 bytes a thread at 8 warps)
_WARPS = 8
_SPARSE_TILE = 1024


@triton.jit
def _blockwise_fold_kernel(code_ptrs, scale_ptrs, table, coef, init, out, part_sq, part_bad, part_msq, M, d, block,
                           HAS_INIT: tl.constexpr, TABLED: tl.constexpr, ALIGNED: tl.constexpr,
                           BLOCK_C: tl.constexpr, TILE: tl.constexpr):
    """BLOCK_C > 0: the block size, a power of two dividing TILE: one scale load per block and client, and int8
    squares summed per block in int32 (exact) before one float64 product by the block's squared scale (as the C++
    fold does); BLOCK_C == 0: any block, one scale gathered per element, float64 squares per element."""
    pid = tl.program_id(0)
    cols = pid.to(tl.int64) * TILE + tl.arange(0, TILE).to(tl.int64)
    mask = cols < d
    if HAS_INIT:
        acc = tl.load(init + cols, mask=mask, other=0.0)
    else:
        acc = tl.zeros([TILE], dtype=out.dtype.element_ty)
    if BLOCK_C > 0:
        nbt: tl.constexpr = TILE // BLOCK_C
        sb = pid.to(tl.int64) * nbt + tl.arange(0, nbt).to(tl.int64)
        smask = sb * BLOCK_C < d
    else:
        blocks = cols // block
    for i in range(M):
        if TABLED:
            cp = tl.load(code_ptrs + i).to(tl.pointer_type(tl.uint8))
        else:
            cp = tl.load(code_ptrs + i).to(tl.pointer_type(tl.int8))
        if ALIGNED:  # on the pointer itself: a hint on the loaded integer does not survive the cast
            cp = tl.multiple_of(cp, 16)
        q = tl.load(cp + cols, mask=mask, other=0).to(tl.int32)
        if TABLED:
            v = tl.load(table + q, mask=mask, other=0.0)
            invalid = tl.max((v != v).to(tl.int32), axis=0)
        else:
            v = q
            invalid = (tl.min(q, axis=0) < -127).to(tl.int32)
        sp = tl.load(scale_ptrs + i).to(tl.pointer_type(tl.float32))
        if BLOCK_C > 0:
            s_blk = tl.load(sp + sb, mask=smask, other=0.0)
            s = tl.reshape(tl.broadcast_to(s_blk[:, None], [nbt, BLOCK_C]), [TILE])
        else:
            s = tl.load(sp + blocks, mask=mask, other=0.0)
        cs = (tl.load(coef + i) * s.to(tl.float64)).to(out.dtype.element_ty)
        acc += cs * v.to(out.dtype.element_ty)
        if BLOCK_C > 0 and not TABLED:
            per_block = tl.sum(tl.reshape(q * q, [nbt, BLOCK_C]), axis=1).to(tl.float64)  # masked codes are 0
            sd = s_blk.to(tl.float64)
            sq = tl.sum(sd * sd * per_block, axis=0)
        else:
            x = s.to(tl.float64) * v.to(tl.float64)
            sq = tl.sum(x * x, axis=0)
        tl.store(part_sq + pid * M + i, sq)
        tl.store(part_bad + pid * M + i, invalid)
    tl.store(out + cols, acc, mask=mask)
    a = acc.to(tl.float64)
    tl.store(part_msq + pid, tl.sum(tl.where(mask, a * a, 0.0), axis=0))


def blockwise_fold(*, codes: list, scales: list, block: int, table: torch.Tensor | None, e4m3: bool = False,
                   coef: torch.Tensor, init: torch.Tensor | None, out: torch.Tensor, sq_out: torch.Tensor | None,
                   bad_out: torch.Tensor, msq_out: torch.Tensor) -> None:
    d, m, dev = out.numel(), len(codes), out.device
    programs = max(1, triton.cdiv(d, _TILE))
    part_sq = torch.zeros(programs, m, dtype=torch.float64, device=dev)
    part_bad = torch.zeros(programs, m, dtype=torch.int32, device=dev)
    part_msq = torch.zeros(programs, dtype=torch.float64, device=dev)
    if d:
        tab = table.to(dev, torch.float32).contiguous() if table is not None else out
        pow2 = block & (block - 1) == 0 and block <= _TILE
        _blockwise_fold_kernel[(programs,)](address_table([c.data_ptr() for c in codes], dev),
                                            address_table([s.data_ptr() for s in scales], dev), tab, coef,
                                            init if init is not None else out, out, part_sq, part_bad, part_msq, m, d,
                                            int(block), HAS_INIT=init is not None, TABLED=table is not None,
                                            ALIGNED=addresses_aligned(c.data_ptr() for c in codes),
                                            BLOCK_C=int(block) if pow2 else 0, TILE=_TILE, num_warps=_WARPS)
    if sq_out is not None:  # (None: the norms are not wanted; this pass is not bound by them)
        sq_out.copy_(part_sq.sum(0))
    bad_out.copy_(part_bad.amax(0) > 0)
    msq_out.copy_(part_msq.sum())


@triton.jit
def _sparse_fold_kernel(idx, vals, coef, out, k, TILE: tl.constexpr):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * TILE + tl.arange(0, TILE).to(tl.int64)
    mask = t < k
    at = tl.load(idx + t, mask=mask, other=0).to(tl.int64)
    v = tl.load(vals + t, mask=mask, other=0.0).to(tl.float64)
    add = (tl.load(coef) * v).to(out.dtype.element_ty)
    old = tl.load(out + at, mask=mask, other=0.0)
    tl.store(out + at, old + add, mask=mask)


def sparse_fold(*, indices: list, values: list, coef: torch.Tensor, init: torch.Tensor | None, out: torch.Tensor,
                sq_out: torch.Tensor, msq_out: torch.Tensor | None = None) -> None:
    if init is None:
        out.zero_()
    elif init.data_ptr() != out.data_ptr():
        out.copy_(init)
    for i, (ix, v) in enumerate(zip(indices, values)):
        k = ix.numel()
        if k:
            _sparse_fold_kernel[(triton.cdiv(k, _SPARSE_TILE),)](ix, v, coef[i:i + 1], out, k, TILE=_SPARSE_TILE)
        sq_out[i] = v.to(torch.float64).square().sum()
    if msq_out is not None:
        msq_out.copy_(torch.linalg.vector_norm(out, dtype=torch.float64).square())
