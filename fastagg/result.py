"""The end of a functional round: the apply pass, the buffers, and the :class:`RoundResult` handed back.

Shared by the functional API (:mod:`fastagg.ops`) and the :class:`~fastagg.Accumulator`'s own steps
(:mod:`fastagg.stream`): the step size is a rule ``(avg_sq, mean_sq, M) -> eta`` on device scalars
(:func:`fedexp_rule`, :func:`fixed_rule`), then ``w <- w + eta * mean`` and, for FedExP, the evaluation model
``w_new - (eta / 2) * mean`` in one apply pass that does nothing when the round is not finite.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import numpy as np
import torch

from . import _buffers
from ._checks import check_number, check_on_nonfinite
from .backends import resolve
from .fedexp_rule import check_eps, effective_eps, fedexp_eta
from .passes import (RoundStats, buffer_updates, check_finite, check_overflow, device_scalar, finish_writes,
                     like_params, overflow_counter, sum_stats)
from .rows import ParamRows, compute_dtype, param_rows

__all__ = ["RoundResult", "apply_and_package", "step_from_sums", "fedexp_rule", "fixed_rule"]


@dataclasses.dataclass
class RoundResult:
    """What a server step computed. Tensors live on the inputs' device (numpy arrays for numpy input).

    mean: ``sum_i p_i delta_i`` in the form of one client's update (flat, or per-layer views of ``mean_flat``).
    eta: the server step size (0-d, float64). ``update = eta * mean`` (computed on first access).
    sq_norms: ``||delta_i||^2`` of the unweighted deltas, float64 ``(M,)`` (None from sums alone).
    mean_sq_norm: ``||mean||^2``; avg_sq_norm: ``sum_i p_i ||delta_i||^2`` (0-d, float64).
    finite: 0-d bool, False when a client held NaN/Inf or the statistics overflowed (nothing was updated).
    nonfinite: per-client bool flags ``(M,)`` (None from sums alone).
    eval_params: FedExP's evaluation model ``(w + w_new)/2 = w_new - eta/2 * mean`` in ``params``' form, when
        ``params`` was given (None otherwise); a copy of the unchanged ``params`` when the round is not finite.
    """

    mean_flat: torch.Tensor
    eta: torch.Tensor
    sq_norms: torch.Tensor | None
    mean_sq_norm: torch.Tensor
    avg_sq_norm: torch.Tensor
    finite: torch.Tensor
    nonfinite: torch.Tensor | None
    num_clients: int
    eval_params: Any = None
    _form: Any = dataclasses.field(default=None, repr=False)

    @property
    def mean(self) -> Any:
        return _user_form(self.mean_flat, self._form)

    @functools.cached_property
    def update_flat(self) -> torch.Tensor:
        """``eta * mean`` as one flat tensor (zero when the round is not finite)."""
        m = self.mean_flat if isinstance(self.mean_flat, torch.Tensor) else torch.from_numpy(self.mean_flat)
        eta = torch.as_tensor(self.eta).to(m.dtype)
        u = torch.where(torch.as_tensor(self.finite), eta * m, torch.zeros_like(m))
        return u.numpy() if isinstance(self.mean_flat, np.ndarray) else u

    @property
    def update(self) -> Any:
        """``eta * mean``, the step to add to the global model, in the form of one client's update."""
        return _user_form(self.update_flat, self._form)


def _user_form(flat, form):
    return flat if form is None else form.unflatten(flat)


def _to_numpy(x):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, list):
        return [_to_numpy(v) for v in x]
    if isinstance(x, dict):
        return {k: _to_numpy(v) for k, v in x.items()}
    return x


def apply_and_package(stats: RoundStats, eta: torch.Tensor, *, params: ParamRows | None, want_eval: bool,
                      on_nonfinite: str, backend, eval_buf: torch.Tensor | None = None,
                      models: bool = False) -> RoundResult:
    """Check finiteness, run the apply pass ``w += eta * mean`` (and the evaluation model), average the buffers,
    package the result."""
    updates = [] if params is None else buffer_updates(params, stats, models=models)  # before any write
    finite = check_finite(stats, eta, on_nonfinite, dtype=None if params is None else compute_dtype(params.dtype))
    eval_params = None
    if params is not None:
        extra = None
        if want_eval:
            flat = eval_buf if eval_buf is not None else \
                _buffers.empty(params.segments.numel, params.dtype, params.device)
            extra = like_params(params, flat)
            eval_params = params.form.unflatten(flat)
            if params.form.numpy:
                eval_params = _to_numpy(eval_params)
        zero = device_scalar(0.0, eta)
        overflow = overflow_counter(stats.mean)
        backend.momentum_apply(params=params, mean=stats.mean, lr=eta, finite=finite, buf=None, momentum=0.0,
                               nesterov=False, extra_out=extra, extra_coef=-0.5 * eta, extra_coef_skip=zero,
                               overflow_out=overflow)
        finish_writes(params, stats, updates, finite)
        check_overflow(overflow, on_nonfinite, "params")
    per_client = stats.sq_norms is not None
    res = RoundResult(stats.mean, eta, stats.sq_norms, stats.mean_sq, stats.avg_sq, finite,
                      stats.nonfinite if per_client else None, stats.num_clients, eval_params,
                      None if stats.form.kind == "flat" else stats.form)
    if stats.form.numpy:
        for f in ("mean_flat", "eta", "sq_norms", "mean_sq_norm", "avg_sq_norm", "finite", "nonfinite"):
            setattr(res, f, _to_numpy(getattr(res, f)))
    return res


def fedexp_rule(eps: Any, eps_mode: str) -> Callable:
    """``(avg_sq, mean_sq, M) -> eta`` for FedExP with validated ``eps`` and ``eps_mode``."""
    eps = check_eps(eps, eps_mode)
    return lambda avg_sq, mean_sq, m: fedexp_eta(avg_sq, mean_sq, effective_eps(eps, m, eps_mode))


def fixed_rule(lr: Any) -> Callable:
    """``(avg_sq, mean_sq, M) -> lr`` as a device scalar."""
    lr = check_number(lr, "lr")
    return lambda avg_sq, mean_sq, m: device_scalar(lr, mean_sq)


def step_from_sums(weighted_sum, weighted_sq_norm_sum, total_weight, num_clients, *, eta_rule: Callable,
                   params=None, on_nonfinite: str = "raise", backend: str = "auto", want_eval: bool) -> RoundResult:
    """The shared path of every from-sums step: ``mean = weighted_sum / total_weight`` in one stats pass."""
    check_on_nonfinite(on_nonfinite)
    resolved = {}

    def backend_of(device):
        resolved["b"] = resolve(backend, device)
        return resolved["b"]

    p = param_rows(params) if params is not None else None
    stats = sum_stats(weighted_sum, weighted_sq_norm_sum, total_weight, num_clients, backend_of,
                      mean_dtype=None if p is None else compute_dtype(p.dtype))
    if p is not None:
        if p.segments.numel != stats.mean.numel():
            raise ValueError(f"params has {p.segments.numel} elements; expected {stats.mean.numel()} "
                             "(the size of weighted_sum)")
    eta = eta_rule(stats.avg_sq, stats.mean_sq, stats.num_clients)
    return apply_and_package(stats, eta, params=p, want_eval=want_eval, on_nonfinite=on_nonfinite,
                             backend=resolved["b"])
