"""Launch configuration for the Triton kernels, one helper per kernel family.

Heuristics, not autotune: the apply kernel updates parameters in place, and an autotune rerun would apply
the step twice. Under ``TRITON_INTERPRET=1`` each program instance costs ~5-8 ms regardless of its block
(numpy runs the block), so the interpreter gets few, large blocks (about 64-128 programs).
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


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _interpreter_block(numel: int, lo: int, hi: int) -> int:
    return min(hi, max(lo, _pow2_at_least(-(-numel // 96))))


def stats_config(num_clients: int, numel: int) -> dict:
    """BLOCK_M clients x BLOCK_D columns per tile.

    GPU: 8 x 2048 fp32 tiles (64 KiB in flight per program, 64 registers a thread at 8 warps), looping over
    client chunks, so any M runs without spilling. Not yet measured on a GPU: revisit with bench/ there.
    """
    if interpreting():
        return dict(BLOCK_M=min(16, _pow2_at_least(num_clients)), BLOCK_D=_interpreter_block(numel, 1024, 1 << 16),
                    num_warps=4)
    return dict(BLOCK_M=min(8, _pow2_at_least(num_clients)), BLOCK_D=2048, num_warps=8)


def finalize_config(num_clients: int, num_blocks: int) -> dict:
    """BLOCK_M clients per program, walking the per-block partials BLOCK_B rows at a time."""
    return dict(BLOCK_M=min(32, _pow2_at_least(num_clients)), BLOCK_B=min(256, _pow2_at_least(num_blocks)),
                num_warps=4)


def apply_config(numel: int) -> dict:
    if interpreting():
        return dict(BLOCK_D=_interpreter_block(numel, 1024, 1 << 17), num_warps=4)
    return dict(BLOCK_D=4096, num_warps=8)


def local_config(num_rows: int, numel: int) -> dict:
    """Client local steps: BLOCK columns per loop step; CHUNK columns per program when rows are split (None: one
    program per row).

    GPU: rows are split into 16384-column chunks (4 blocks) unless there are enough rows to fill the SMs many times
    over (>= 1024) or a row is at most two chunks. The split depends only on the shape, never on the device, so a
    shape always sums in the same order. Not yet measured on a GPU: revisit with bench/ there.
    Interpreter: big blocks (each program costs ms); rows above 16384 columns are split into 8192-column chunks so
    the CPU tests run the split kernels too.
    """
    if interpreting():
        if numel > 16384:
            return dict(BLOCK=8192, CHUNK=8192, num_warps=4)
        return dict(BLOCK=min(1 << 16, _pow2_at_least(numel)), CHUNK=None, num_warps=4)
    block = min(4096, _pow2_at_least(numel))
    chunk = 4 * block
    split = num_rows < 1024 and numel > 2 * chunk
    return dict(BLOCK=block, CHUNK=chunk if split else None, num_warps=8 if numel >= 4096 else 4)


@functools.lru_cache(maxsize=64)
def _block_table_cpu(lens: tuple, block: int) -> torch.Tensor:
    seg, start = [], []
    for s, n in enumerate(lens):
        for b in range(0, n, block):
            seg.append(s)
            start.append(b)
    return torch.tensor([seg, start], dtype=torch.int64)


def block_grid(segments: Segments, block: int, device: torch.device) -> tuple:
    """(segment of each block, first column of each block, number of blocks, single) for a segmented vector.

    A single segment needs no table (``single`` is True and the two tables are placeholders).
    """
    lens, _ = segments.tables(device)
    if len(segments) == 1:
        return lens, lens, triton.cdiv(segments.numel, block), True
    t = _block_table_cpu(segments.lens, block).to(device)
    return t[0], t[1], t.shape[1], False


def apply_launch(segments: Segments, device: torch.device) -> tuple:
    """(number of programs, the four block-table arguments, the launch keywords) of an apply pass."""
    cfg = apply_config(segments.numel)
    lens, offs = segments.tables(device)
    bseg, bstart, nb, single = block_grid(segments, cfg["BLOCK_D"], device)
    return nb, (bseg, bstart, lens, offs), dict(SINGLE=single, BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"])


@triton.jit
def block_columns(block_seg, block_start, seg_len, seg_off, SINGLE: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's block: (segment, its columns as int64, in-bounds mask, the segment's offset in flat d)."""
    pid = tl.program_id(0).to(tl.int64)
    if SINGLE:
        seg = pid * 0
        start = pid * BLOCK_D
    else:
        seg = tl.load(block_seg + pid)
        start = tl.load(block_start + pid)
    cols = start + tl.arange(0, BLOCK_D).to(tl.int64)
    return seg, cols, cols < tl.load(seg_len + seg), tl.load(seg_off + seg)


@triton.jit
def apply_block(block_seg, block_start, seg_len, seg_off, finite_ptr, lr_ptr, mean, SINGLE: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """What every apply pass starts with: this program's block, the in-bounds mask, the write mask (in bounds and
    the round finite), the step size in the mean's dtype and the block of the mean (zeros where not written)."""
    seg, cols, inb, off = block_columns(block_seg, block_start, seg_len, seg_off, SINGLE, BLOCK_D)
    mask = inb & (tl.load(finite_ptr).to(tl.int32) != 0)
    lr = tl.load(lr_ptr).to(mean.dtype.element_ty)
    return seg, cols, inb, off, mask, lr, tl.load(mean + off + cols, mask=mask, other=0.0)
