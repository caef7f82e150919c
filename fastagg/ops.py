"""Functional entry points: validate once, normalize the inputs, pick a backend, run the two passes.

Every round runs as (1) a stats pass that reads the client rows once (mean, per-client squared norms,
||mean||^2, per-client non-finite flags), (2) the step size on device scalars (``rules.py``), and (3) an apply
pass over d-vectors that does nothing when the round is not finite. A bad round therefore never touches
``params``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Callable

import numpy as np
import torch

from . import rules
from ._docs import share_docs
from .backends import resolve
from .flat import as_tensor
from .rows import ClientRows, ParamRows, Segments, client_rows, compute_dtype, param_rows, with_base, check_params_match

ON_NONFINITE = ("raise", "skip")

__all__ = ["RoundResult", "fedexp_step", "fedavg_step", "fedexp_step_from_sums"]


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


# ----------------------------------------------------------------------------------------------------------------
# validation helpers


def _check_on_nonfinite(on_nonfinite: str) -> None:
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")


def _check_number(value: Any, name: str, *, minimum: float = 0.0, allow_equal: bool = True) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    ok = math.isfinite(value) and (value >= minimum if allow_equal else value > minimum)
    if not ok:
        op = ">=" if allow_equal else ">"
        raise ValueError(f"{name} must be a finite number {op} {minimum:g}, got {value!r}")
    return value


def normalized_weights(weights: Any, num_clients: int, device: torch.device) -> torch.Tensor:
    """``p_i = n_i / sum_j n_j`` as float64 on ``device`` (``1/M`` each when ``weights`` is None)."""
    if weights is None:
        return torch.full((num_clients,), 1.0 / num_clients, dtype=torch.float64, device=device)
    if isinstance(weights, torch.Tensor):
        w = weights.detach().to(torch.float64)
    else:
        try:
            w = torch.as_tensor(np.asarray(weights, dtype=np.float64))
        except (TypeError, ValueError) as e:
            raise TypeError(f"weights must be numbers, got {weights!r}") from e
    if tuple(w.shape) != (num_clients,):
        raise ValueError(f"weights must have shape ({num_clients},), got {tuple(w.shape)}")
    host = w.cpu()
    bad = (~torch.isfinite(host)) | (host < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"weights[{i}] is {host[i].item()!r}; weights must be finite and >= 0")
    total = host.sum()
    if not total > 0:
        raise ValueError("weights are all zero; at least one participant needs a positive weight")
    return (w / w.sum()).to(device)


# ----------------------------------------------------------------------------------------------------------------
# the two passes


@dataclasses.dataclass
class _Stats:
    mean: torch.Tensor
    sq_norms: torch.Tensor
    nonfinite: torch.Tensor
    mean_sq: torch.Tensor


def round_stats(rows: ClientRows, coefs: torch.Tensor, backend, *, mean_init: torch.Tensor | None = None,
                mean_out: torch.Tensor | None = None) -> _Stats:
    """Run the stats pass: ``mean = init + sum_i coefs_i (x_i - base)``, per-row norms and flags, ``||mean||^2``."""
    dev = rows.device
    mean = mean_out if mean_out is not None else torch.empty(rows.numel, dtype=compute_dtype(rows.dtype), device=dev)
    stats = _Stats(mean, torch.empty(rows.num_clients, dtype=torch.float64, device=dev),
                   torch.empty(rows.num_clients, dtype=torch.bool, device=dev),
                   torch.empty((), dtype=torch.float64, device=dev))
    backend.round_stats(rows=rows, weights=coefs, mean_init=mean_init, mean_out=stats.mean,
                        sq_norms_out=stats.sq_norms, nonfinite_out=stats.nonfinite, mean_sq_out=stats.mean_sq)
    return stats


def _raise_nonfinite(stats: _Stats, eta: torch.Tensor, name: str) -> None:
    bad = stats.nonfinite.cpu().nonzero().flatten().tolist()
    if bad:
        shown = ", ".join(f"{name}[{i}]" for i in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise ValueError(f"{shown} contain NaN or Inf; nothing was updated "
                         "(on_nonfinite='skip' flags the round instead of raising)")
    raise ValueError(f"the round's statistics overflowed (eta={eta.item()!r}, ||mean||^2={stats.mean_sq.item()!r}); "
                     "nothing was updated")


def finish_round(stats: _Stats, *, avg_sq: torch.Tensor, eta: torch.Tensor, params: ParamRows | None,
                 want_eval: bool, on_nonfinite: str, backend, form, numpy_out: bool, num_clients: int,
                 per_client: bool = True, name: str = "deltas", eval_buf: torch.Tensor | None = None) -> RoundResult:
    """Decide finiteness, apply the step (apply pass), and package the result."""
    finite = rules.round_is_finite(stats.nonfinite, eta, stats.mean_sq)
    if on_nonfinite == "raise" and not bool(finite):  # the one host read of a "raise" call
        _raise_nonfinite(stats, eta, name)
    eval_params = None
    if params is not None:
        eval_rows = None
        if want_eval:
            eval_flat = eval_buf if eval_buf is not None else \
                torch.empty(params.segments.numel, dtype=params.dtype, device=params.device)
            eval_rows = ParamRows(params.segments.slice(eval_flat), params.segments, params.dtype, params.device,
                                  params.form, None)
            eval_params = params.form.unflatten(eval_flat)
        backend.apply_update(params=params, mean=stats.mean, eta=eta, finite=finite, eval_out=eval_rows,
                             eval_scale=0.5)
        if params.form.numpy:
            eval_params = _to_numpy(eval_params)
    res = RoundResult(stats.mean, eta, stats.sq_norms if per_client else None, stats.mean_sq, avg_sq, finite,
                      stats.nonfinite if per_client else None, num_clients, eval_params,
                      None if form.kind == "flat" else form)
    if numpy_out:
        for f in ("mean_flat", "eta", "sq_norms", "mean_sq_norm", "avg_sq_norm", "finite", "nonfinite"):
            setattr(res, f, _to_numpy(getattr(res, f)))
    return res


def _prepare(deltas, models, params, name_hint: str = "deltas"):
    """Client rows (with the base attached for models=), the params rows, and the device."""
    if (deltas is None) == (models is None):
        raise TypeError("pass exactly one of deltas= (client updates) or models= (full client models)")
    if models is not None:
        if params is None:
            raise TypeError("models= needs params= (the global model the client models started from)")
        rows = client_rows(models, name="models")
        p = param_rows(params)
        return with_base(rows, p), p, "models"
    rows = client_rows(deltas, name="deltas")
    p = None
    if params is not None:
        p = param_rows(params)
        check_params_match(p, rows)
    return rows, p, "deltas"


def out_buffer(out: Any, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A caller's preallocated output: a contiguous 1-D tensor (or numpy array) of the expected size and dtype."""
    if out is None:
        return None
    t = as_tensor(out)
    if t.ndim != 1 or t.numel() != numel or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D {dtype} buffer of {numel} elements on {device}; got "
                         f"shape {tuple(t.shape)}, {t.dtype} on {t.device}")
    return t


def _run(deltas, models, weights, params, on_nonfinite, backend_name, eta_rule: Callable, want_eval: bool,
         mean_out=None, eval_out=None):
    _check_on_nonfinite(on_nonfinite)
    rows, p, name = _prepare(deltas, models, params)
    mean_buf = out_buffer(mean_out, "mean_out", rows.numel, compute_dtype(rows.dtype), rows.device)
    eval_buf = None
    if eval_out is not None:
        if p is None:
            raise TypeError("eval_out= needs params= (the evaluation model is computed from the updated params)")
        eval_buf = out_buffer(eval_out, "eval_out", p.segments.numel, p.dtype, p.device)
    backend = resolve(backend_name, rows.device)
    coefs = normalized_weights(weights, rows.num_clients, rows.device)
    stats = round_stats(rows, coefs, backend, mean_out=mean_buf)
    avg_sq = (coefs * stats.sq_norms).sum()
    eta = eta_rule(avg_sq, stats.mean_sq, rows.num_clients)
    return finish_round(stats, avg_sq=avg_sq, eta=eta, params=p, want_eval=want_eval, on_nonfinite=on_nonfinite,
                        backend=backend, form=rows.form, numpy_out=rows.form.numpy, num_clients=rows.num_clients,
                        name=name, eval_buf=eval_buf)


def _fedexp_rule(eps: Any, eps_mode: str) -> Callable:
    if eps is None:
        raise TypeError("fedexp_step needs eps (FedExP's denominator term, e.g. eps=1e-3)")
    eps = _check_number(eps, "eps")
    if eps_mode not in rules.EPS_MODES:
        raise ValueError(f"eps_mode must be one of {rules.EPS_MODES}, got {eps_mode!r}")
    return lambda avg_sq, mean_sq, m: rules.fedexp_eta(avg_sq, mean_sq, rules.effective_eps(eps, m, eps_mode))


def _fixed_rule(lr: Any) -> Callable:
    lr = _check_number(lr, "lr")
    return lambda avg_sq, mean_sq, m: torch.full((), lr, dtype=torch.float64, device=mean_sq.device)


@share_docs
def fedexp_step(deltas=None, eps=None, *, models=None, weights=None, params=None, eps_mode: str = "paper",
                on_nonfinite: str = "raise", backend: str = "auto", mean_out=None, eval_out=None) -> RoundResult:
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

    Returns:
        :class:`RoundResult` with ``eta``, ``update``, ``mean``, ``sq_norms``, ``mean_sq_norm``, ``avg_sq_norm``,
        ``finite``, ``nonfinite`` and, with ``params``, ``eval_params`` (the model to evaluate).

    {numerics}

    Example::

        deltas = torch.randn(20, 1_000_000)
        res = fastagg.fedexp_step(deltas, eps=1e-3)
        w += res.update            # or: fastagg.fedexp_step(deltas, eps=1e-3, params=w)
    """
    rule = _fedexp_rule(eps, eps_mode)
    return _run(deltas, models, weights, params, on_nonfinite, backend, rule, want_eval=True, mean_out=mean_out,
                eval_out=eval_out)


@share_docs
def fedavg_step(deltas=None, lr: float = 1.0, *, models=None, weights=None, params=None,
                on_nonfinite: str = "raise", backend: str = "auto", mean_out=None) -> RoundResult:
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

    {numerics}

    Example::

        fastagg.fedavg_step(deltas, lr=1.0, weights=num_examples, params=w)
    """
    return _run(deltas, models, weights, params, on_nonfinite, backend, _fixed_rule(lr), want_eval=False,
                mean_out=mean_out)


def step_from_sums(weighted_sum, weighted_sq_norm_sum, total_weight, num_clients, *, eta_rule: Callable,
                   params=None, on_nonfinite: str = "raise", backend: str = "auto", want_eval: bool,
                   name: str = "weighted_sum") -> RoundResult:
    """The shared path of every from-sums step: ``mean = weighted_sum / total_weight`` in one stats pass."""
    _check_on_nonfinite(on_nonfinite)
    if not isinstance(num_clients, numbers.Integral) or isinstance(num_clients, bool) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    total = _check_number(total_weight, "total_weight", minimum=0.0, allow_equal=False)
    rows = client_rows([weighted_sum], name=name)
    p = None
    if params is not None:
        p = param_rows(params)
        check_params_match(p, rows, clients=name)
    dev = rows.device
    if isinstance(weighted_sq_norm_sum, torch.Tensor):
        sq_sum = weighted_sq_norm_sum.detach().to(device=dev, dtype=torch.float64).reshape(())
    else:
        sq_sum = torch.tensor(_check_number(weighted_sq_norm_sum, "weighted_sq_norm_sum"), dtype=torch.float64,
                              device=dev)
    backend = resolve(backend, dev)
    coefs = torch.full((1,), 1.0 / total, dtype=torch.float64, device=dev)
    stats = round_stats(rows, coefs, backend)
    avg_sq = sq_sum / total
    stats.nonfinite = stats.nonfinite | ~torch.isfinite(avg_sq)
    eta = eta_rule(avg_sq, stats.mean_sq, int(num_clients))
    return finish_round(stats, avg_sq=avg_sq, eta=eta, params=p, want_eval=want_eval, on_nonfinite=on_nonfinite,
                        backend=backend, form=rows.form, numpy_out=rows.form.numpy, num_clients=int(num_clients),
                        per_client=False, name=name)


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
    rule = _fedexp_rule(eps, eps_mode)
    return step_from_sums(weighted_sum, weighted_sq_norm_sum, total_weight, num_clients, eta_rule=rule,
                          params=params, on_nonfinite=on_nonfinite, backend=backend, want_eval=True)
