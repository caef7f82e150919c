"""Adaptive server optimizers (Reddi et al., ICLR 2021; Wang et al., 2022): FedAdam, FedYogi, FedAdagrad, FedAMS.

One apply pass each (``backend.adam_apply``) reads the mean, m, v (and vhat) and the params once and writes them
once. Defaults follow Flower 1.42's message-API strategies.
"""
from __future__ import annotations

import torch

from .._checks import check_number, check_prob
from ..passes import device_scalar
from .base import ServerOptimizer

__all__ = ["FedAdam", "FedYogi", "FedAdagrad", "FedAMS", "BIAS_CORRECTIONS"]


BIAS_CORRECTIONS = ("flower", "adam", None)


class _AdamFamily(ServerOptimizer):
    _nonnegative_state = ("v", "vhat")  # second moments: load_state_dict refuses negative ones

    rule = "adam"

    def _init_adam(self, lr, betas, tau, bias_correction):
        self.lr = check_number(lr, "lr")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (b1, b2), got {betas!r}")
        self.betas = (check_prob(betas[0], "betas[0]"), check_prob(betas[1], "betas[1]"))
        self.tau = check_number(tau, "tau")
        if bias_correction not in BIAS_CORRECTIONS:
            raise ValueError(f"bias_correction must be one of {BIAS_CORRECTIONS}, got {bias_correction!r}")
        self.bias_correction = bias_correction

    def _lr(self, like: torch.Tensor) -> torch.Tensor:
        """``lr * sqrt(1 - b2^k) / (1 - b1^k)``: Flower uses k = round + 1 with rounds counted from 1 (k = 2 in
        the first round), Kingma & Ba k = round; without bias correction, lr."""
        if self.bias_correction is None:
            return device_scalar(self.lr, like)
        k = self._flat["step"] + (2.0 if self.bias_correction == "flower" else 1.0)
        b1, b2 = self.betas
        return self.lr * torch.sqrt(1 - torch.pow(b2, k)) / (1 - torch.pow(b1, k))

    def _round(self, stats):
        lr = self._lr(stats.mean)
        finite = self._check_finite(stats, lr)
        self._backend.adam_apply(
            params=self._p, mean=stats.mean, finite=finite,
            m=None if self.rule == "adagrad" else self._buffer("m"), v=self._buffer("v"),
            vhat=self._buffer("vhat") if self.rule == "ams" else None, rule=self.rule, lr=lr,
            beta1=self.betas[0], beta2=self.betas[1], tau=self.tau, ams_eps=getattr(self, "vhat_floor", 0.0),
            overflow_out=self._overflow)
        return lr, finite


class FedAdam(_AdamFamily):
    """FedAdam (Reddi et al.; Flower's FedAdam)::

        m <- b1 m + (1 - b1) mean;   v <- b2 v + (1 - b2) mean^2        (m, v start at 0)
        w <- w + lr * sqrt(1 - b2^k) / (1 - b1^k) * m / (sqrt(v) + tau)

    ``bias_correction="flower"`` (default): k = round + 1 with rounds from 1, as Flower 1.42; ``"adam"``: k = round
    (Kingma & Ba); ``None``: none. Defaults are Flower's message API: ``lr=0.1, betas=(0.9, 0.99), tau=1e-3``.
    """

    _hyper = ("lr", "betas", "tau", "bias_correction")
    _vector_state = ("m", "v")

    def __init__(self, params, lr: float = 0.1, betas=(0.9, 0.99), tau: float = 1e-3,
                 bias_correction: str | None = "flower", **kw):
        super().__init__(params, **kw)
        self._init_adam(lr, betas, tau, bias_correction)


class FedYogi(_AdamFamily):
    """FedYogi (Flower's FedYogi; no bias correction)::

        m <- b1 m + (1 - b1) mean;   v <- v - (1 - b2) mean^2 sign(v - mean^2)     (m, v start at 0)
        w <- w + lr * m / (sqrt(v) + tau)

    Defaults (Flower): ``lr=1e-2, betas=(0.9, 0.99), tau=1e-3``.
    """

    rule = "yogi"
    _hyper = ("lr", "betas", "tau")
    _vector_state = ("m", "v")

    def __init__(self, params, lr: float = 1e-2, betas=(0.9, 0.99), tau: float = 1e-3, **kw):
        super().__init__(params, **kw)
        self._init_adam(lr, betas, tau, None)


class FedAdagrad(_AdamFamily):
    """FedAdagrad (Flower's FedAdagrad: no first moment)::

        v <- v + mean^2;   w <- w + lr * mean / (sqrt(v) + tau)      (v starts at 0)

    Defaults (Flower's message API): ``lr=0.1, tau=1e-3``.
    """

    rule = "adagrad"
    _hyper = ("lr", "tau")
    _vector_state = ("v",)

    def __init__(self, params, lr: float = 0.1, tau: float = 1e-3, **kw):
        super().__init__(params, **kw)
        self._init_adam(lr, (0.0, 0.0), tau, None)


class FedAMS(_AdamFamily):
    """FedAMS (Wang et al., 2022; paper 003's baseline)::

        m, v as Adam;   vhat <- max(vhat, v, vhat_floor)       (vhat starts at 0)
        w <- w + lr * m / (sqrt(vhat) + tau)

    ``vhat_floor`` is the paper's "max stabilization factor" (tuned over 1e-8 ... 1 in paper 003). The FedCAMS
    code adds bias corrections and 1e-8 to the denominator: ``bias_correction="adam", tau=1e-8``.
    Defaults: ``lr=0.1, betas=(0.9, 0.99), vhat_floor=1e-8, tau=0, bias_correction=None``.
    """

    rule = "ams"
    _hyper = ("lr", "betas", "tau", "vhat_floor", "bias_correction")
    _vector_state = ("m", "v", "vhat")

    def __init__(self, params, lr: float = 0.1, betas=(0.9, 0.99), vhat_floor: float = 1e-8, tau: float = 0.0,
                 bias_correction: str | None = None, **kw):
        super().__init__(params, **kw)
        self._init_adam(lr, betas, tau, bias_correction)
        self.vhat_floor = check_number(vhat_floor, "vhat_floor")
