"""Streaming aggregation: fold one client at a time into O(d) state, so a server never holds M updates.

FedExP needs only ``sum_i n_i delta_i``, ``sum_i n_i ||delta_i||^2``, ``sum_i n_i`` and M, so the streamed
step is exact (the same formula as the batched call; equal to float32 rounding).
"""
from __future__ import annotations

from typing import Any

import torch

from . import ops
from ._checks import check_number, check_on_nonfinite, expect_like
from .passes import RoundStats, run_stats, sum_stats
from ._docs import share_docs
from .backends import resolve
from .flat import Layout
from .rows import client_rows, compute_dtype, param_rows


class Accumulator:
    """Running sums of weighted client updates.

    State (on ``like``'s device): ``weighted_sum = sum_i n_i delta_i`` (float32; float64 for float64 data),
    ``weighted_sq_norm_sum = sum_i n_i ||delta_i||^2`` (float64, 0-d), ``total_weight = sum_i n_i``, the
    number of clients, and each client's ``||delta_i||^2`` (M scalars).

    ``add`` reads each delta once and writes the new sum into a second buffer, which replaces the first only
    if the delta was finite: a rejected client leaves the accumulator exactly as it was. Memory: two d-vectors;
    traffic per client: read delta, read sum, write sum. Deciding acceptance reads one flag to the host (on CUDA,
    ``add``'s only sync).

    Example::

        acc = fastagg.Accumulator(like=w)
        for delta_i, n_i in arriving_updates:
            acc.add(delta_i, weight=n_i)
        res = acc.fedexp_step(eps=1e-3, params=w)
    """

    def __init__(self, like: Any, *, backend: str = "auto"):
        rows = client_rows([like], name="like")
        self._form: Layout = rows.form
        self._numel = rows.numel
        self._dtype = rows.dtype
        self.device = rows.device
        self._backend_name = backend
        self._backend = resolve(backend, rows.device)
        cdt = compute_dtype(rows.dtype)
        self._sum = torch.zeros(rows.numel, dtype=cdt, device=rows.device)
        self._scratch = torch.empty_like(self._sum)
        self.reset()

    def reset(self) -> None:
        """Forget every client (start a new round)."""
        self._sum.zero_()
        self._sq_norms: list = []
        self._weighted_sq = torch.zeros((), dtype=torch.float64, device=self.device)
        self.total_weight = 0.0

    @property
    def num_clients(self) -> int:
        return len(self._sq_norms)

    @property
    def weighted_sum(self) -> Any:
        """``sum_i n_i delta_i`` in the form of one update (views of the internal buffer; do not modify)."""
        return self._form.unflatten(self._sum.numpy() if self._form.numpy else self._sum)

    @property
    def weighted_sq_norm_sum(self) -> torch.Tensor:
        return self._weighted_sq

    @property
    def sq_norms(self) -> torch.Tensor:
        """``||delta_i||^2`` of every client added so far, float64 ``(M,)``."""
        if not self._sq_norms:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        return torch.stack(self._sq_norms)

    def add(self, delta: Any, weight: float = 1.0, *, on_nonfinite: str = "raise") -> bool:
        """Fold one client in: ``sum += weight * delta``; ``sq_sum += weight * ||delta||^2``.

        ``delta`` has the form, size, dtype and device of ``like``; ``weight`` is a finite number >= 0 (example
        count). A delta with NaN/Inf raises ``ValueError`` (``on_nonfinite="raise"``) or is dropped
        (``"skip"``); either way the accumulator is unchanged. Returns True when the client was folded in.
        """
        check_on_nonfinite(on_nonfinite)
        w = check_number(weight, "weight")
        rows = client_rows([delta], name="delta")
        expect_like("delta", "the accumulator's `like`", numel=(rows.numel, self._numel),
                    dtype=(rows.dtype, self._dtype), device=(rows.device, self.device))
        coef = torch.full((1,), w, dtype=torch.float64, device=self.device)
        _, sq, bad, _ = run_stats(rows, coef, self._backend, mean_init=self._sum, mean_out=self._scratch)
        if bool(bad[0]):  # add()'s one host read
            if on_nonfinite == "raise":
                raise ValueError(f"delta (client {self.num_clients}) contains NaN or Inf; the accumulator is unchanged")
            return False
        self._sum, self._scratch = self._scratch, self._sum
        self._sq_norms.append(sq[0])
        self._weighted_sq = self._weighted_sq + w * sq[0]
        self.total_weight += w
        return True

    def _check_ready(self) -> None:
        if self.num_clients == 0:
            raise ValueError("the accumulator is empty: add() at least one client first")
        if not self.total_weight > 0:
            raise ValueError("the accumulator's total weight is 0: at least one client needs a positive weight")

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._sum.dtype

    def round_stats(self, backend_of, *, aux=None, aux_coef: float = 0.0, mean_out=None) -> RoundStats:
        """The stats pass over the accumulated sums (``mean = weighted_sum / total_weight``), with every added
        client's squared norm. Used by the steps below and by the server optimizers."""
        self._check_ready()
        stats = sum_stats(self.weighted_sum, self._weighted_sq, self.total_weight, self.num_clients, backend_of,
                          name="accumulator", aux=aux, aux_coef=aux_coef, mean_out=mean_out)
        stats.sq_norms = self.sq_norms
        return stats

    def _from_sums(self, rule, *, params, on_nonfinite, want_eval) -> ops.RoundResult:
        check_on_nonfinite(on_nonfinite)
        stats = self.round_stats(lambda device: self._backend)
        p = None
        if params is not None:
            p = param_rows(params)
            if p.segments.numel != self._numel:
                raise ValueError(f"params has {p.segments.numel} elements; expected {self._numel} like the "
                                 "accumulator's `like`")
        eta = rule(stats.avg_sq, stats.mean_sq, stats.num_clients)
        res = ops.apply_and_package(stats, eta, params=p, want_eval=want_eval, on_nonfinite=on_nonfinite,
                                    backend=self._backend)
        res.nonfinite = torch.zeros(self.num_clients, dtype=torch.bool, device=self.device)
        if self._form.numpy:
            res.sq_norms, res.nonfinite = self.sq_norms.numpy(), res.nonfinite.numpy()
        return res

    @share_docs
    def fedexp_step(self, eps=None, *, eps_mode: str = "paper", params=None,
                    on_nonfinite: str = "raise") -> ops.RoundResult:
        """FedExP from the accumulated sums (see :func:`fastagg.fedexp_step_from_sums`)::

            mean = weighted_sum / total_weight
            eta  = max(1, (weighted_sq_norm_sum / total_weight) / (2 (||mean||^2 + eps)))

        Args:
            {eps}
            {eps_mode}
            {params}
            {on_nonfinite}
        """
        rule = ops.fedexp_rule(eps, eps_mode)
        return self._from_sums(rule, params=params, on_nonfinite=on_nonfinite, want_eval=True)

    def fedavg_step(self, lr: float = 1.0, *, params=None, on_nonfinite: str = "raise") -> ops.RoundResult:
        """FedAvg from the accumulated sums: ``params <- params + lr * weighted_sum / total_weight``."""
        return self._from_sums(ops.fixed_rule(lr), params=params, on_nonfinite=on_nonfinite, want_eval=False)


__all__ = ["Accumulator"]
