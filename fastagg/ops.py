"""Functional entry points: validate once, normalize the inputs, pick a backend, run the two passes.

Every round runs as (1) a stats pass that reads the client rows once (mean, per-client squared norms,
||mean||^2, per-client non-finite flags), (2) the step size on device scalars (``rules.py``), and (3) an apply
pass over d-vectors that does nothing when the round is not finite. A bad round therefore never touches
``params``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import numpy as np
import torch

from . import _buffers
from ._checks import check_number, check_on_nonfinite, normalized_weights, out_buffer
from ._docs import share_docs
from .backends import resolve
from .compress.fold import (CompressedRows, check_batch, compressed_list, fold, nonfinite_scales, numel_of,
                           tensors_of)
from .flat import Layout
from ._aliasing import check_writes
from .passes import (RoundStats, buffer_updates, check_finite, check_overflow, client_stats, device_scalar,
                     like_params, overflow_counter, round_dtype, sum_stats, warn_unmatched_buffers,
                     write_buffers)
from .result import RoundResult, apply_and_package, fedexp_rule, fixed_rule, step_from_sums
from .rows import ClientRows, ParamRows, check_params_match, client_rows, compute_dtype, param_rows, round_reads, with_base

__all__ = ["RoundResult", "fedexp_step", "fedavg_step", "fedexp_step_from_sums"]


# ----------------------------------------------------------------------------------------------------------------


def prepare(deltas, models, params):
    """Client rows (with params attached as the base for ``models=``), params' rows, and the clients' name.
    Named clients (state_dicts) are matched to named params by entry name."""
    if (deltas is None) == (models is None):
        raise TypeError("pass exactly one of deltas= (client updates) or models= (full client models)")
    if models is not None:
        if params is None:
            raise TypeError("models= needs params= (the global model the client models started from)")
        p = param_rows(params)
        rows = client_rows(models, name="models", params=p)
        return with_base(rows, p), p, "models"
    p = param_rows(params) if params is not None else None
    rows = client_rows(deltas, name="deltas", params=p)
    if p is not None:
        check_params_match(p, rows)
    return rows, p, "deltas"


def _round_outputs(p: ParamRows | None, mean_out, eval_out, numel: int, cdt: torch.dtype, device, reads: list):
    """The round's mean and evaluation buffers (given or None), checked against what the round reads and writes."""
    mean_buf = out_buffer(mean_out, "mean_out", numel, cdt, device)
    eval_buf = None
    if eval_out is not None:
        if p is None:
            raise TypeError("eval_out= needs params= (the evaluation model is computed from the updated params)")
        eval_buf = out_buffer(eval_out, "eval_out", p.segments.numel, p.dtype, p.device)
    writes = [(f"params entry {k}", t) for k, t in enumerate(p.parts)] if p is not None else []
    writes += [(n, t) for n, t in (("mean_out", mean_buf), ("eval_out", eval_buf)) if t is not None]
    if writes:
        check_writes(writes, reads)
    return mean_buf, eval_buf


def _run(deltas, models, weights, params, on_nonfinite, backend_name, eta_rule: Callable, want_eval: bool,
         mean_out=None, eval_out=None, group=None):
    updates = compressed_list(deltas) if models is None else None
    if updates is not None:
        return _run_compressed(updates, weights, params, on_nonfinite, backend_name, eta_rule, want_eval, mean_out,
                               eval_out, group)
    try:
        check_on_nonfinite(on_nonfinite)
        if group is not None and models is None and params is not None and isinstance(deltas, (list, tuple)) \
                and not deltas:  # this rank holds no client this round (say, of compressed ones): a zero share
            from .distributed import no_clients

            p, name = param_rows(params), "deltas"
            rows = no_clients(p.segments, p.form, p.dtype, p.device)
        else:
            rows, p, name = prepare(deltas, models, params)
        cdt = round_dtype(rows.dtype, None if p is None else p.dtype)
        mean_buf, eval_buf = _round_outputs(p, mean_out, eval_out, rows.numel, cdt, rows.device,
                                            round_reads(rows))
        backend = resolve(backend_name, rows.device)
    except Exception as e:  # noqa: BLE001 (with a group: every other rank learns at once, then this one raises)
        if group is not None:
            from .distributed import fail_step

            fail_step(group, "clients", e)
        raise
    if group is None:
        stats = client_stats(rows, weights, backend, name=name, mean_out=mean_buf, sync=on_nonfinite == "raise",
                             mean_dtype=cdt)
    else:  # the clients of every rank of a torch.distributed group (fastagg.distributed)
        from .distributed import all_stats

        stats = all_stats(rows, weights, backend, group=group, name=name, mean_out=mean_buf,
                          sync=on_nonfinite == "raise", mean_dtype=cdt)
    eta = eta_rule(stats.avg_sq, stats.mean_sq, stats.num_clients)
    return apply_and_package(stats, eta, params=p, want_eval=want_eval, on_nonfinite=on_nonfinite, backend=backend,
                             eval_buf=eval_buf, models=name == "models")


def _run_compressed(deltas, weights, params, on_nonfinite, backend_name, eta_rule: Callable, want_eval: bool,
                    mean_out, eval_out, group=None) -> RoundResult:
    """The round on compressed clients (fastagg.compress): one sweep per format reads every client where it lies
    and writes the mean (``mean = sum_i p_i x~_i``, ``||x~_i||^2``, ``||mean||^2``), then the rule and the apply
    pass as for float clients. A client with a NaN/Inf scale or value makes the round non-finite
    (raised or skipped). With ``group``: each rank folds its own clients, then one all_reduce (all_stats)."""
    names = [f"deltas[{i}]" for i in range(len(deltas))]
    try:
        check_on_nonfinite(on_nonfinite)
        p = param_rows(params) if params is not None else None
        numel = p.segments.numel if p is not None else numel_of(deltas[0])
        dev = p.device if p is not None else deltas[0].device
        scans: dict = {}  # the sparse clients' C++ scan, shared by the two checks below
        check_batch(deltas, names, numel=numel, device=dev, where="the params" if p is not None else "deltas[0]",
                    scans=scans)
        cdt = round_dtype(torch.float32, None if p is None else p.dtype)
        reads = [(n + field, t) for n, u in zip(names, deltas) for field, t in tensors_of(u)]
        mean_buf, eval_buf = _round_outputs(p, mean_out, eval_out, numel, cdt, dev, reads)
        backend = resolve(backend_name, dev)
        if mean_buf is None:
            mean_buf = _buffers.empty(numel, cdt, dev)
    except Exception as e:  # noqa: BLE001 (with a group: every other rank learns at once, then this one raises)
        if group is not None:
            from .distributed import fail_step

            fail_step(group, "clients", e)
        raise
    if group is not None:
        from .distributed import all_stats

        rows = CompressedRows(deltas, names, numel=numel, device=dev,
                              form=p.form if p is not None else Layout.of(mean_buf))
        stats = all_stats(rows, weights, backend, group=group, name="deltas", mean_out=mean_buf,
                          sync=on_nonfinite == "raise", mean_dtype=cdt)
        eta = eta_rule(stats.avg_sq, stats.mean_sq, stats.num_clients)
        return apply_and_package(stats, eta, params=p, want_eval=want_eval, on_nonfinite=on_nonfinite,
                                 backend=backend, eval_buf=eval_buf)
    m = len(deltas)
    coefs = normalized_weights(weights, m, dev, sync=on_nonfinite == "raise")
    nonfinite = torch.zeros(m, dtype=torch.bool, device=dev)
    bad = nonfinite_scales(deltas, names, scans)
    if bad:  # no kernel reads a NaN scale: the round is not finite, raised or skipped below
        nonfinite[bad] = True
        mean_buf.zero_()
        sq = torch.full((m,), float("nan"), dtype=torch.float64, device=dev)
        msq = torch.full((), float("nan"), dtype=torch.float64, device=dev)
    else:
        sq, msq = fold(deltas, names, coefs, backend, init=None, out=mean_buf)
    form = p.form if p is not None else Layout.of(mean_buf)
    stats = RoundStats(mean_buf, sq, nonfinite, msq, (coefs * sq).sum(), m, form, "deltas")
    stats.coefs = coefs
    eta = eta_rule(stats.avg_sq, stats.mean_sq, m)
    return apply_and_package(stats, eta, params=p, want_eval=want_eval, on_nonfinite=on_nonfinite, backend=backend,
                             eval_buf=eval_buf)


@share_docs
def fedexp_step(deltas=None, eps=None, *, models=None, weights=None, params=None, eps_mode: str = "paper",
                on_nonfinite: str = "raise", backend: str = "auto", mean_out=None, eval_out=None,
                group=None) -> RoundResult:
    """One FedExP server step (Jhunjhunwala et al., ICLR 2023, Algorithm 1, eq. 9)::

        mean   = sum_i p_i delta_i
        eta    = max(1, sum_i p_i ||delta_i||^2 / (2 (||mean||^2 + eps)))     (0/0 -> 1)
        params <- params + eta * mean                                         (if params is given)
        eval   = params_new - (eta / 2) * mean                                (average of the last two iterates)

    Args:
        {deltas}
        {eps}
        {models}
        {weights}
        {params}
        {eps_mode}
        {on_nonfinite}
        {backend}
        {mean_out}
        eval_out: optional preallocated flat buffer (``params``' dtype, d elements) for ``eval_params``.
        group: a torch.distributed process group whose ranks each hold some of the round's clients: the statistics
            are reduced over all of them and every rank takes the same step (:mod:`fastagg.distributed`).

    Returns:
        :class:`RoundResult` with ``eta``, ``update``, ``mean``, ``sq_norms``, ``mean_sq_norm``, ``avg_sq_norm``,
        ``finite``, ``nonfinite`` and, with ``params``, ``eval_params`` (the model to evaluate).

    {numerics}

    Example::

        deltas = torch.randn(20, 1_000_000)
        res = fastagg.fedexp_step(deltas, eps=1e-3)
        w += res.update            # or: fastagg.fedexp_step(deltas, eps=1e-3, params=w)
    """
    rule = fedexp_rule(eps, eps_mode)
    return _run(deltas, models, weights, params, on_nonfinite, backend, rule, want_eval=True, mean_out=mean_out,
                eval_out=eval_out, group=group)


@share_docs
def fedavg_step(deltas=None, lr: float = 1.0, *, models=None, weights=None, params=None,
                on_nonfinite: str = "raise", backend: str = "auto", mean_out=None, group=None) -> RoundResult:
    """One FedAvg server step::

        mean   = sum_i p_i delta_i
        params <- params + lr * mean            (lr = 1: plain model averaging)

    ``result.eta`` is ``lr``; the norms are computed in the same single pass over the deltas at no extra cost.

    Args:
        {deltas}
        lr: server learning rate (finite, >= 0).
        {models}
        {weights}
        {params}
        {on_nonfinite}
        {backend}
        {mean_out}
        group: a torch.distributed process group whose ranks each hold some of the round's clients
            (:mod:`fastagg.distributed`).

    {numerics}

    Example::

        fastagg.fedavg_step(deltas, lr=1.0, weights=num_examples, params=w)
    """
    return _run(deltas, models, weights, params, on_nonfinite, backend, fixed_rule(lr), want_eval=False,
                mean_out=mean_out, group=group)


@share_docs
def fedexp_step_from_sums(weighted_sum, weighted_sq_norm_sum, total_weight, num_clients, eps=None, *,
                          eps_mode: str = "paper", params=None, on_nonfinite: str = "raise",
                          backend: str = "auto") -> RoundResult:
    """FedExP from sums alone (secure aggregation reveals only these; the result is exact, not approximate)::

        mean   = weighted_sum / total_weight               weighted_sum = sum_i n_i delta_i
        avg_sq = weighted_sq_norm_sum / total_weight       weighted_sq_norm_sum = sum_i n_i ||delta_i||^2
        eta    = max(1, avg_sq / (2 (||mean||^2 + eps)))   (eps_mode "official": + num_clients * eps)

    Args:
        weighted_sum: ``sum_i n_i delta_i`` (flat or per-layer, tensor or numpy); never modified.
        weighted_sq_norm_sum: ``sum_i n_i ||delta_i||^2`` (number or 0-d tensor).
        total_weight: ``sum_i n_i`` (> 0). num_clients: M, the participants (for ``eps_mode="official"``).
        {eps}
        {eps_mode}
        {params}
        {on_nonfinite}
        {backend}

    ``sq_norms`` and ``nonfinite`` of the result are None (no per-client data).

    {numerics}

    Example::

        fastagg.fedexp_step_from_sums(s, sq, 1500.0, 3, eps=1e-3, params=w)
    """
    rule = fedexp_rule(eps, eps_mode)
    return step_from_sums(weighted_sum, weighted_sq_norm_sum, total_weight, num_clients, eta_rule=rule,
                          params=params, on_nonfinite=on_nonfinite, backend=backend, want_eval=True)
