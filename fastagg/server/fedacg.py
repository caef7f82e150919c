"""FedACG (Kim et al., CVPR 2024): the server broadcasts a momentum look-ahead of the global model."""
from __future__ import annotations

import torch

from .._checks import check_number, check_prob
from ..passes import device_scalar
from .base import ServerOptimizer

__all__ = ["FedACG"]


class FedACG(ServerOptimizer):
    """FedACG (Kim et al., Algorithm 2): the server broadcasts a momentum look-ahead::

        b = w + lam m                   (m starts at 0: the first broadcast is w)
        clients return delta_i = theta_i - b
        m <- lam m + mean;   w <- w + m;   next b = w + lam m

    One parameter ``lam`` is both the look-ahead and the momentum decay (default 0.85). The model to evaluate is
    ``w`` (:meth:`eval_params`), not ``b`` (:meth:`broadcast`). The clients' regularizer ``(beta/2)||theta-b||^2``
    belongs to the local step (``fastagg.client``). ``lr`` (default 1, the paper's rule) scales the step,
    ``w <- w + lr m``, as torch's learning rate (for lr schedulers).
    """

    _hyper = ("lam", "lr")
    _vector_state = ("momentum",)
    _apply_reads_start = True

    def __init__(self, params, lam: float = 0.85, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self.lam = check_prob(lam, "lam")
        self.lr = check_number(lr, "lr")

    def broadcast(self):
        """``b = w + lam m`` in the params' form, from the params and momentum as they are now (params loaded or
        changed in place since the last step count), into a buffer the next step or broadcast rewrites."""
        extra = self._extra_out()
        m = self._flat.get("momentum")
        with torch.no_grad():
            for dst, w, mk in zip(extra.parts, self._p.parts,
                                  self._p.segments.slice(m) if m is not None else self._p.parts):
                dst.copy_(w if m is None else torch.add(w.to(mk.dtype), mk, alpha=self.lam))
        return self._user_form(self._flat["extra"])

    def _round(self, stats):
        lr = device_scalar(self.lr, stats.mean)
        finite = self._check_finite(stats, lr)
        lam = device_scalar(self.lam, stats.mean)
        self._apply(stats, lr, finite=finite, buf="momentum", momentum=self.lam, extra_coef=lam)
        return lr, finite
