"""The two passes every server step is made of, shared by the functional ops, the accumulator and the stateful
optimizers:

1. a stats pass (:func:`client_stats`, or :func:`sum_stats` from sums) that reads the client rows once and
   gives the mean, per-client squared norms and non-finite flags, ``||mean||^2`` and the weighted mean
   squared norm;
2. the rule's scalars on the device (``rules.py``), :func:`check_finite`, then the rule's apply pass (a
   backend's ``momentum_apply`` or ``adam_apply``), which does nothing to params or state when the round is
   not finite.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch

from . import rules
from ._checks import check_number, normalized_weights
from .flat import Layout
from .rows import ClientRows, ParamRows, client_rows, compute_dtype


@dataclasses.dataclass
class RoundStats:
    """What the stats pass gives (tensors on the clients' device; scalars 0-d float64)."""

    mean: torch.Tensor            # [d], compute dtype
    sq_norms: torch.Tensor | None  # [M] float64 (None from sums alone)
    nonfinite: torch.Tensor       # [M] bool ([1] from sums: the sum itself)
    mean_sq: torch.Tensor         # ||mean||^2, or ||mean + aux_coef * aux||^2 when aux was given
    avg_sq: torch.Tensor          # sum_i p_i ||delta_i||^2
    num_clients: int
    form: Layout                  # one client's form, to give results back in it
    name: str                     # what the clients were called ("deltas", "models", "weighted_sum")


def run_stats(rows: ClientRows, coefs: torch.Tensor, backend, *, mean_init=None, aux=None, aux_coef: float = 0.0,
              mean_out: torch.Tensor | None = None):
    """One stats pass: ``(mean, sq_norms, nonfinite, mean_sq)`` with ``mean = init + sum_i coefs_i x_i``."""
    dev = rows.device
    mean = mean_out if mean_out is not None else torch.empty(rows.numel, dtype=compute_dtype(rows.dtype), device=dev)
    sq = torch.empty(rows.num_clients, dtype=torch.float64, device=dev)
    bad = torch.empty(rows.num_clients, dtype=torch.bool, device=dev)
    msq = torch.empty((), dtype=torch.float64, device=dev)
    backend.round_stats(rows=rows, weights=coefs, mean_init=mean_init, aux=aux, aux_coef=aux_coef, mean_out=mean,
                        sq_norms_out=sq, nonfinite_out=bad, mean_sq_out=msq)
    return mean, sq, bad, msq


def client_stats(rows: ClientRows, weights: Any, backend, *, name: str, aux=None, aux_coef: float = 0.0,
                 mean_out=None, sync: bool = True) -> RoundStats:
    """Stats of M client rows with weights normalized over the participants (``sync``: see normalized_weights)."""
    coefs = normalized_weights(weights, rows.num_clients, rows.device, sync=sync)
    mean, sq, bad, msq = run_stats(rows, coefs, backend, aux=aux, aux_coef=aux_coef, mean_out=mean_out)
    return RoundStats(mean, sq, bad, msq, (coefs * sq).sum(), rows.num_clients, rows.form, name)


def sum_stats(weighted_sum: Any, weighted_sq_norm_sum: Any, total_weight: Any, num_clients: Any, backend_of, *,
              name: str = "weighted_sum", aux=None, aux_coef: float = 0.0, mean_out=None) -> RoundStats:
    """Stats from sums alone: ``mean = weighted_sum / total_weight``, ``avg_sq = weighted_sq_norm_sum / total``.

    ``backend_of(device)`` resolves the backend once the sum's device is known.
    """
    if not isinstance(num_clients, numbers.Integral) or isinstance(num_clients, bool) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    total = check_number(total_weight, "total_weight", minimum=0.0, allow_equal=False)
    rows = client_rows([weighted_sum], name=name)
    dev = rows.device
    if isinstance(weighted_sq_norm_sum, torch.Tensor):
        sq_sum = weighted_sq_norm_sum.detach().to(device=dev, dtype=torch.float64).reshape(())
    else:
        sq_sum = torch.tensor(check_number(weighted_sq_norm_sum, "weighted_sq_norm_sum"), dtype=torch.float64,
                              device=dev)
    coefs = torch.full((1,), 1.0 / total, dtype=torch.float64, device=dev)
    mean, _, bad, msq = run_stats(rows, coefs, backend_of(dev), aux=aux, aux_coef=aux_coef, mean_out=mean_out)
    avg_sq = sq_sum / total
    return RoundStats(mean, None, bad | ~torch.isfinite(avg_sq), msq, avg_sq, int(num_clients), rows.form, name)


def check_finite(stats: RoundStats, eta: torch.Tensor, on_nonfinite: str) -> torch.Tensor:
    """The round's device flag; with ``on_nonfinite="raise"`` a ValueError naming the bad clients instead.

    ``"raise"`` reads the flag to the host: the one sync of such a call.
    """
    finite = rules.round_is_finite(stats.nonfinite, eta, stats.mean_sq)
    if on_nonfinite == "raise" and not bool(finite):
        bad = stats.nonfinite.cpu().nonzero().flatten().tolist()
        if bad:
            name = stats.name
            shown = ", ".join(f"{name}[{i}]" for i in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
            raise ValueError(f"{shown} contain NaN or Inf; nothing was updated "
                             "(on_nonfinite='skip' flags the round instead of raising)")
        raise ValueError(f"the round's statistics overflowed (eta={eta.item()!r}, "
                         f"||mean||^2={stats.mean_sq.item()!r}); nothing was updated")
    return finite


def like_params(params: ParamRows, flat: torch.Tensor) -> ParamRows:
    """A flat buffer seen through ``params``' segments (for eval/broadcast outputs in params' form)."""
    return ParamRows(params.segments.slice(flat), params.segments, flat.dtype, flat.device, params.form, None)


def device_scalar(value, like: torch.Tensor) -> torch.Tensor:
    """A 0-d float64 tensor on ``like``'s device (tensors are converted without a host sync)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=torch.float64).reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=like.device)
