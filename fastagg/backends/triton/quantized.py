"""int8 blockwise clients folded into a sum on the GPU (the definition: csrc/quantized.h). One program per tile of
columns adds every client's ``(coef_i * s_ib) * q_ij`` in client order (the C++ backend's arithmetic), writes the
sum once, and leaves per-program partials (squared norms, lowest code, the sum's squares) that are added in
program order on the device."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import address_table

_TILE = 1024


@triton.jit
def _int8_fold_kernel(code_ptrs, scale_ptrs, coef, init, out, part_sq, part_low, part_msq, M, d, block,
                      HAS_INIT: tl.constexpr, TILE: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid.to(tl.int64) * TILE + tl.arange(0, TILE).to(tl.int64)
    mask = cols < d
    if HAS_INIT:
        acc = tl.load(init + cols, mask=mask, other=0.0)
    else:
        acc = tl.zeros([TILE], dtype=out.dtype.element_ty)
    blocks = cols // block
    for i in range(M):
        q = tl.load(tl.load(code_ptrs + i).to(tl.pointer_type(tl.int8)) + cols, mask=mask, other=0).to(tl.int32)
        s = tl.load(tl.load(scale_ptrs + i).to(tl.pointer_type(tl.float32)) + blocks, mask=mask, other=0.0)
        s = s.to(tl.float64)
        cs = (tl.load(coef + i) * s).to(out.dtype.element_ty)
        acc += cs * q.to(out.dtype.element_ty)
        x = s * q.to(tl.float64)
        tl.store(part_sq + pid * M + i, tl.sum(x * x, axis=0))
        tl.store(part_low + pid * M + i, tl.min(q, axis=0))
    tl.store(out + cols, acc, mask=mask)
    a = acc.to(tl.float64)
    tl.store(part_msq + pid, tl.sum(tl.where(mask, a * a, 0.0), axis=0))


def int8_blockwise_fold(*, codes: list, scales: list, block: int, coef: torch.Tensor, init: torch.Tensor | None,
                        out: torch.Tensor, sq_out: torch.Tensor, bad_out: torch.Tensor,
                        msq_out: torch.Tensor) -> None:
    d, m, dev = out.numel(), len(codes), out.device
    programs = max(1, triton.cdiv(d, _TILE))
    part_sq = torch.zeros(programs, m, dtype=torch.float64, device=dev)
    part_low = torch.zeros(programs, m, dtype=torch.int32, device=dev)
    part_msq = torch.zeros(programs, dtype=torch.float64, device=dev)
    if d:
        _int8_fold_kernel[(programs,)](address_table([c.data_ptr() for c in codes], dev),
                                       address_table([s.data_ptr() for s in scales], dev), coef,
                                       init if init is not None else out, out, part_sq, part_low, part_msq, m, d,
                                       int(block), HAS_INIT=init is not None, TILE=_TILE)
    sq_out.copy_(part_sq.sum(0))
    bad_out.copy_(part_low.amin(0) < -127)
    msq_out.copy_(part_msq.sum())
