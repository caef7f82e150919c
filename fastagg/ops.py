"""The functional API: one server round as one call -- ``fedexp_step``, ``fedavg_step``, ``fedexp_step_from_sums``.

Every round runs as (1) a stats pass that reads the client rows once (mean, per-client squared norms,
||mean||^2, per-client non-finite flags; :mod:`fastagg.inputs` turns any input form into it), (2) the step size on
device scalars (:mod:`fastagg.fedexp_rule`), and (3) an apply pass over d-vectors that does nothing when the round
is not finite (:mod:`fastagg.result`). A bad round therefore never touches ``params``.
"""
from __future__ import annotations

from typing import Callable

from ._docs import share_docs
from .inputs import functional_stats
from .result import RoundResult, apply_and_package, fedexp_rule, fixed_rule, step_from_sums

__all__ = ["RoundResult", "fedexp_step", "fedavg_step", "fedexp_step_from_sums"]


def _run(deltas, models, weights, params, on_nonfinite, backend_name, eta_rule: Callable, want_eval: bool,
         mean_out=None, eval_out=None, group=None) -> RoundResult:
    stats, p, backend, eval_buf = functional_stats(deltas, models, weights, params, on_nonfinite=on_nonfinite,
                                                   backend_name=backend_name, group=group, mean_out=mean_out,
                                                   eval_out=eval_out)
    eta = eta_rule(stats.avg_sq, stats.mean_sq, stats.num_clients)
    return apply_and_package(stats, eta, params=p, want_eval=want_eval, on_nonfinite=on_nonfinite, backend=backend,
                             eval_buf=eval_buf, models=stats.name == "models")


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
