"""The reference backend: plain torch, written to be read, float64-capable. It is the oracle that every
other backend and every benchmark is checked against (run it on float64 copies for the fp64 truth).

Each primitive has the same keyword-only signature in every backend; ``ops.py`` validates before calling.
"""
from __future__ import annotations

import torch

from ..rows import ClientRows, ParamRows

name = "reference"


@torch.no_grad()
def round_stats(*, rows: ClientRows, weights: torch.Tensor, mean_init: torch.Tensor | None, mean_out: torch.Tensor,
                sq_norms_out: torch.Tensor, nonfinite_out: torch.Tensor, mean_sq_out: torch.Tensor) -> None:
    """mean = init + sum_i w_i (x_i - base); sq_norms[i] = ||x_i - base||^2; nonfinite[i]; mean_sq = ||mean||^2.

    ``init`` (a running sum, for the streaming accumulator) and ``base`` (full client models) are optional.
    """
    cdt = mean_out.dtype
    sq = torch.zeros(rows.num_clients, dtype=torch.float64, device=mean_out.device)
    bad = torch.zeros(rows.num_clients, dtype=torch.bool, device=mean_out.device)
    for s, (off, n) in enumerate(zip(rows.segments.offs, rows.segments.lens)):
        x = torch.stack([r.to(cdt) for r in rows.rows[s]])  # [M, n]
        if rows.base is not None:
            x = x - rows.base[s].to(cdt)
        seg_mean = weights.to(cdt) @ x
        if mean_init is not None:
            seg_mean = mean_init[off : off + n] + seg_mean
        mean_out[off : off + n] = seg_mean
        sq += x.square().double().sum(dim=1)  # squares in the compute dtype, like every backend
        bad |= ~torch.isfinite(x).all(dim=1)
    mean_sq_out.copy_(mean_out.double().square().sum())
    sq_norms_out.copy_(sq)
    nonfinite_out.copy_(bad)


@torch.no_grad()
def apply_update(*, params: ParamRows, mean: torch.Tensor, eta: torch.Tensor, finite: torch.Tensor,
                 eval_out: ParamRows | None, eval_scale: float) -> None:
    """If finite: w <- w + eta * mean; eval = w_new - eval_scale * eta * mean (from w_new before rounding).

    If not finite: w untouched, eval = w.
    """
    if not bool(finite):
        if eval_out is not None:
            for e, w in zip(eval_out.parts, params.parts):
                e.copy_(w)
        return
    cdt = mean.dtype
    eta_c = eta.to(cdt)
    for s, (off, n) in enumerate(zip(params.segments.offs, params.segments.lens)):
        m = mean[off : off + n]
        w_new = params.parts[s].to(cdt) + eta_c * m
        params.parts[s].copy_(w_new)
        if eval_out is not None:
            eval_out.parts[s].copy_(w_new - (eval_scale * eta_c) * m)
