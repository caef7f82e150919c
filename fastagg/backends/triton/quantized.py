"""Compressed clients folded into a sum on the GPU (the definitions: csrc/quantized.h).

Blockwise (int8, or one-byte codes read through a 256-entry table): one program per tile of columns adds every
client's ``(coef_i * s_ib) * v(q_ij)`` in client order (the C++ backend's arithmetic), writes the sum once, and
leaves per-program partials (squared norms, an invalid-code flag, the sum's squares) that are added in program
order on the device. Sparse: one launch per client (its indices are strictly increasing, so no two programs of a
launch touch one element), in client order; each program leaves its values' partial sum of squares (float64),
added in program order on the device (no per-client torch ops).

The checks before a fold (:func:`compressed_scan`): one launch per kind of part (blockwise scales, sparse parts with
int32 or int64 indices) over all the round's parts at once, a grid of (tiles, parts); each program writes four
int64 partials of its tile, all of them reduced by one ``amin`` (so the host reads every client's verdict at once,
one read a round): -1 if a value is NaN/Inf; the first element that breaks the rule (a scale <= 0; an index not
above the one before it); and per kind two more (scales: minus the largest finite positive scale's float32 bits --
ordered as the scales are; indices: the smallest and minus the largest)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import address_table, addresses_aligned

_TILE = 4096  # columns per program (int8 codes: 16 bytes a thread at 8 warps)
_WARPS = 8
# blocks of at most 2048 columns (int8 / fp8 at block 256): 2048 columns at 4 warps, 12% faster than 4096 at 8 on an
# H200 (int8 0.49 vs 0.56 ms, fp8 0.67 vs 0.76 ms for 16 x 5e7; bench/RESULTS.md, issue 48); longer blocks (FLARE's
# 4096-column code book) keep 4096 at 8, where 2048 columns would gather a scale an element
_SHORT_BLOCK_TILE, _SHORT_BLOCK_WARPS = 2048, 4
_SPARSE_TILE = 1024
_SCAN_TILE = 4096
_NONE = 1 << 62  # "nothing found": above every position and index a scan can write
_SCAN_KINDS = {"scales": 0, torch.int32: 1, torch.int64: 2}
_GRID_Y = 65535


@triton.jit
def _codes(code_ptrs, i, cols, mask, TABLED: tl.constexpr, ALIGNED: tl.constexpr):
    """Client ``i``'s codes of the tile (int8, or uint8 table indices)."""
    if TABLED:
        cp = tl.load(code_ptrs + i).to(tl.pointer_type(tl.uint8))
    else:
        cp = tl.load(code_ptrs + i).to(tl.pointer_type(tl.int8))
    if ALIGNED:  # on the pointer itself: a hint on the loaded integer does not survive the cast
        cp = tl.multiple_of(cp, 16)
    return tl.load(cp + cols, mask=mask, other=0)


@triton.jit
def _blockwise_fold_kernel(code_ptrs, scale_ptrs, table, coef, init, out, part_sq, part_bad, part_msq, M, d, block,
                           HAS_INIT: tl.constexpr, TABLED: tl.constexpr, ALIGNED: tl.constexpr,
                           BLOCK_C: tl.constexpr, TILE: tl.constexpr, PREFETCH: tl.constexpr):
    """BLOCK_C > 0: the block size, a power of two dividing TILE: one scale load per block and client, and int8
    squares summed per block in int32 (exact) before one float64 product by the block's squared scale (as the C++
    fold does); BLOCK_C == 0: any block, one scale gathered per element, float64 squares per element. PREFETCH:
    client i + 1's codes are loaded before client i's are summed (two tiles of codes in flight a program, not one;
    the last client's reloaded, a cache hit); the same arithmetic either way."""
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
    if PREFETCH:
        q_next = _codes(code_ptrs, 0, cols, mask, TABLED, ALIGNED)
    for i in range(M):
        if PREFETCH:
            q = q_next.to(tl.int32)
            q_next = _codes(code_ptrs, tl.minimum(i + 1, M - 1), cols, mask, TABLED, ALIGNED)
        else:
            q = _codes(code_ptrs, i, cols, mask, TABLED, ALIGNED).to(tl.int32)
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
                   bad_out: torch.Tensor, msq_out: torch.Tensor, _prefetch: bool = True,
                   _tile: int | None = None, _warps: int | None = None) -> None:
    """``_prefetch``, ``_tile``, ``_warps``: the kernel's PREFETCH, columns a program and warps (bench/gpu_bench.py
    times the variants on the card; the defaults are the measured ones)."""
    d, m, dev = out.numel(), len(codes), out.device
    short = block <= _SHORT_BLOCK_TILE
    _tile = _tile or (_SHORT_BLOCK_TILE if short else _TILE)
    _warps = _warps or (_SHORT_BLOCK_WARPS if short else _WARPS)
    programs = max(1, -(-d // _tile))
    new = torch.empty if d else torch.zeros  # (every program writes all of its partials)
    part_sq = new(programs, m, dtype=torch.float64, device=dev)
    part_bad = new(programs, m, dtype=torch.int32, device=dev)
    part_msq = new(programs, dtype=torch.float64, device=dev)
    if d:
        tab = table.to(dev, torch.float32).contiguous() if table is not None else out
        pow2 = block & (block - 1) == 0 and block <= _tile
        _blockwise_fold_kernel[(programs,)](address_table([c.data_ptr() for c in codes], dev),
                                            address_table([s.data_ptr() for s in scales], dev), tab, coef,
                                            init if init is not None else out, out, part_sq, part_bad, part_msq, m, d,
                                            int(block), HAS_INIT=init is not None, TABLED=table is not None,
                                            ALIGNED=addresses_aligned(c.data_ptr() for c in codes),
                                            BLOCK_C=int(block) if pow2 else 0, TILE=_tile, PREFETCH=bool(_prefetch),
                                            num_warps=_warps)
    if sq_out is not None:  # (None: the norms are not wanted; this pass is not bound by them)
        torch.sum(part_sq, 0, out=sq_out)
    torch.gt(part_bad.amax(0), 0, out=bad_out)
    torch.sum(part_msq, 0, out=msq_out)


@triton.jit
def _sparse_fold_kernel(idx, vals, coef, out, part_sq, k, TILE: tl.constexpr):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * TILE + tl.arange(0, TILE).to(tl.int64)
    mask = t < k
    at = tl.load(idx + t, mask=mask, other=0).to(tl.int64)
    v = tl.load(vals + t, mask=mask, other=0.0).to(tl.float64)
    add = (tl.load(coef) * v).to(out.dtype.element_ty)
    old = tl.load(out + at, mask=mask, other=0.0)
    tl.store(out + at, old + add, mask=mask)
    tl.store(part_sq + pid, tl.sum(v * v, axis=0))  # masked values are 0


def sparse_fold(*, indices: list, values: list, coef: torch.Tensor, init: torch.Tensor | None, out: torch.Tensor,
                sq_out: torch.Tensor, msq_out: torch.Tensor | None = None) -> None:
    if init is None:
        out.zero_()
    elif init.data_ptr() != out.data_ptr():
        out.copy_(init)
    programs = max([-(-ix.numel() // _SPARSE_TILE) for ix in indices] + [1])
    part_sq = torch.zeros(len(indices), programs, dtype=torch.float64, device=out.device)
    for i, (ix, v) in enumerate(zip(indices, values)):
        k = ix.numel()
        if k:
            _sparse_fold_kernel[(-(-k // _SPARSE_TILE),)](ix, v, coef[i:i + 1], out, part_sq[i], k,
                                                                  TILE=_SPARSE_TILE)
    sq_out.copy_(part_sq.sum(1))
    if msq_out is not None:
        msq_out.copy_(torch.linalg.vector_norm(out, dtype=torch.float64).square())


@triton.jit
def _compressed_scan_kernel(a_ptrs, b_ptrs, lens, part_out, programs, NONE: tl.constexpr, KIND: tl.constexpr,
                            TILE: tl.constexpr):
    """KIND 0: ``a`` holds float32 scales; 1 / 2: ``a`` float32 values and ``b`` int32 / int64 indices. Writes
    ``part_out[part, program, 0:4]`` (the module docstring)."""
    pid = tl.program_id(0)
    j = tl.program_id(1)
    n = tl.load(lens + j)
    t = pid.to(tl.int64) * TILE + tl.arange(0, TILE).to(tl.int64)
    mask = t < n
    x = tl.load(tl.load(a_ptrs + j).to(tl.pointer_type(tl.float32)) + t, mask=mask, other=0.0)
    finite = tl.abs(x) <= 3.4028234663852886e38  # False for NaN and +-Inf
    nonfinite = tl.max((mask & ~finite).to(tl.int64), axis=0)
    if KIND == 0:
        first = tl.min(tl.where(mask & (x <= 0), t, NONE), axis=0)
        bits = x.to(tl.int32, bitcast=True).to(tl.int64)  # positive floats: ordered as their values
        c = -tl.max(tl.where(mask & finite & (x > 0), bits, 0), axis=0)
        e = tl.zeros([], dtype=tl.int64)
    else:
        if KIND == 1:
            ip = tl.load(b_ptrs + j).to(tl.pointer_type(tl.int32))
        else:
            ip = tl.load(b_ptrs + j).to(tl.pointer_type(tl.int64))
        ix = tl.load(ip + t, mask=mask, other=0).to(tl.int64)
        before = tl.load(ip + t - 1, mask=mask & (t > 0), other=0).to(tl.int64)
        first = tl.min(tl.where(mask & (t > 0) & (ix <= before), t, NONE), axis=0)
        c = tl.min(tl.where(mask, ix, NONE), axis=0)
        e = -tl.max(tl.where(mask, ix, -NONE), axis=0)
    at = part_out + (j.to(tl.int64) * programs + pid) * 4
    tl.store(at, -nonfinite)
    tl.store(at + 1, first)
    tl.store(at + 2, c)
    tl.store(at + 3, e)


def compressed_scan(*, scales: list, values: list, indices: list) -> torch.Tensor:
    """The checks of a round's compressed parts, int64 ``[len(scales) + len(values), 4]`` on their device (the
    blockwise parts' ``scales`` first, then the sparse parts' ``values`` with their ``indices``), per part: ``-1``
    if a value is NaN/Inf else 0; the first position breaking its rule (a scale <= 0, an index not above the one
    before) or 2^62; then for scales ``-b`` with ``b`` the float32 bits of the largest finite positive scale (0:
    none), and 0; for sparse parts the smallest index and minus the largest (2^62 / -2^62 when empty). Launches one
    kernel per kind present and one reduction; reads nothing back."""
    tiles = [-(-a.numel() // _SCAN_TILE) for a in scales + values]  # (triton.cdiv is a jitted function: ~3 us a call)
    kinds = [("scales", [(s, s, t) for s, t in zip(scales, tiles)])]
    for dtype in (torch.int32, torch.int64):
        kinds.append((dtype, [(v, ix, t) for v, ix, t in zip(values, indices, tiles[len(scales):])
                              if ix.dtype == dtype]))
    dev = (scales + values)[0].device
    programs = max(tiles + [1])
    part_out = torch.full((len(tiles), programs, 4), _NONE, dtype=torch.int64, device=dev)
    order = list(range(len(scales)))
    at = 0
    for kind, parts in kinds:
        if not parts:
            continue
        for lo in range(0, len(parts), _GRID_Y):  # (a grid's second dimension holds at most 65535 programs)
            chunk = parts[lo:lo + _GRID_Y]
            _compressed_scan_kernel[(max(1, max(t for _, _, t in chunk)), len(chunk))](
                address_table([a.data_ptr() for a, _, _ in chunk], dev),
                address_table([b.data_ptr() for _, b, _ in chunk], dev),
                address_table([a.numel() for a, _, _ in chunk], dev), part_out[at + lo:], programs, NONE=_NONE,
                KIND=_SCAN_KINDS[kind], TILE=_SCAN_TILE)
        at += len(parts)
        if kind != "scales":
            order += [len(scales) + j for j, ix in enumerate(indices) if ix.dtype == kind]
    found = part_out.amin(1)
    if order != sorted(order):  # int64-index parts before int32 ones: back into the callers' order
        found = found[torch.tensor(order).argsort().to(dev)]
    return found
