"""Batched local steps on the GPU. A row's step needs its whole direction norm before any update, so each row is
read in two sweeps: sweep 1 sums ||dir||^2 (in float64, block by block in order); the row's scalars
(clip scale, the fixed or SPS step, the safeguards) are computed in-program; sweep 2 applies the step with stores
masked off for a row that takes none. See ``backends/reference.py::local_step`` for the exact rule.

Three schedules (``launch.local_config`` picks by shape; each sums a shape in one fixed order):

- ``row``: one program per row does both sweeps (``_local_step_kernel``). Rows of one block.
- ``chunks``: longer rows are cut into chunks of columns and each (chunk, row) is a program: pass 1 writes the
  chunks' partial norms, pass 2 has every chunk's program sum its row's partials in the same order, take the
  row's step and update its chunk. The direction is read twice, in two launches.
- ``grouped`` (the GPU's choice for long rows): both passes of ``chunks`` in one launch, rows taken in groups that
  fit in L2 and a group's second pass run right after the next group's first, so the second read of a chunk
  mostly hits L2 (``_grouped_kernel``: work slots handed out by an atomic ticket, pass 2 waiting on a per-row
  count; the same sums as ``chunks``, bit for bit).

Blocks wholly inside the row take an unmasked path; with 16-byte-aligned rows they compile to 16-byte accesses
(launch.py). Whether a sweep loads the next block before it reduces or updates the current one, or leaves that to
the compiler's loop pipelining, is launch.LOCAL_PIPELINE (variants a benchmark compares; the same bits each).
Tried and removed (bench/RESULTS.md): persistent teams of programs that held a row's direction in registers across
a per-row barrier, so it is read once; on an H200 they ran slower than ``chunks``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...rowtable import per_row_tensor
from . import launch
from .launch import addresses_aligned, guarded_store, local_config, scalar_table

RULES = {"fixed": 0, "sps": 1}
MODES = {"none": 0, "heavy": 1, "nesterov": 2, "mass": 3}


@triton.jit
def _direction(x_row, g_row, a_row, control, ci_row, cols, mask, prox, ACC: tl.constexpr,
               HAS_ANCHOR: tl.constexpr, HAS_CONTROL: tl.constexpr, EVICT: tl.constexpr):
    v = tl.load(g_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(ACC)
    if HAS_ANCHOR:
        xv = tl.load(x_row + cols, mask=mask, other=0.0).to(ACC)
        v += prox * (xv - tl.load(a_row + cols, mask=mask, other=0.0).to(ACC))
    if HAS_CONTROL:
        v += tl.load(control + cols, mask=mask, other=0.0).to(ACC) - tl.load(ci_row + cols, mask=mask, other=0.0).to(ACC)
    return v


@triton.jit
def _row_address(table, i, elem, ALIGNED: tl.constexpr):
    p = tl.load(table + i).to(tl.pointer_type(elem))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _rows(x_ptrs, g_ptrs, a_ptrs, ci_ptrs, buf_ptrs, like, i, ACC: tl.constexpr, ALIGNED: tl.constexpr):
    """Row i's addresses in each table."""
    elem = like.dtype.element_ty
    return (_row_address(x_ptrs, i, elem, ALIGNED), _row_address(g_ptrs, i, elem, ALIGNED),
            _row_address(a_ptrs, i, elem, ALIGNED), _row_address(ci_ptrs, i, ACC, ALIGNED),
            _row_address(buf_ptrs, i, ACC, ALIGNED))


@triton.jit
def _sq_sum(x_row, g_row, a_row, control, ci_row, c0, c1, prox, ACC: tl.constexpr, HAS_ANCHOR: tl.constexpr,
            HAS_CONTROL: tl.constexpr, BLOCK: tl.constexpr, EVICT: tl.constexpr, PREFETCH: tl.constexpr,
            STAGES: tl.constexpr):
    """||dir||^2 over columns [c0, c1): squares and sums in float64, block by block in order. Full blocks first
    (unmasked), then the ragged tail: the same blocks in the same order as a masked loop. PREFETCH: the next full
    block is loaded before this one is reduced (a mask uniform over the block, off past the last); STAGES: the
    compiler pipelines the loop (launch.LOCAL_PIPELINE). The same sums either way."""
    offs = tl.arange(0, BLOCK).to(tl.int64)
    s = tl.zeros([1], dtype=tl.float64)
    end_full = c0 + (c1 - c0) // BLOCK * BLOCK
    all_in = tl.full([BLOCK], 1, tl.int1)
    if PREFETCH:
        v = _direction(x_row, g_row, a_row, control, ci_row, c0 + offs, all_in & (c0 < end_full), prox, ACC,
                       HAS_ANCHOR, HAS_CONTROL, EVICT)
    for b0 in tl.range(c0, end_full, BLOCK, num_stages=STAGES):
        if PREFETCH:
            v_next = _direction(x_row, g_row, a_row, control, ci_row, b0 + BLOCK + offs,
                                all_in & (b0 + BLOCK < end_full), prox, ACC, HAS_ANCHOR, HAS_CONTROL, EVICT)
        else:
            v = _direction(x_row, g_row, a_row, control, ci_row, b0 + offs, all_in, prox, ACC, HAS_ANCHOR,
                           HAS_CONTROL, EVICT)
        s += tl.sum(v.to(tl.float64) * v.to(tl.float64))
        if PREFETCH:
            v = v_next
    if end_full < c1:
        cols = end_full + offs
        v = _direction(x_row, g_row, a_row, control, ci_row, cols, cols < c1, prox, ACC, HAS_ANCHOR, HAS_CONTROL,
                       EVICT)
        s += tl.sum(v.to(tl.float64) * v.to(tl.float64))
    return tl.sum(s)


@triton.jit
def _row_step(s, i, lr, loss, l_star, sps_c, cap, clip_norm, tiny, RULE: tl.constexpr, ACC: tl.constexpr):
    """The row's (step, clip scale) from its squared direction norm s, with the safeguards (step 0: none; a step
    that is not finite in the compute dtype is none too)."""
    clip = clip_norm
    scale = tl.where((clip > 0) & (s > clip * clip), clip / tl.sqrt(tl.where(s > 0, s, 1.0)), 1.0)
    s2 = s * scale * scale
    finite = (s == s) & (s - s == 0)
    if RULE == 0:
        step = tl.where(finite, tl.load(lr + i), 0.0)
    else:
        f = tl.load(loss + i)
        ls = tl.load(l_star + i)
        ok = finite & (f - f == 0) & (f > ls) & (s2 > tiny)
        raw = tl.minimum((f - ls) / (tl.load(sps_c + i) * tl.where(ok, s2, 1.0)), tl.load(cap + i))
        step = tl.where(ok, raw, 0.0)
    sc = step.to(ACC)
    step = tl.where((step - step == 0) & (sc - sc == 0) & (step > 0), step, 0.0)
    return step, scale


@triton.jit
def _update_block(x_row, b_row, like, first_ptr, i, cols, mask, x_raw, dir, st, sc, weight_decay, momentum, eta2,
                  ACC: tl.constexpr, HAS_FIRST: tl.constexpr, MODE: tl.constexpr, SELECT: tl.constexpr):
    """Sweep 2 on one block, given the block's params ``x_raw`` (as stored) and direction ``dir``; ``mask`` is off
    everywhere for a row that takes no step. An element whose new x or state would not be finite keeps its old
    values."""
    elem = like.dtype.element_ty
    xv = x_raw.to(ACC)
    dv = sc * dir + weight_decay * xv
    if MODE == 0:
        new_x = xv - st * dv
        bv = new_x
        b_old = xv
    elif MODE == 1:
        b_old = tl.load(b_row + cols, mask=mask, other=0.0)
        bv = momentum * b_old + dv
        new_x = xv - st * bv
    elif MODE == 2:
        b_old = tl.load(b_row + cols, mask=mask, other=0.0)
        bv = momentum * b_old + dv
        new_x = xv - st * (dv + momentum * bv)
    else:
        bv = xv - st * dv  # w
        b_old = tl.load(b_row + cols, mask=mask, other=0.0)
        prev = b_old
        if HAS_FIRST:  # a row's first step: w_0 = u_0
            prev = tl.where(tl.load(first_ptr + i) != 0, xv, b_old)
        new_x = bv + momentum * (bv - prev) + eta2 * dv
    r = new_x.to(elem).to(ACC)
    good = (r - r == 0) & (bv - bv == 0)  # an element already Inf/NaN stays as it was
    if MODE != 0:
        guarded_store(b_row + cols, bv, b_old, good, mask, SELECT)
    guarded_store(x_row + cols, new_x.to(elem), x_raw, good, mask, SELECT)


@triton.jit
def _update(x_row, g_row, a_row, control, ci_row, b_row, like, first_ptr, i, c0, c1, step, scale, prox,
            weight_decay, momentum, eta2, ACC: tl.constexpr, HAS_ANCHOR: tl.constexpr, HAS_CONTROL: tl.constexpr,
            HAS_FIRST: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr, SELECT: tl.constexpr,
            EVICT: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr):
    """Sweep 2 over columns [c0, c1): full blocks unmasked (but for the step), then the tail. PREFETCH: the next
    full block's inputs are loaded before this one is updated (other columns than it stores); STAGES as in
    ``_sq_sum``."""
    offs = tl.arange(0, BLOCK).to(tl.int64)
    st = step.to(ACC)
    sc = scale.to(ACC)
    stepping = tl.full([BLOCK], 1, tl.int1) & ((step > 0).to(tl.int32) != 0)  # (int compare: the interpreter)
    end_full = c0 + (c1 - c0) // BLOCK * BLOCK
    if PREFETCH:
        dv = _direction(x_row, g_row, a_row, control, ci_row, c0 + offs, stepping & (c0 < end_full), prox, ACC,
                        HAS_ANCHOR, HAS_CONTROL, EVICT)
        xv = tl.load(x_row + c0 + offs, mask=stepping & (c0 < end_full), other=0.0)
    for b0 in tl.range(c0, end_full, BLOCK, num_stages=STAGES):
        cols = b0 + offs
        if PREFETCH:
            ahead = stepping & (b0 + BLOCK < end_full)
            dv_next = _direction(x_row, g_row, a_row, control, ci_row, cols + BLOCK, ahead, prox, ACC, HAS_ANCHOR,
                                 HAS_CONTROL, EVICT)
            xv_next = tl.load(x_row + cols + BLOCK, mask=ahead, other=0.0)
        else:
            dv = _direction(x_row, g_row, a_row, control, ci_row, cols, stepping, prox, ACC, HAS_ANCHOR,
                            HAS_CONTROL, EVICT)
            xv = tl.load(x_row + cols, mask=stepping, other=0.0)
        _update_block(x_row, b_row, like, first_ptr, i, cols, stepping, xv, dv, st, sc, weight_decay, momentum,
                      eta2, ACC, HAS_FIRST, MODE, SELECT)
        if PREFETCH:
            dv, xv = dv_next, xv_next
    if end_full < c1:
        cols = end_full + offs
        mask = stepping & (cols < c1)
        dv = _direction(x_row, g_row, a_row, control, ci_row, cols, mask, prox, ACC, HAS_ANCHOR, HAS_CONTROL, EVICT)
        xv = tl.load(x_row + cols, mask=mask, other=0.0)
        _update_block(x_row, b_row, like, first_ptr, i, cols, mask, xv, dv, st, sc, weight_decay, momentum, eta2,
                      ACC, HAS_FIRST, MODE, SELECT)


@triton.jit
def _coefs(coefs, ACC: tl.constexpr):
    """(prox, clip_norm, weight_decay, momentum, eta2, tiny) from their float64 table; clip_norm and tiny stay
    float64 (they meet the float64 squared norm), the others take the compute dtype."""
    return (tl.load(coefs).to(ACC), tl.load(coefs + 1), tl.load(coefs + 2).to(ACC), tl.load(coefs + 3).to(ACC),
            tl.load(coefs + 4).to(ACC), tl.load(coefs + 5))


@triton.jit
def _local_step_kernel(x_ptrs, g_ptrs, a_ptrs, control, ci_ptrs, buf_ptrs, like, lr, loss, l_star,
                       sps_c, cap, first_ptr, step_out, d, coefs,
                       ACC: tl.constexpr, HAS_ANCHOR: tl.constexpr, HAS_CONTROL: tl.constexpr, HAS_FIRST: tl.constexpr,
                       RULE: tl.constexpr, MODE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
                       SELECT: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr):
    """One program per row: sweep 1, the row's step, sweep 2."""
    prox, clip_norm, weight_decay, momentum, eta2, tiny = _coefs(coefs, ACC)
    i = tl.program_id(0).to(tl.int64)
    x_row, g_row, a_row, ci_row, b_row = _rows(x_ptrs, g_ptrs, a_ptrs, ci_ptrs, buf_ptrs, like, i, ACC, ALIGNED)
    s = _sq_sum(x_row, g_row, a_row, control, ci_row, 0, d, prox, ACC, HAS_ANCHOR, HAS_CONTROL, BLOCK, "", PREFETCH,
                STAGES)
    step, scale = _row_step(s, i, lr, loss, l_star, sps_c, cap, clip_norm, tiny, RULE, ACC)
    tl.store(step_out + i, step)
    _update(x_row, g_row, a_row, control, ci_row, b_row, like, first_ptr, i, 0, d, step, scale, prox, weight_decay,
            momentum, eta2, ACC, HAS_ANCHOR, HAS_CONTROL, HAS_FIRST, MODE, BLOCK, SELECT, "", PREFETCH, STAGES)


@triton.jit
def _chunk_sq_kernel(x_ptrs, g_ptrs, a_ptrs, control, ci_ptrs, buf_ptrs, like, partial, d, coefs,
                     ACC: tl.constexpr, HAS_ANCHOR: tl.constexpr, HAS_CONTROL: tl.constexpr, ALIGNED: tl.constexpr,
                     CHUNK: tl.constexpr, BLOCK: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr):
    """Split rows, pass 1: program (c, i) writes ||dir||^2 of row i's chunk c to partial[i, c]. (Chunks on grid
    axis 0, which takes 2^31 - 1 programs; axis 1 takes 65535.)"""
    prox = tl.load(coefs).to(ACC)
    c = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64)
    x_row, g_row, a_row, ci_row, b_row = _rows(x_ptrs, g_ptrs, a_ptrs, ci_ptrs, buf_ptrs, like, i, ACC, ALIGNED)
    c0 = c * CHUNK
    c1 = tl.minimum(c0 + CHUNK, d)
    s = _sq_sum(x_row, g_row, a_row, control, ci_row, c0, c1, prox, ACC, HAS_ANCHOR, HAS_CONTROL, BLOCK, "",
                PREFETCH, STAGES)
    tl.store(partial + i * tl.num_programs(0) + c, s)


@triton.jit
def _chunk_update_kernel(x_ptrs, g_ptrs, a_ptrs, control, ci_ptrs, buf_ptrs, like, partial, lr, loss, l_star,
                         sps_c, cap, first_ptr, step_out, d, coefs,
                         ACC: tl.constexpr, HAS_ANCHOR: tl.constexpr, HAS_CONTROL: tl.constexpr,
                         HAS_FIRST: tl.constexpr, RULE: tl.constexpr, MODE: tl.constexpr, ALIGNED: tl.constexpr,
                         CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr, BLOCK: tl.constexpr, SELECT: tl.constexpr,
                         PREFETCH: tl.constexpr, STAGES: tl.constexpr):
    """Split rows, pass 2: every program of row i sums the row's chunk partials (the same fixed order in each),
    takes the row's step, and updates its own chunk; chunk 0 reports the step."""
    prox, clip_norm, weight_decay, momentum, eta2, tiny = _coefs(coefs, ACC)
    c = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64)
    n = tl.num_programs(0)
    k = tl.arange(0, CHUNKS_P2)
    s = tl.sum(tl.load(partial + i * n + k, mask=k < n, other=0.0))
    step, scale = _row_step(s, i, lr, loss, l_star, sps_c, cap, clip_norm, tiny, RULE, ACC)
    if c == 0:
        tl.store(step_out + i, step)
    x_row, g_row, a_row, ci_row, b_row = _rows(x_ptrs, g_ptrs, a_ptrs, ci_ptrs, buf_ptrs, like, i, ACC, ALIGNED)
    c0 = c * CHUNK
    _update(x_row, g_row, a_row, control, ci_row, b_row, like, first_ptr, i, c0, tl.minimum(c0 + CHUNK, d), step,
            scale, prox, weight_decay, momentum, eta2, ACC, HAS_ANCHOR, HAS_CONTROL, HAS_FIRST, MODE, BLOCK, SELECT,
            "", PREFETCH, STAGES)


@triton.jit
def _grouped_phase(slot, per_phase, ngroups):
    """(pass, group) of a work slot. Phases run in the order P1(0), then P1(k), P2(k - 1) for k = 1 .. ngroups - 1,
    then P2(ngroups - 1): a group's second sweep comes one group after its first, while its gradient is still in
    L2, and every slot of the first sweep it waits for precedes it."""
    phase = slot // per_phase
    last = 2 * ngroups - 1
    is_p2 = (phase == last) | ((phase > 0) & (phase % 2 == 0))
    group = tl.where(is_p2, tl.where(phase == last, ngroups - 1, phase // 2 - 1), (phase + 1) // 2)
    return is_p2, group


@triton.jit
def _grouped_kernel(x_ptrs, g_ptrs, a_ptrs, control, ci_ptrs, buf_ptrs, like, partial, done, ticket, lr, loss,
                    l_star, sps_c, cap, first_ptr, step_out, d, M, nchunks, group_rows, coefs,
                    ACC: tl.constexpr, HAS_ANCHOR: tl.constexpr, HAS_CONTROL: tl.constexpr, HAS_FIRST: tl.constexpr,
                    RULE: tl.constexpr, MODE: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr,
                    CHUNKS_P2: tl.constexpr, BLOCK: tl.constexpr, SELECT: tl.constexpr, PREFETCH: tl.constexpr,
                    STAGES: tl.constexpr):
    """Both sweeps of the ``chunks`` schedule in one launch, rows taken in groups whose gradients fit in L2.

    A program takes the next work slot from ``ticket`` (so slots are handed out in the order programs start, whatever
    order the hardware launches them in); a slot is (pass, row, chunk). Pass 1 writes the chunk's partial norm and
    counts it in ``done[row]``; pass 2 waits until the row's count is complete, then sums the partials in chunk
    order (the ``chunks`` schedule's order: the same bits) and updates its chunk. A pass-2 slot waits only on
    slots handed out before it, to programs already running that never wait: no deadlock, however few programs
    are resident."""
    prox, clip_norm, weight_decay, momentum, eta2, tiny = _coefs(coefs, ACC)
    slot = tl.atomic_add(ticket, 1).to(tl.int64)
    per_phase = group_rows * nchunks
    ngroups = tl.cdiv(M, group_rows)
    is_p2, group = _grouped_phase(slot, per_phase, ngroups)
    within = slot % per_phase
    i = group * group_rows + within // nchunks
    c = within % nchunks
    if i < M:
        x_row, g_row, a_row, ci_row, b_row = _rows(x_ptrs, g_ptrs, a_ptrs, ci_ptrs, buf_ptrs, like, i, ACC, ALIGNED)
        c0 = c * CHUNK
        c1 = tl.minimum(c0 + CHUNK, d)
        if is_p2:
            while tl.atomic_add(done + i, 0, sem="acquire") < nchunks:
                pass
            k = tl.arange(0, CHUNKS_P2)
            # .cg: past L1, which may hold a line of partials read before they were all written
            s = tl.sum(tl.load(partial + i * nchunks + k, mask=k < nchunks, other=0.0, cache_modifier=".cg"))
            step, scale = _row_step(s, i, lr, loss, l_star, sps_c, cap, clip_norm, tiny, RULE, ACC)
            if c == 0:
                tl.store(step_out + i, step)
            _update(x_row, g_row, a_row, control, ci_row, b_row, like, first_ptr, i, c0, c1, step, scale, prox,
                    weight_decay, momentum, eta2, ACC, HAS_ANCHOR, HAS_CONTROL, HAS_FIRST, MODE, BLOCK, SELECT,
                    "evict_first", PREFETCH, STAGES)
        else:
            s = _sq_sum(x_row, g_row, a_row, control, ci_row, c0, c1, prox, ACC, HAS_ANCHOR, HAS_CONTROL, BLOCK,
                        "evict_last", PREFETCH, STAGES)
            tl.store(partial + i * nchunks + c, s)
            tl.debug_barrier()  # the partial is written before it is counted
            tl.atomic_add(done + i, 1, sem="release")


def _rows_aligned(*tables) -> bool:
    """Every row of every RowTable starts on a 16-byte boundary."""
    out = []
    for t in tables:
        if t is None:
            continue
        out += [t.base.data_ptr(), t.row_stride_bytes()]
    return addresses_aligned(out)


def local_step(*, x, g, anchor, control, ci, buf, lr, loss, l_star, sps_c, cap, first, prox: float, clip_norm: float,
               weight_decay: float, momentum: float, eta2: float, tiny: float, rule: str, mode: str,
               step_out) -> None:
    M, d = x.num_rows, x.base.shape[1]
    if M == 0:
        return
    device = x.base.device
    lr, loss, l_star, sps_c, cap = (per_row_tensor(v, M, device) for v in (lr, loss, l_star, sps_c, cap))
    cfg = local_config(M, d)
    xp = x.ptrs()
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    rows = (xp, g.ptrs(), xp if anchor is None else anchor.ptrs(), x.base if control is None else control,
            xp if ci is None else ci.ptrs(), xp if buf is None else buf.ptrs(), x.base)
    flags = dict(ACC=acc, HAS_ANCHOR=anchor is not None, HAS_CONTROL=control is not None,
                 ALIGNED=_rows_aligned(x, g, anchor, ci, buf))
    step_flags = dict(HAS_FIRST=first is not None, RULE=RULES[rule], MODE=MODES[mode])
    coefs = scalar_table((prox, clip_norm, weight_decay, momentum, eta2, tiny), device)
    scalars = (lr, loss, l_star, sps_c, cap, lr if first is None else first, step_out, d, coefs)
    schedule = cfg["schedule"]
    step_flags["SELECT"] = launch.SELECT_STORES
    pipe = {k: cfg.get(k, v) for k, v in launch.LOCAL_PIPELINE.items()}
    flags.update(pipe)
    chunks = triton.cdiv(d, cfg["CHUNK"]) if cfg["CHUNK"] else 1
    if schedule == "grouped":
        group_rows = min(M, cfg["GROUP_ROWS"])
        ngroups = triton.cdiv(M, group_rows)
        partial = torch.empty(M, chunks, dtype=torch.float64, device=device)
        counters = torch.zeros(M + 1, dtype=torch.int32, device=device)  # done[M], then the ticket
        _grouped_kernel[(2 * ngroups * group_rows * chunks,)](
            *rows, partial, counters, counters[M:], *scalars[:-2], d, M, chunks, group_rows, coefs, **flags,
            **step_flags, CHUNK=cfg["CHUNK"], CHUNKS_P2=triton.next_power_of_2(chunks), BLOCK=cfg["BLOCK"],
            num_warps=cfg["num_warps"])
        return
    if schedule == "row" or M > 65535:  # the chunk kernels put rows on grid axis 1 (at most 65535)
        _local_step_kernel[(M,)](*rows, *scalars, **flags, **step_flags, BLOCK=cfg["BLOCK"],
                                 num_warps=cfg["num_warps"])
        return
    partial = torch.empty(M, chunks, dtype=torch.float64, device=device)
    _chunk_sq_kernel[(chunks, M)](*rows, partial, d, coefs, **flags, CHUNK=cfg["CHUNK"], BLOCK=cfg["BLOCK"],
                                  num_warps=cfg["num_warps"])
    _chunk_update_kernel[(chunks, M)](*rows, partial, *scalars, **flags, **step_flags, CHUNK=cfg["CHUNK"],
                                      CHUNKS_P2=triton.next_power_of_2(chunks), BLOCK=cfg["BLOCK"],
                                      num_warps=cfg["num_warps"])
