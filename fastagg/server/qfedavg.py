"""q-FedAvg (Li, Sanjabi, Beirami and Smith, ICLR 2020): fair resource allocation, clients with a larger training
loss weigh more."""
from __future__ import annotations

import numbers
from typing import Any

import torch

from .._checks import check_number
from ..stream import Accumulator
from .base import ServerOptimizer, StepStats

__all__ = ["QFedAvg"]


class QFedAvg(ServerOptimizer):
    """q-FedAvg (Li, Sanjabi, Beirami and Smith, "Fair Resource Allocation in Federated Learning", ICLR 2020;
    Flower 1.42's ``QFedAvg``): clients with a larger training loss weigh more (``q`` sets how much)::

        L = 1 / client_learning_rate,   F_i = loss_i + 1e-10,   d_i = w_i - w   (client i's update)
        h_i = q F_i^(q-1) L^2 ||d_i||^2 + L F_i^q
        w  <- w + lr * L sum_i F_i^q d_i / sum_i h_i

    (Flower writes it with ``Delta_i = L (w - w_i)``, ``delta_i = F_i^q Delta_i``, ``w <- w - sum delta_i / sum
    h_i``; ``lr`` is fastagg's server learning rate, 1 in Flower.) One read of the updates: the stats pass
    weighs them by ``F_i^q`` and gives every ``||d_i||^2``, so the step is ``eta * mean`` with
    ``eta = lr L sum_i F_i^q / sum_i h_i``. ``q = 0`` is FedAvg with equal weights. ``step(deltas, losses)``:
    each client's training loss (finite, >= 0) in the order of ``deltas``.
    """

    needs_client_norms = True  # h_i reads ||d_i||^2
    _apply_reads_start = True

    _hyper = ("lr", "client_learning_rate", "q")

    def __init__(self, params, client_learning_rate: float, q: float = 0.1, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self.client_learning_rate = check_number(client_learning_rate, "client_learning_rate", allow_equal=False)
        self.q = check_number(q, "q")
        self.lr = check_number(lr, "lr")
        self._f: torch.Tensor | None = None

    def step(self, deltas: Any = None, losses: Any = None, *, base: Any = None) -> StepStats:  # type: ignore[override]
        if deltas is None or losses is None:
            raise TypeError("QFedAvg.step needs deltas and losses (each client's training loss, Flower's "
                            "train_loss): it has no pseudo-gradient form")
        if isinstance(deltas, Accumulator):
            raise TypeError("QFedAvg weighs each client by its loss and its own norm: pass the updates, not an "
                            "Accumulator of their sum")
        f = _losses(losses) + 1e-10
        with self._serial:  # (re-entered by the base step) self._f is this step's
            self._f = f
            try:
                return super().step(deltas, weights=f ** self.q, base=base)
            except ValueError as e:
                if str(e).startswith("weights must have shape"):
                    raise ValueError(f"losses must hold one value per client ({e})") from None
                raise
            finally:
                self._f = None

    def _round(self, stats):
        inv_lr = 1.0 / self.client_learning_rate
        f = self._f.to(device=stats.mean.device, dtype=torch.float64)
        fq = f ** self.q
        h = self.q * f ** (self.q - 1) * inv_lr * inv_lr * stats.sq_norms + inv_lr * fq
        eta = (self.lr * inv_lr * fq.sum() / h.sum()).reshape(())
        finite = self._check_finite(stats, eta)
        self._apply(stats, eta, finite=finite)
        return eta, finite


def _losses(losses: Any) -> torch.Tensor:
    """Training losses as float64 on the host: finite and >= 0 (a ValueError names the first bad one)."""
    if isinstance(losses, torch.Tensor):
        if losses.is_complex() or losses.dtype == torch.bool or losses.device.type == "meta":
            raise TypeError(f"losses must be real numbers, got a {losses.dtype} tensor on {losses.device}")
        t = losses.detach().to("cpu", torch.float64).reshape(-1)
    else:
        values = list(losses) if not isinstance(losses, (int, float)) else [losses]
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"losses[{i}] must be a real number, got {type(v).__name__}")
        try:
            t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        except OverflowError:
            raise ValueError("losses hold an integer too large for a float") from None
    bad = ~torch.isfinite(t) | (t < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"losses[{i}] = {float(t[i])!r}; a training loss must be a finite number >= 0")
    return t
