"""Launch configuration for the Triton kernels, one helper per kernel family, and the alignment facts the
kernels are compiled with.

Heuristics, not autotune: the apply kernel updates parameters in place, and an autotune rerun would apply
the step twice. Under ``TRITON_INTERPRET=1`` each program instance costs ~5-8 ms regardless of its block
(numpy runs the block), so the interpreter gets few, large blocks (about 64-128 programs).

Vector width. The kernels reach client rows and parameter segments through address tables loaded from memory,
so Triton cannot see that an address is 16-byte aligned, nor that a block lies wholly inside its segment (the
segment length is loaded too): every access would be a 4-byte one. Each launcher therefore checks on the host
that every address it puts in a table is a multiple of 16 bytes (``ALIGNED``) and that every segment offset into
the flat buffers (mean, state) is too (``OFF_ALIGNED``), and the kernels state it with ``tl.multiple_of``; a block
wholly inside its segment takes an unmasked path. Both are facts checked per call, never assumed.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ...rows import Segments


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


ALIGN = 16  # bytes: one 128-bit access
HINTS = os.environ.get("FASTAGG_TRITON_HINTS", "1") != "0"  # off: plain 4-byte accesses (bench/ compares both)
# Guarded stores (an element whose new value is not finite keeps its old one): on, the kept element's old bits are
# written back under a mask that is uniform across the block, which Triton vectorizes (16-byte stores); off, the
# store is masked per element, which compiles to one 2- or 4-byte store per element (bench/ compares both).
SELECT_STORES = os.environ.get("FASTAGG_TRITON_SELECT_STORES", "1") != "0"


def addresses_aligned(addresses) -> bool:
    """Every address (ints) is a multiple of ALIGN bytes (False when hints are off)."""
    return HINTS and all(a % ALIGN == 0 for a in addresses)


def rows_aligned(t: torch.Tensor) -> bool:
    """Every row of a 2-D tensor (unit stride along dim 1) starts on an ALIGN-byte boundary."""
    step = t.stride(0) * t.element_size() if t.shape[0] > 1 else 0
    return addresses_aligned((t.data_ptr(), step))


@functools.lru_cache(maxsize=256)
def _offsets_aligned(offs: tuple, element_size: int) -> bool:
    return all(o * element_size % ALIGN == 0 for o in offs)


def offsets_aligned(segments: Segments, element_size: int) -> bool:
    """Every segment starts on an ALIGN-byte boundary of a flat buffer of ``element_size``-byte elements."""
    return HINTS and _offsets_aligned(segments.offs, element_size)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _interpreter_block(numel: int, lo: int, hi: int) -> int:
    return min(hi, max(lo, _pow2_at_least(-(-numel // 96))))


def stats_config(num_clients: int, numel: int, element_size: int = 4) -> dict:
    """BLOCK_M clients x BLOCK_D columns per tile (the program loops over client chunks, so any M runs without
    spilling; the next chunk's tile is loaded before the current one is reduced).

    GPU: 2 clients x 2048 columns at 4 warps: the fastest of eight tiles at both measured shapes on an H200
    (bench/RESULTS.md: 0.96 of copy bandwidth at M = 16, d = 1e8 and 0.91 at M = 100, d = 1e7; the first guess, 8 x
    2048 at 8 warps, ran at 0.44). More clients per tile means more per-row reductions, each a barrier, and more
    registers. Short vectors get narrower blocks (at least about 264 programs, two per SM) with more clients per
    tile. Long rows of 2-byte inputs (bf16, fp16) take one client x 8192 columns at 4 warps: 0.89 / 0.78 of copy on
    an H100 where 2 x 2048 ran at 0.80 / 0.70 (eight tiles swept, bench/RESULTS.md).
    """
    if interpreting():
        return dict(BLOCK_M=min(16, _pow2_at_least(num_clients)), BLOCK_D=_interpreter_block(numel, 1024, 1 << 16),
                    num_warps=4)
    wide = 8192 if element_size <= 2 else 2048
    block_d = min(wide, max(512, _pow2_at_least(-(-numel // 264))))
    if block_d > 2048:
        return dict(BLOCK_M=1, BLOCK_D=block_d, num_warps=4)
    return dict(BLOCK_M=min(16, _pow2_at_least(num_clients), 4096 // block_d), BLOCK_D=block_d, num_warps=4)


# How the stats pass keeps loads in flight across its client loop (round_stats.py ``_stats_block``): PREFETCH chunks'
# tiles loaded ahead (0, 1, 2), held as stored when RAW, the loop pipelined by the compiler over STAGES iterations
# (None: not). The default is the one measured on cards (bench/RESULTS.md); a config dict from ``stats_config`` (or
# one a benchmark passes in its place) may name other values, which give the same bits.
STATS_PIPELINE = dict(PREFETCH=1, RAW=False, STAGES=None)


def finalize_config(num_clients: int, num_blocks: int) -> dict:
    """BLOCK_M clients per program, walking the per-block partials BLOCK_B rows at a time."""
    return dict(BLOCK_M=min(32, _pow2_at_least(num_clients)), BLOCK_B=min(256, _pow2_at_least(num_blocks)),
                num_warps=4)


def apply_config(numel: int) -> dict:
    """Columns per program of the apply passes. GPU: 1024 columns at 4 warps, the fastest of eight on an H100
    (bench/RESULTS.md: the FedExP round at M = 16, d = 1e8 went from 0.87 to 0.94 of copy bandwidth in fp32 and from
    0.68 to 0.78 in bf16 against 4096 at 8 warps)."""
    if interpreting():
        return dict(BLOCK_D=_interpreter_block(numel, 1024, 1 << 17), num_warps=4)
    return dict(BLOCK_D=1024, num_warps=4)


def local_config(num_rows: int, numel: int) -> dict:
    """Client local steps: the schedule (local_step.py: ``row``, ``chunks`` or ``grouped``), BLOCK columns per
    block, CHUNK columns per program of the split schedules, GROUP_ROWS rows per group of ``grouped``.

    GPU: a row of at most two 4096-column blocks is one program; longer rows are cut into 16384-column chunks and
    run in groups of rows holding about 8 MB of gradient (at 4 bytes an element), so that a chunk's second read
    finds it in L2. On an H200 (bench/RESULTS.md) that ran at 0.74-0.76 of copy bandwidth by the step's unavoidable
    bytes at M = 1000, d = 1e5 and M = 100, d = 1e6, against 0.57-0.68 for ``chunks`` (both sweeps as separate
    launches) and 0.43-0.65 for one program per row; groups of 16-32 MB and 4096-column chunks were slower. The
    choice depends only on the shape, never on the device, and ``grouped`` sums a row in the order ``chunks`` does.
    Interpreter: big blocks (each program costs ms); rows above 16384 columns are split into 8192-column chunks so
    the CPU tests run the split kernels too.
    """
    if interpreting():
        if numel > 16384:
            return dict(schedule="chunks", BLOCK=8192, CHUNK=8192, GROUP_ROWS=None, num_warps=4)
        return dict(schedule="row", BLOCK=min(1 << 16, _pow2_at_least(numel)), CHUNK=None, GROUP_ROWS=None,
                    num_warps=4)
    block = min(4096, _pow2_at_least(numel))
    if numel <= 2 * block:
        return dict(schedule="row", BLOCK=block, CHUNK=None, GROUP_ROWS=None, num_warps=8 if numel >= 4096 else 4)
    return dict(schedule="grouped", BLOCK=block, CHUNK=4 * block, GROUP_ROWS=max(1, (8 << 20) // (4 * numel)),
                num_warps=8)


# The same for the client step's two sweeps (local_step.py): PREFETCH 1 loads each block's inputs while the previous
# block is reduced (sweep 1) or updated (sweep 2), 0 not; STAGES as above. Every variant gives the same bits.
LOCAL_PIPELINE = dict(PREFETCH=0, STAGES=None)


@functools.lru_cache(maxsize=64)
def _block_table_cpu(lens: tuple, block: int) -> torch.Tensor:
    seg, start = [], []
    for s, n in enumerate(lens):
        for b in range(0, n, block):
            seg.append(s)
            start.append(b)
    return torch.tensor([seg, start], dtype=torch.int64)


@functools.lru_cache(maxsize=128)
def _device_tables(segments: Segments, block: int, device: torch.device) -> tuple:
    lens, offs = segments.tables(device)
    if len(segments) == 1:
        return lens, offs, lens, lens, triton.cdiv(segments.numel, block), True
    t = _block_table_cpu(segments.lens, block).to(device)
    return lens, offs, t[0], t[1], t.shape[1], False


_CAPTURED: dict = {}  # tables a CUDA graph was captured with: never freed, or a replay would read freed memory


def _kept(cached, key: tuple, device: torch.device):
    """``cached`` (a cache's value), pinned for the process's lifetime when a CUDA graph is being captured on this
    device (the graph holds raw addresses; the LRU cache could otherwise free the table under it)."""
    if device.type == "cuda" and key not in _CAPTURED and torch.cuda.is_current_stream_capturing():
        _CAPTURED[key] = cached
    return cached


def segment_tables(segments: Segments, block: int, device: torch.device) -> tuple:
    """(lens, offs, segment of each block, first column of each block, number of blocks, single) on ``device``.

    Built once per shape and device and kept (a few int64 per block): a call never copies from the host once its
    shape has been seen, which is what lets a CUDA graph capture a step after one eager warm-up step. A single
    segment needs no block table (``single`` is True and the two block tables are placeholders).
    """
    device = torch.device(device)
    return _kept(_device_tables(segments, block, device), ("segments", segments, block, device), device)


@functools.lru_cache(maxsize=64)
def _address_table(addresses: tuple, device: torch.device) -> torch.Tensor:
    return torch.tensor(addresses, dtype=torch.int64).to(device)


def address_table(addresses, device: torch.device) -> torch.Tensor:
    """The int64 addresses as a tensor on ``device``, kept per distinct table (its content is its key, so a kept
    table can never be stale): the same buffers on later calls, or in a CUDA graph capture after one eager
    warm-up call, copy nothing from the host."""
    addresses, device = tuple(addresses), torch.device(device)
    return _kept(_address_table(addresses, device), ("addresses", addresses, device), device)


@functools.lru_cache(maxsize=256)
def _scalar_table(values: tuple, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(device)


def scalar_table(values, device: torch.device) -> torch.Tensor:
    """Hyperparameters (momentum, betas, tau...) as a float64 tensor the kernels load: a Python float passed to a
    Triton kernel arrives as float32, which rounds 0.9 to 0.89999998 -- wrong in the eighth digit for float64
    params. Kept per distinct tuple of values, like address tables (no host copy after the first call)."""
    values, device = tuple(float(v) for v in values), torch.device(device)
    return _kept(_scalar_table(values, device), ("scalars", values, device), device)


def off_mult(segments: Segments, element_size: int) -> int:
    """The OFF_MULT a kernel may assume for flat buffers of ``element_size``-byte elements (1: none)."""
    return ALIGN // element_size if len(segments) == 1 or offsets_aligned(segments, element_size) else 1


def apply_launch(segments: Segments, device: torch.device, flat_element_size: int, addresses) -> tuple:
    """(number of programs, the four block-table arguments, the launch keywords) of an apply pass whose flat
    buffers (mean, state) have ``flat_element_size``-byte elements and whose tables hold ``addresses``."""
    cfg = apply_config(segments.numel)
    lens, offs, bseg, bstart, nb, single = segment_tables(segments, cfg["BLOCK_D"], device)
    return nb, (bseg, bstart, lens, offs), dict(SINGLE=single, BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"],
                                                OFF_MULT=off_mult(segments, flat_element_size),
                                                ALIGNED=addresses_aligned(addresses), SELECT=SELECT_STORES)


@triton.jit
def guarded_store(ptrs, new, old, good, mask, SELECT: tl.constexpr):
    """Store ``new`` where ``good`` and leave ``old`` (the bits loaded from ``ptrs``) elsewhere, within ``mask``.
    SELECT writes ``old`` back under ``mask`` alone: with a block-uniform mask that is one vector store per thread
    instead of one store per element (an element kept is rewritten with its own bits)."""
    if SELECT:
        tl.store(ptrs, tl.where(good, new, old), mask=mask)
    else:
        tl.store(ptrs, new, mask=mask & good)


@triton.jit
def table_address(table, idx, like, ALIGNED: tl.constexpr):
    """``table[idx]`` (int64 addresses) as pointers to ``like``'s element type, 16-byte aligned when ALIGNED."""
    p = tl.load(table + idx).to(tl.pointer_type(like.dtype.element_ty))
    if ALIGNED:  # on the pointer itself: a hint on the loaded integer does not survive the cast
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def block_columns(block_seg, block_start, seg_len, seg_off, SINGLE: tl.constexpr, BLOCK_D: tl.constexpr,
                  OFF_MULT: tl.constexpr):
    """This program's block: (segment, its first column, its columns as int64, whether the block lies wholly inside
    the segment, the in-bounds mask, the segment's offset in flat d). OFF_MULT: a known divisor of every segment
    offset."""
    pid = tl.program_id(0).to(tl.int64)
    if SINGLE:
        seg = pid * 0
        start = pid * BLOCK_D
        off = pid * 0
    else:
        seg = tl.load(block_seg + pid)
        start = tl.multiple_of(tl.load(block_start + pid), BLOCK_D)  # blocks start at multiples of BLOCK_D
        off = tl.load(seg_off + seg)
        if OFF_MULT > 1:
            off = tl.multiple_of(off, OFF_MULT)
    n = tl.load(seg_len + seg)
    cols = start + tl.arange(0, BLOCK_D).to(tl.int64)
    return seg, start, cols, start + BLOCK_D <= n, cols < n, off
