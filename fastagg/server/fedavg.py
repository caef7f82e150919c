"""FedAvg and server momentum (FedAvgM): ``w <- w + lr * mean``, with a momentum buffer for FedAvgM.

Defaults follow Flower 1.42's message-API ``FedAvg`` / ``FedAvgM`` (``lr = 1``: plain model averaging).
"""
from __future__ import annotations

from .._checks import check_number, check_prob
from ..passes import device_scalar
from .base import ServerOptimizer

__all__ = ["FedAvg", "FedAvgM"]


class FedAvg(ServerOptimizer):
    """FedAvg's server step ``w <- w + lr * mean`` (lr = 1: plain model averaging; Flower's FedAvg)."""

    _hyper = ("lr",)
    _apply_reads_start = _apply_reads_sum = True

    def __init__(self, params, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self.lr = check_number(lr, "lr")

    def _round(self, stats):
        eta = device_scalar(self.lr, stats.mean_sq)
        finite = self._check_finite(stats, eta)
        self._apply(stats, eta, finite=finite)
        return eta, finite


class FedAvgM(ServerOptimizer):
    """Server momentum (Flower's FedAvgM; Nesterov as torch SGD), with ``pg = -mean``::

        v <- momentum * v + pg          (v starts at 0, so the first round has v = pg, as in Flower)
        w <- w - lr * v                 (nesterov: w <- w - lr * (pg + momentum * v))

    Defaults follow Flower: ``lr=1.0, momentum=0.0``. The buffer is stored as ``-v`` (local-minus-global sign).
    """

    _hyper = ("lr", "momentum", "nesterov")
    _vector_state = ("momentum_buffer",)
    _apply_reads_start = _apply_reads_sum = True

    def __init__(self, params, lr: float = 1.0, momentum: float = 0.0, nesterov: bool = False, **kw):
        super().__init__(params, **kw)
        self.lr = check_number(lr, "lr")
        self.momentum = check_prob(momentum, "momentum")
        self.nesterov = bool(nesterov)
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0")

    def _used_state(self) -> tuple:
        return self._vector_state if self.momentum > 0 else ()  # momentum 0: no buffer, FedAvg's update

    def _round(self, stats):
        eta = device_scalar(self.lr, stats.mean_sq)
        finite = self._check_finite(stats, eta)
        buf = "momentum_buffer" if self.momentum > 0 else None
        self._apply(stats, eta, finite=finite, buf=buf, momentum=self.momentum, nesterov=self.nesterov)
        return eta, finite
