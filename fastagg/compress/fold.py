"""One sweep over int8 blockwise clients, shared by the Accumulator and the functional round (above the backends):
the checks every backend relies on, then the backend's ``int8_blockwise_fold`` (csrc/quantized.h)."""
from __future__ import annotations

import torch

from .int8 import Int8Blockwise, check_format


def is_compressed(x) -> bool:
    """True for a non-empty list or tuple of :class:`Int8Blockwise` (refused when only some are)."""
    if not isinstance(x, (list, tuple)) or not x or not any(isinstance(u, Int8Blockwise) for u in x):
        return False
    if not all(isinstance(u, Int8Blockwise) for u in x):
        raise TypeError("clients of one kind per call: compressed and float updates cannot be mixed in one list "
                        "(an Accumulator takes both, in separate adds)")
    return True


def check_batch(updates: list, names: list, *, numel: int, device: torch.device, where: str) -> int:
    """Formats, sizes, devices and one shared block; returns the block."""
    for u, name in zip(updates, names):
        check_format(u, name)
        if u.numel != numel:
            raise ValueError(f"{name} has {u.numel} elements; {where} has {numel}")
        if u.device != torch.device(device):
            raise ValueError(f"{name} is on {u.device}; {where} is on {device}")
    blocks = sorted({u.block for u in updates})
    if len(blocks) > 1:
        raise ValueError(f"the updates of one call must share a block size, got {blocks}")
    return blocks[0]


def nonfinite_scales(updates: list, names: list) -> list:
    """Indices of the updates with a NaN or Inf scale; raises naming the first update with a scale <= 0."""
    every = torch.cat([u.scales for u in updates])
    if bool((torch.isfinite(every) & (every > 0)).all()):  # the usual case: one check, one host read
        return []
    bad = []
    for j, (u, name) in enumerate(zip(updates, names)):
        if not bool(torch.isfinite(u.scales).all()):
            bad.append(j)
        elif not bool((u.scales > 0).all()):
            b = int((u.scales <= 0).nonzero()[0])
            raise ValueError(f"{name}: the scale of block {b} is {float(u.scales[b])!r} (scales must be > 0)")
    return bad


def fold(updates: list, names: list, block: int, coef: torch.Tensor, backend, *, init: torch.Tensor | None,
         out: torch.Tensor) -> tuple:
    """``out = init + sum_i coef_i x~_i``; returns ``(sq_norms [M] float64, mean_sq 0-d float64)`` where
    ``sq_norms_i = ||x~_i||^2`` and ``mean_sq = ||out||^2``. Raises naming the updates holding the code -128 (out
    is then garbage: callers write into a spare buffer)."""
    m, dev = len(updates), out.device
    sq = torch.empty(m, dtype=torch.float64, device=dev)
    bad = torch.empty(m, dtype=torch.bool, device=dev)
    msq = torch.empty((), dtype=torch.float64, device=dev)
    backend.int8_blockwise_fold(codes=[u.codes for u in updates], scales=[u.scales for u in updates], block=block,
                                coef=coef, init=init, out=out, sq_out=sq, bad_out=bad, msq_out=msq)
    if bool(bad.any()):
        who = ", ".join(names[j] for j in bad.nonzero().flatten().tolist())
        raise ValueError(f"{who} holds the code -128 (int8 blockwise codes lie in [-127, 127])")
    return sq, msq
