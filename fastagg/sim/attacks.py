"""Byzantine clients for the simulator: a fixed fraction of the clients attacks every round it is sampled.

Model poisoning (the attacker replaces its update ``delta_i = x_i - w`` after honest local steps; ``scale`` is
``--attack-scale``):

* ``sign-flip``: ``-scale * delta_i`` (default scale 1);
* ``scale``: ``scale * delta_i`` (default 10);
* ``gaussian``: i.i.d. ``N(0, (scale * r)^2)`` per coordinate, ``r`` the root mean square of the honest updates'
  entries this round (default scale 10);
* ``alie`` ("A Little Is Enough", Baruch et al., NeurIPS 2019): every attacker sends ``mu - z sigma``, the
  coordinate-wise mean and standard deviation of the honest updates, ``z`` the paper's
  ``Phi^-1((M - s) / M)`` with ``s = floor(M / 2 + 1) - f`` (``scale`` overrides z);
* ``ipm`` (inner-product manipulation, Xie et al., UAI 2020): every attacker sends ``-scale * mu`` (default 0.5).

Data poisoning: ``label-flip``: the attackers train honestly on labels ``C - 1 - y``.

Which clients attack is drawn once per seed (``malicious_clients``); the attacks' own random draws use a generator
of their own, so a run's client sampling and minibatches are those of the run without attackers.
"""
from __future__ import annotations

import dataclasses
import math

import torch

ATTACKS = ("sign-flip", "gaussian", "scale", "label-flip", "alie", "ipm")
DEFAULT_SCALE = {"sign-flip": 1.0, "scale": 10.0, "gaussian": 10.0, "ipm": 0.5}


def malicious_clients(num_clients: int, fraction: float, seed: int) -> torch.Tensor:
    """A bool mask [N] of the ``round(fraction * N)`` attacking clients, drawn with ``seed``."""
    k = int(round(fraction * num_clients))
    mask = torch.zeros(num_clients, dtype=torch.bool)
    mask[torch.randperm(num_clients, generator=torch.Generator().manual_seed(10_007 + seed))[:k]] = True
    return mask


def label_flipped(data, mask: torch.Tensor):
    """``data`` whose attacking clients' labels are ``C - 1 - y`` (a copy of ``y``; features shared)."""
    if data.task != "classification":
        raise ValueError(f"label-flip needs a classification data set; {data.name} is {data.task}")
    y = data.y.clone()
    bad = mask.to(y.device)
    y[bad] = data.num_classes - 1 - y[bad]
    return dataclasses.replace(data, y=y, _samples=None)


def alie_z(m: int, f: int) -> float:
    """Baruch et al.'s z: the largest shift that keeps an attacker's value inside the majority's spread."""
    s = math.floor(m / 2 + 1) - f
    p = min(max((m - s) / m, 1e-6), 1 - 1e-6)
    return float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(p, dtype=torch.float64)))


def attack_updates(kind: str, deltas: torch.Tensor, bad: torch.Tensor, scale: float | None,
                   gen: torch.Generator) -> torch.Tensor:
    """``deltas`` [m, d] with the rows of the attackers (``bad`` [m]) replaced (a new tensor; label-flip and rounds
    without a sampled attacker return ``deltas`` itself)."""
    if kind == "label-flip" or not bool(bad.any()):
        return deltas
    out = deltas.clone()
    honest = deltas[~bad] if bool((~bad).any()) else deltas
    s = DEFAULT_SCALE.get(kind) if scale is None else scale
    if kind == "sign-flip":
        out[bad] = -s * deltas[bad]
    elif kind == "scale":
        out[bad] = s * deltas[bad]
    elif kind == "gaussian":
        rms = honest.double().square().mean().sqrt().item()
        noise = torch.randn(int(bad.sum()), deltas.shape[1], generator=gen, dtype=torch.float64)
        out[bad] = (s * rms * noise).to(deltas.dtype).to(deltas.device)
    elif kind == "alie":
        z = alie_z(deltas.shape[0], int(bad.sum())) if scale is None else scale
        mu, sigma = honest.mean(0), honest.std(0, unbiased=False)
        out[bad] = mu - z * sigma
    elif kind == "ipm":
        out[bad] = -s * honest.mean(0)
    else:
        raise ValueError(f"unknown attack {kind!r}; choose one of {', '.join(ATTACKS)}")
    return out
