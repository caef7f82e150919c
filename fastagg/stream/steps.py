"""The Accumulator's steps: the stats pass over its sums (``mean = weighted_sum / total_weight``, every client's
squared norm, the buffers' averages), and the functional step that applies a rule's ``eta`` to params
(:mod:`fastagg.result`)."""
from __future__ import annotations

import math

import torch

from .. import result
from .._aliasing import check_writes
from .._checks import check_on_nonfinite
from ..passes import RoundStats, sum_stats
from ..rows import Buffers, compute_dtype, param_rows


def round_stats(acc, backend_of, *, aux=None, aux_coef: float = 0.0, mean_out=None,
                mean_dtype: torch.dtype | None = None, keep_mean: bool = True) -> RoundStats:
    """:meth:`fastagg.Accumulator.round_stats`, under ``acc``'s lock."""
    with acc._lock:
        check_ready(acc)
        r = acc._round
        stats = sum_stats(acc.weighted_sum, r.weighted_sq if acc._client_norms else None, r.total_weight,
                          acc.num_clients, backend_of, name="accumulator", aux=aux, aux_coef=aux_coef,
                          mean_out=mean_out, mean_dtype=mean_dtype, keep_mean=keep_mean)
        if not keep_mean:
            stats.mean_sum = acc._written_sum()
        stats.sq_norms = r.norm_tensor(acc.device) if acc._client_norms else \
            torch.full((r.n,), math.nan, dtype=torch.float64, device=acc.device)
        if acc._buffer_names:
            stats.buffers = Buffers(acc._buffer_names, [])
            stats.buffer_sums = [None if s is None else s / r.total_weight for s in r.buffer_sums]
        return stats


def check_ready(acc) -> None:
    if acc.num_clients == 0:
        raise ValueError("the accumulator is empty: add() at least one client first")
    if not acc.total_weight > 0:
        raise ValueError("the accumulator's total weight is 0: at least one client needs a positive weight")


def from_sums(acc, rule, *, params, on_nonfinite, want_eval, group=None) -> result.RoundResult:
    """One functional step of ``rule`` (``(avg_sq, mean_sq, M) -> eta``) on ``acc``'s sums (with ``group``: every
    rank's, :func:`fastagg.distributed.accumulator_stats`), applied to ``params`` when given."""
    check_on_nonfinite(on_nonfinite)
    p = None
    if params is not None:
        p = param_rows(params)
        if p.segments.numel != acc._numel:
            raise ValueError(f"params has {p.segments.numel} elements; expected {acc._numel} like the "
                             "accumulator's `like`")
    with acc._lock:
        if p is not None:
            check_writes([(f"params entry {k}", t) for k, t in enumerate(p.parts)], acc._state_reads())
        mean_dtype = None if p is None else compute_dtype(p.dtype)
        if group is None:
            stats = acc.round_stats(lambda device: acc._backend, mean_dtype=mean_dtype,
                                    mean_out=acc._take_spare(mean_dtype or acc._sum.dtype))
        else:  # every rank's accumulator (fastagg.distributed)
            # loaded by the first step over a group, so that ``import fastagg`` (which imports this module) stays
            # light (tests/test_user_habits.py pins it); a downward import, as fastagg/inputs.py's
            from ..distributed import accumulator_stats

            stats = accumulator_stats(acc, lambda device: acc._backend, group=group, mean_dtype=mean_dtype)
        eta = rule(stats.avg_sq, stats.mean_sq, stats.num_clients)
        res = result.apply_and_package(stats, eta, params=p, want_eval=want_eval, on_nonfinite=on_nonfinite,
                                       backend=acc._backend)
    res.nonfinite = torch.zeros(stats.num_clients, dtype=torch.bool, device=acc.device)
    res.sq_norms = stats.sq_norms
    if acc._form.numpy:
        res.sq_norms, res.nonfinite = stats.sq_norms.numpy(), res.nonfinite.numpy()
    return res
