"""FedExP's server step size (Jhunjhunwala et al., ICLR 2023, eq. 9) on device scalars, written once for the
functional :func:`fastagg.fedexp_step`, the :class:`fastagg.Accumulator`'s step and the FedExP family of
:mod:`fastagg.server`::

    eta = max(floor, scale * sum_i p_i ||delta_i||^2 / (||mean||^2 + eps_eff))     (floor 1, scale 1/2: eq. 9)

A handful of torch ops on 0-d tensors (no host sync); the statistics come from the stats pass.
"""
from __future__ import annotations

import torch

from ._checks import check_number

EPS_MODES = ("paper", "official")


def effective_eps(eps: float, num_clients: int, eps_mode: str) -> float:
    """FedExP's denominator term: ``eps`` (paper, eq. 9) or ``num_clients * eps`` (official code)."""
    if eps_mode not in EPS_MODES:
        raise ValueError(f"eps_mode must be one of {EPS_MODES}, got {eps_mode!r}")
    return eps * num_clients if eps_mode == "official" else eps


def fedexp_eta(avg_sq: torch.Tensor, mean_sq: torch.Tensor, eps_eff: float, *, scale: float = 0.5,
               floor: float = 1.0) -> torch.Tensor:
    """``eta = max(floor, scale * avg_sq / (mean_sq + eps_eff))`` in float64.

    A zero denominator means the mean update is zero (``mean_sq == 0`` and ``eps_eff == 0``); the step is then
    zero whatever eta is, and eta is reported as 1 (so all-zero deltas give 1, not NaN).
    """
    denom = mean_sq + eps_eff
    positive = denom > 0
    ratio = scale * avg_sq / torch.where(positive, denom, torch.ones_like(denom))
    return torch.where(positive, torch.clamp(ratio, min=floor), torch.ones_like(ratio))


def check_eps(eps, eps_mode: str, *, what: str = "fedexp_step") -> float:
    """``eps`` (finite, >= 0; required) and ``eps_mode`` checked as every FedExP entry point checks them."""
    if eps is None:
        raise TypeError(f"{what} needs eps (FedExP's denominator term, e.g. eps=1e-3)")
    eps = check_number(eps, "eps")
    if eps_mode not in EPS_MODES:
        raise ValueError(f"eps_mode must be one of {EPS_MODES}, got {eps_mode!r}")
    return eps
