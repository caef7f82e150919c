"""Each algorithm = a client rule (how the batched local steps move) + a server optimizer (fastagg.server).

Every local step of every participating client runs in one fused call of ``fastagg.client``; the server step is
one call of a ``fastagg.server`` optimizer. Defaults follow ALGORITHMS.md.
"""
from __future__ import annotations

import dataclasses

from .. import server

# name -> (client rule, server optimizer class, the server's keyword arguments built from the config)
ALGORITHMS = {
    "fedavg": ("sgd", server.FedAvg, lambda c: dict(lr=_or(c.server_lr, 1.0))),
    "fedprox": ("prox", server.FedAvg, lambda c: dict(lr=_or(c.server_lr, 1.0))),
    "fedexp": ("sgd", server.FedExP, lambda c: dict(eps=c.eps, eps_mode=c.eps_mode, eps_decay=c.eps_decay)),
    "fedexpm": ("sgd", server.FedExPM, lambda c: dict(eps=c.eps, eps_mode=c.eps_mode, eps_decay=c.eps_decay,
                                                      beta=c.fedexpm_beta)),
    "fedavgm": ("sgd", server.FedAvgM, lambda c: dict(lr=_or(c.server_lr, 1.0), momentum=c.server_momentum)),
    "fedacg": ("acg", server.FedACG, lambda c: dict(lam=c.lam)),
    "scaffold": ("scaffold", server.Scaffold, lambda c: dict(num_clients=c.clients, lr=_or(c.server_lr, 1.0))),
    "scaffold-exp": ("scaffold", server.ScaffoldExP, lambda c: dict(num_clients=c.clients, eps=c.eps,
                                                                    eps_mode=c.eps_mode, eps_decay=c.eps_decay)),
    "fedadam": ("sgd", server.FedAdam, lambda c: dict(lr=_or(c.server_lr, 0.1), tau=c.tau)),
    "fedyogi": ("sgd", server.FedYogi, lambda c: dict(lr=_or(c.server_lr, 1e-2), tau=c.tau)),
    "fedadagrad": ("sgd", server.FedAdagrad, lambda c: dict(lr=_or(c.server_lr, 0.1), tau=c.tau)),
    "fedams": ("sgd", server.FedAMS, lambda c: dict(lr=_or(c.server_lr, 0.1))),
    "fedsps": ("sps", server.FedAvg, lambda c: dict(lr=1.0)),
    "feddecsps": ("decsps", server.FedAvg, lambda c: dict(lr=1.0)),
    "nesterov-fedavg": ("nesterov", server.FedAvg, lambda c: dict(lr=1.0)),
    "fedmass": ("mass", server.FedAvg, lambda c: dict(lr=1.0)),
}

# FedSPS-family servers take the plain unweighted average of the client models (paper 003)
UNWEIGHTED = {"fedsps", "feddecsps"}


def _or(value, default):
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str
    client_rule: str
    server_cls: type
    server_kwargs: dict


def resolve(name: str, config) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(sorted(ALGORITHMS))}")
    rule, cls, kwargs = ALGORITHMS[name]
    return Algorithm(name, rule, cls, kwargs(config))
