"""SCAFFOLD's server (Karimireddy et al., ICML 2020) and SCAFFOLD with FedExP's step size (paper 000, Algorithm 2):
the global model's step plus the control variate ``c``, kept incrementally."""
from __future__ import annotations

from typing import Any

import torch

from .. import fedexp_rule
from .._checks import check_int, check_number
from ..inputs import give_back
from ..passes import buffer_updates, check_overflow, device_scalar, like_params, overflow_counter
from ..rows import ParamRows
from .base import ServerOptimizer, StepStats
from .fedexp import _EPS_DOC, _FedExPFamily

__all__ = ["Scaffold", "ScaffoldExP"]


class _ControlVariate:
    """SCAFFOLD's server side, shared by Scaffold and ScaffoldExP::

        w <- w + eta * mean_i (y_i - w)                  (eta: the subclass's rule, _server_eta)
        c <- c + (|S| / N) * mean_i (c_i_new - c_i)      (uniform mean over the participants)

    The control variate ``c`` (:attr:`control`) is kept incrementally; the server never holds an N x d matrix.
    """

    def _init_control(self, num_clients):
        self.num_clients = check_int(num_clients, "num_clients", minimum=1, what="an integer >= 1 (N, all clients)")
        self._control: ParamRows | None = None

    @property
    def control(self) -> torch.Tensor:
        """The server control variate c (flat, float32; float64 for float64 params)."""
        return self._buffer("control")

    def step(self, deltas: Any = None, control_deltas: Any = None, weights: Any = None) -> StepStats:  # type: ignore[override]
        """One round: ``deltas`` (y_i - w) with optional ``weights``, ``control_deltas`` (c_i_new - c_i, averaged
        uniformly over the participants, as SCAFFOLD does). Either may be an Accumulator."""
        if deltas is None or control_deltas is None:
            raise TypeError(f"{type(self).__name__}.step needs deltas and control_deltas (each participant's "
                            "c_i_new - c_i); it has no pseudo-gradient form")
        with self._serial, torch.no_grad():
            self._follow()
            self._check_group()
            try:
                return self._scaffold_step(deltas, control_deltas, weights)
            finally:
                give_back(self._borrowed)

    def _scaffold_step(self, deltas, control_deltas, weights) -> StepStats:
        stats = self._stats(deltas, weights)
        cstats = self._stats(control_deltas, None, name="control_deltas")
        updates = buffer_updates(self._p, stats, models=False)  # checked before any write
        self._overflow = overflow_counter(stats.mean)
        if cstats.num_clients != stats.num_clients:
            raise ValueError(f"control_deltas has {cstats.num_clients} clients; deltas has {stats.num_clients}")
        if stats.num_clients > self.num_clients:
            raise ValueError(f"{stats.num_clients} participants; more than num_clients={self.num_clients}")
        eta = self._server_eta(stats)
        ratio = device_scalar(stats.num_clients / self.num_clients, eta)
        both = self._check_finite(stats, eta) & self._check_finite(cstats, ratio)
        self._server_apply(stats, eta, both)
        if self._control is None:
            self._control = like_params(self._p, self.control)
        self._backend.momentum_apply(params=self._control, mean=cstats.mean, lr=ratio, finite=both, buf=None,
                                     momentum=0.0, nesterov=False, extra_out=None, extra_coef=None,
                                     extra_coef_skip=None, overflow_out=self._overflow)
        self._finish(stats, both, updates)
        self.last_stats = self._step_stats(stats, eta, both)
        check_overflow(self._overflow, self.on_nonfinite, "params or the control variate")
        return self.last_stats

    def _forget_views(self) -> None:
        self._control = None


class Scaffold(_ControlVariate, ServerOptimizer):
    """SCAFFOLD's server (Karimireddy et al.): ``w <- w + lr * mean_i (y_i - w)``, ``c`` as in ScaffoldExP.

    Args:
        params: the global model; updated in place.
        num_clients: N, the total number of clients.
        lr: the global step size eta_g (default 1).
    """

    _hyper = ("num_clients", "lr")
    _vector_state = ("control",)
    _apply_reads_start = True

    def __init__(self, params, num_clients: int, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self._init_control(num_clients)
        self.lr = check_number(lr, "lr")

    def _server_eta(self, stats):
        return device_scalar(self.lr, stats.mean)

    def _server_apply(self, stats, eta, finite):
        self._apply(stats, eta, finite=finite)


class ScaffoldExP(_ControlVariate, _FedExPFamily):
    """SCAFFOLD with the FedExP server step size (paper 000, Algorithm 2)::

        w <- w + eta * mean_i (y_i - w)           eta: FedExP's rule on the model updates
        c <- c + (|S| / N) * mean_i (c_i_new - c_i)

    The server control variate ``c`` (:attr:`control`) is kept incrementally from the participants' control
    deltas; the server never holds an N x d matrix.

    Args:
        params: the global model; updated in place.
        num_clients: N, the total number of clients.
        {eps_doc}
    """

    _hyper = ("num_clients", "eps", "eps_mode", "eps_decay", "lr")
    _vector_state = ("control",)

    def __init__(self, params, num_clients: int, eps: float | None = None, eps_mode: str = "paper",
                 eps_decay: float = 1.0, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self._init_control(num_clients)
        self._init_eps(eps, eps_mode, eps_decay, lr)

    def _server_eta(self, stats):
        return self._scaled(fedexp_rule.fedexp_eta(stats.avg_sq, stats.mean_sq, self._eps_eff(stats.num_clients)))

    def _server_apply(self, stats, eta, finite):
        self._fedexp_apply(stats, eta, finite)


ScaffoldExP.__doc__ = ScaffoldExP.__doc__.replace("{eps_doc}", _EPS_DOC)
