"""FedExP (Jhunjhunwala et al., ICLR 2023): the server step size from the clients' own statistics, and FedExP with
server momentum (FedExP-M, the paper's App. F). The scalar rule itself, shared with the functional
:func:`fastagg.fedexp_step`, is :func:`fastagg.fedexp_rule.fedexp_eta`."""
from __future__ import annotations

import torch

from .. import fedexp_rule
from .._checks import check_number, check_prob
from ..passes import device_scalar
from .base import ServerOptimizer

__all__ = ["FedExP", "FedExPM"]


class _FedExPFamily(ServerOptimizer):
    """eps schedule and the evaluation model shared by FedExP, FedExP-M and SCAFFOLD-ExP."""

    needs_client_norms = True  # eta reads sum_i p_i ||delta_i||^2
    _apply_reads_start = True

    def _init_eps(self, eps, eps_mode, eps_decay, lr):
        self.lr = check_number(lr, "lr")
        self.eps = fedexp_rule.check_eps(eps, eps_mode, what=type(self).__name__)
        self.eps_mode = eps_mode
        self.eps_decay = check_number(eps_decay, "eps_decay", minimum=0.0, allow_equal=False)

    def _scaled(self, eta: torch.Tensor) -> torch.Tensor:
        """The rule's step size times ``lr`` (1 unless a user or a scheduler set it: the rule as published)."""
        return eta if self.lr == 1.0 else eta * self.lr

    def _eps_eff(self, num_clients: int) -> torch.Tensor:
        """``eps * eps_decay^(t+1)`` in round t (0-based; the official schedule decays before round 0), times M in
        the official convention."""
        eps = fedexp_rule.effective_eps(self.eps, num_clients, self.eps_mode)
        if self.eps_decay == 1.0:
            return device_scalar(eps, self._flat["step"])
        return eps * torch.pow(self.eps_decay, self._flat["step"] + 1)

    def eval_params(self):
        """``(w_prev + w) / 2``, the FedExP evaluation model (paper 000, Sec. 5). fastagg's convention for round 0,
        before any step: the initial model (the average of two equal iterates), which the simulator's round-0
        metrics row reports; code that starts averaging only after the second iterate evaluates the first
        iterate at round 1 instead of (w0 + w1) / 2."""
        self._follow()
        return self._user_form(self._flat.get("extra"))

    def _fedexp_apply(self, stats, eta, finite, *, buf=None, momentum=0.0):
        self._apply(stats, eta, finite=finite, buf=buf, momentum=momentum, extra_coef=-0.5 * eta)


_EPS_DOC = """eps: FedExP's denominator term (squared-update-norm units, >= 0).
        eps_mode: ``"paper"`` (``||mean||^2 + eps``) or ``"official"`` (``||mean||^2 + M * eps``).
        eps_decay: per-round factor; round t (0-based) uses ``eps * eps_decay^(t+1)`` (the official code's
            ``0.998**2``: pass ``eps_decay=0.998**2``). Default 1: constant.
        lr: a factor on the step, as torch's learning rate (``w <- w + lr * eta * ...``; the evaluation model
            follows); default 1, the rule as published. ``torch.optim.lr_scheduler`` schedulers set it;
            ``last_stats.eta`` is the step applied, ``lr * eta``."""


class FedExP(_FedExPFamily):
    """FedExP (Jhunjhunwala et al., ICLR 2023, Algorithm 1)::

        eta = max(1, sum_i p_i ||delta_i||^2 / (2 (||mean||^2 + eps_t)))    (exact_projection: no factor 1/2)
        w <- w + eta * mean;   eval_params() = w_new - (eta/2) mean

    Args:
        params: the global model (flat tensor, list of tensors, or ``model.parameters()``); updated in place.
        {eps_doc}
        exact_projection: the variant for exact local projections (paper Sec. 5, App. C.4.1): no factor 1/2.
    """

    _hyper = ("eps", "eps_mode", "eps_decay", "exact_projection", "lr")

    def __init__(self, params, eps: float | None = None, eps_mode: str = "paper", eps_decay: float = 1.0,
                 exact_projection: bool = False, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self._init_eps(eps, eps_mode, eps_decay, lr)
        self.exact_projection = bool(exact_projection)

    def _eta(self, stats):
        scale = 1.0 if self.exact_projection else 0.5
        return fedexp_rule.fedexp_eta(stats.avg_sq, stats.mean_sq, self._eps_eff(stats.num_clients), scale=scale)

    def _round(self, stats):
        eta = self._scaled(self._eta(stats))
        finite = self._check_finite(stats, eta)
        self._fedexp_apply(stats, eta, finite)
        return eta, finite


class FedExPM(_FedExPFamily):
    """FedExP with server momentum (paper 000, App. F, eq. 115)::

        v <- mean + beta v;   A <- sum_i p_i ||delta_i||^2 + (beta/2) A      (v, A start at 0)
        eta = A / (2 (||v||^2 + eps_t))     (no max(1, .); 0/0 -> 1)
        w <- w + eta v;       eval_params() = w_new - (eta/2) v

    ``||v||^2`` is measured in the stats pass (``||mean + beta v_old||^2``), so v is written once, in the apply
    pass. The paper gives no beta; the official code uses 0.9.

    Args:
        params: the global model; updated in place.
        {eps_doc}
        beta: momentum coefficient in [0, 1).
    """

    _hyper = ("eps", "eps_mode", "eps_decay", "beta", "lr")
    _vector_state = ("v",)
    _scalar_state = ("numerator",)
    _nonnegative_state = ("numerator",)  # A, a discounted sum of squared norms: a negative one would stop the model

    def __init__(self, params, eps: float | None = None, beta: float = 0.9, eps_mode: str = "paper",
                 eps_decay: float = 1.0, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self._init_eps(eps, eps_mode, eps_decay, lr)
        self.beta = check_prob(beta, "beta")
        self._flat["numerator"] = torch.zeros((), dtype=torch.float64, device=self.device)

    def _aux(self):
        return self._buffer("v"), self.beta

    def _round(self, stats):
        a_new = stats.avg_sq + (self.beta / 2) * self._flat["numerator"]
        eta = self._scaled(fedexp_rule.fedexp_eta(a_new, stats.mean_sq, self._eps_eff(stats.num_clients), scale=0.5,
                                            floor=0.0))
        finite = self._check_finite(stats, eta)
        self._fedexp_apply(stats, eta, finite, buf="v", momentum=self.beta)
        self._flat["numerator"].copy_(torch.where(finite, a_new, self._flat["numerator"]))
        return eta, finite


for _cls in (FedExP, FedExPM):
    _cls.__doc__ = _cls.__doc__.replace("{eps_doc}", _EPS_DOC)
del _cls
