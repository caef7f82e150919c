"""Batched models: M clients' parameters are rows of one ``[M, d]`` tensor; one call gives every client's
mini-batch mean loss and gradient (closed forms with batched matrix products, no Python loop over clients).
"""
from __future__ import annotations

import torch

from .data import FederatedData


class Model:
    """``dim`` parameters per client; ``loss_grad(w [M, d], x [M, B, f], y [M, B], mask [M, B])`` returns the
    per-client losses [M] and gradients [M, d]; ``loss(w [d], data)`` the global training loss the paper reports."""

    dim: int


class LeastSquares(Model):
    """FedExP's linear regression: client objective (1/2)||A w - b||^2 with gradient A^T (A w - b) (sums over the
    client's samples, the paper's convention); reported ``F(w) = mean_i ||A_i w - b_i||^2`` (so ``F(0) = 1``)."""

    def __init__(self, data: FederatedData):
        self.dim = data.num_features

    def loss_grad(self, w, x, y, mask):
        r = (torch.bmm(x, w.unsqueeze(2)).squeeze(2) - y) * mask
        return 0.5 * r.square().sum(1), torch.bmm(x.transpose(1, 2), r.unsqueeze(2)).squeeze(2)

    def loss(self, w, data):
        r = (data.x @ w - data.y) * _mask(data)
        return r.square().sum(1).mean()


class Quadratic(Model):
    """Paper 003's f_i(x) = (a_i / 2) x^2 (a_i stored as the client's only feature)."""

    def __init__(self, data: FederatedData):
        self.dim = 1

    def loss_grad(self, w, x, y, mask):
        a = x[:, 0, 0]
        return 0.5 * a * w[:, 0].square(), (a * w[:, 0]).unsqueeze(1)

    def loss(self, w, data):
        return (0.5 * data.x[:, 0, 0] * w[0] ** 2).mean()


class Softmax(Model):
    """Multinomial logistic regression: W [f, C] and b [C] flattened; mean cross-entropy over the batch."""

    def __init__(self, data: FederatedData):
        self.f, self.c = data.num_features, data.num_classes
        self.dim = (self.f + 1) * self.c

    def _split(self, w):
        return w[..., : self.f * self.c].unflatten(-1, (self.f, self.c)), w[..., self.f * self.c:]

    def loss_grad(self, w, x, y, mask):
        W, b = self._split(w)
        logits = torch.bmm(x, W) + b.unsqueeze(1)
        logp = torch.log_softmax(logits, dim=2)
        n = mask.sum(1).clamp_min(1)
        nll = -(logp.gather(2, y.unsqueeze(2)).squeeze(2) * mask).sum(1) / n
        err = (logp.exp() - torch.nn.functional.one_hot(y, self.c).to(w.dtype)) * (mask / n.unsqueeze(1)).unsqueeze(2)
        gW = torch.bmm(x.transpose(1, 2), err)
        return nll, torch.cat([gW.flatten(1), err.sum(1)], dim=1)

    def loss(self, w, data):
        W, b = self._split(w)
        logp = torch.log_softmax(data.x @ W + b, dim=2)
        mask = _mask(data)
        nll = -(logp.gather(2, data.y.unsqueeze(2)).squeeze(2) * mask).sum() / mask.sum()
        return nll

    def accuracy(self, w, data):
        W, b = self._split(w)
        pred = (data.x @ W + b).argmax(2)
        mask = _mask(data)
        return ((pred == data.y).to(w.dtype) * mask).sum() / mask.sum()


def _mask(data: FederatedData) -> torch.Tensor:
    n = data.x.shape[1]
    return (torch.arange(n, device=data.x.device)[None, :] < data.counts[:, None]).to(data.x.dtype)


MODELS = {"linear": LeastSquares, "quadratic": Quadratic, "softmax": Softmax}


def make(name: str, data: FederatedData) -> Model:
    if data.task == "quadratic":
        return Quadratic(data)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    if name == "softmax" and data.task != "classification":
        raise ValueError(f"model 'softmax' needs a classification dataset; {data.name} is {data.task}")
    if name == "linear" and data.task != "least_squares":
        raise ValueError(f"model 'linear' is least squares; {data.name} is {data.task} (use --model softmax)")
    return MODELS[name](data)
