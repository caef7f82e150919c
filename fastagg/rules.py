"""Server step-size rules on device scalars, written once above the backends.

These run as a handful of torch ops on 0-d tensors (no host sync). The round statistics they consume come
from a backend's ``round_stats``.
"""
from __future__ import annotations

import torch

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


def round_is_finite(nonfinite: torch.Tensor, eta: torch.Tensor, mean_sq: torch.Tensor) -> torch.Tensor:
    """Device bool: no client flagged non-finite, and eta and ||mean||^2 finite (no overflow)."""
    return ~nonfinite.any() & torch.isfinite(eta) & torch.isfinite(mean_sq)
