"""QSGD (Alistarh et al., NeurIPS 2017): ``s`` levels, norm-scaled, stochastic, unbiased; stored in the int8
blockwise layout (:class:`.int8.Int8Blockwise`), so every fold reads it as it reads int8.

Bucket ``b`` (``bucket`` consecutive elements; the whole update by default, as in the paper's Algorithm 1) stores
``s_b = ||x_b||_2 / s`` (float32, rounded up so that ``|x_j| / s_b <= s``; ``1.0`` for an all-zero bucket) and the
codes ``q_j = sign(x_j) * l_j`` with levels ``l_j = floor(|x_j| / s_b + u_j)`` in [0, s], ``u_j`` uniform from
Philox4x32-10 keyed by ``(seed, round, client)``: ``E[s_b q_j] = x_j`` (unbiased) and
``E||x~ - x||^2 <= min(d / s^2, sqrt(d) / s) ||x||^2`` (the paper's Lemma 3.1 with its bucket size). ``s`` in
[1, 127]. Bytes: d + 4 * ceil(d / bucket) (the paper's Elias coding of the levels is not applied). A bucket whose
``s_b * s`` lies beyond float32 (norms beyond float32's range) raises naming it: the server would refuse its codes.
"""
from __future__ import annotations

from typing import Any

import torch

from .._checks import check_int
from .blockwise import as_rows, check_block, check_keys, check_representable, tiles, uniforms
from .int8 import Int8Blockwise

__all__ = ["quantize_qsgd", "quantize_qsgd_rows"]


def quantize_qsgd(update: Any, s: int = 16, *, bucket: int | None = None, seed: int = 0, round: int = 0,
                  client: int = 0) -> Int8Blockwise:
    """``update`` (a flat tensor, a list of tensors, a state_dict or a module's parameters) quantized by QSGD with
    ``s`` levels per sign (module docstring); ``bucket`` elements per norm (default: the whole update)."""
    if isinstance(update, torch.Tensor) and update.dim() == 2:
        raise ValueError("quantize_qsgd takes one update; quantize_qsgd_rows takes an [M, d] batch")
    return quantize_qsgd_rows(as_rows(update), s, bucket=bucket, seed=seed, round=round, clients=[client])[0]


def quantize_qsgd_rows(rows: torch.Tensor, s: int = 16, *, bucket: int | None = None, seed: int = 0, round: int = 0,
                       clients: list | None = None) -> list:
    """Each row of an ``[M, d]`` batch quantized as :func:`quantize_qsgd` (row ``i`` keyed by ``clients[i]``,
    default ``i``), in one vectorized pass."""
    s = check_int(s, "QSGD's levels s", minimum=1, maximum=127, what="an integer in [1, 127] (int8 codes)")
    x = as_rows(rows, "the updates")
    m, d = x.shape
    block = check_block(max(1, d) if bucket is None else bucket)
    clients = list(range(m)) if clients is None else list(clients)
    seed, round, clients = check_keys(seed, round, clients)
    if len(clients) != m:
        raise ValueError(f"{m} rows but {len(clients)} client ids")
    t = tiles(x, block)
    norm = t.square().sum(dim=2).sqrt()
    scales = torch.where(norm > 0, norm / s, torch.ones_like(norm)).to(torch.float32)
    short = scales.to(torch.float64) * s < norm  # rounded down to float32: one step up keeps |x| / s_b <= s
    scales = torch.where(short, torch.nextafter(scales, torch.full_like(scales, float("inf"))), scales)
    check_representable(scales, float(s), "the updates")  # levels reach s: s_b * s must be a float32
    u = uniforms((m, t[0].numel()), seed=seed, round=round, clients=clients, device=x.device).view_as(t)
    levels = torch.floor(t.abs() / scales.to(torch.float64)[:, :, None] + u).clamp_(max=s)
    codes = (torch.sign(t) * levels).reshape(m, -1)[:, :d].to(torch.int8)
    return [Int8Blockwise(codes[i].contiguous(), scales[i].contiguous(), block) for i in range(m)]
