"""Each algorithm = a client rule (how the batched local steps move) + a server optimizer (fastagg.server).

Every local step of every participating client runs in one fused call of ``fastagg.client``; the server step is
one call of a ``fastagg.server`` optimizer. Defaults follow docs/ALGORITHMS.md.
"""
from __future__ import annotations

import dataclasses

from .. import server
from .._checks import did_you_mean

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

# Byzantine-robust servers: FedAvg's step on a fastagg.robust estimate (the rule from the name, or from any
# algorithm's ``aggregate=`` setting: ``fedadam:aggregate=median``)
ROBUST = {"fedmedian": "median", "fedtrimmedavg": "trimmed-mean", "meamed": "meamed", "krum": "krum",
          "multikrum": "multikrum", "bulyan": "bulyan", "geomed": "geomed", "normbound": "normbound",
          "cclip": "cclip"}
for _name in ROBUST:
    ALGORITHMS[_name] = ("sgd", server.FedAvg, lambda c: dict(lr=_or(c.server_lr, 1.0)))
AGGREGATES = tuple(ROBUST.values())

# FedSPS-family servers take the plain unweighted average of the client models (paper 003); robust rules that are
# unweighted in their papers (median, trimmed mean, MeaMed, Krum, Bulyan) take no weights
UNWEIGHTED = {"fedsps", "feddecsps"}


def robust_rule(kind: str | None, config):
    """The fastagg.robust rule ``kind`` with the run's settings: ``f`` (the attackers a rule assumes; default the
    malicious fraction of a round's participants), ``beta`` (trimmed mean), ``max_norm`` (norm bounding; centered
    clipping's tau)."""
    if kind is None:
        return None
    from .. import robust

    f = config.f
    if f is None:
        m = max(1, int(round(config.participation * config.clients))) if config.clients else 1
        f = int(round(config.malicious * m))
    rules = {"median": lambda: robust.Median(), "trimmed-mean": lambda: robust.TrimmedMean(config.beta),
             "meamed": lambda: robust.MeaMed(f), "krum": lambda: robust.Krum(f),
             "multikrum": lambda: robust.MultiKrum(f), "bulyan": lambda: robust.Bulyan(f),
             "geomed": lambda: robust.GeometricMedian(), "normbound": lambda: robust.NormBound(config.max_norm),
             "cclip": lambda: robust.CenteredClipping(config.max_norm)}
    if kind not in rules:
        raise ValueError(f"unknown aggregate {kind!r}{did_you_mean(kind, rules)}; choose one of {', '.join(rules)}")
    return rules[kind]()


def _or(value, default):
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str
    client_rule: str
    server_cls: type
    server_kwargs: dict
    aggregate: object = None  # a fastagg.robust rule, or None (the weighted mean)


def resolve(name: str, config) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(sorted(ALGORITHMS))}")
    rule, cls, kwargs = ALGORITHMS[name]
    if name in ROBUST and config.aggregate is not None and config.aggregate != ROBUST[name]:
        raise ValueError(f"{name} aggregates with {ROBUST[name]!r}; aggregate={config.aggregate!r} contradicts it")
    return Algorithm(name, rule, cls, kwargs(config), robust_rule(ROBUST.get(name, config.aggregate), config))


# Settings one algorithm of a run may override (``fedavg:server_lr=10``): its own hyperparameters and the local
# training's. What every algorithm of a run shares (data, model, rounds, participation, seeds, device) is not
# among them, so curves in one run stay comparable.
PER_ALGORITHM = {"lr": float, "lr_decay": float, "lr_c": float, "weight_decay": float, "clip_norm": float,
                 "server_lr": float,
                 "server_momentum": float, "weighting": str, "eps": float, "eps_mode": str, "eps_decay": float,
                 "fedexpm_beta": float, "lam": float, "acg_beta": float, "prox_mu": float, "tau": float,
                 "sps_c": float, "gamma_b": float, "nesterov_momentum": float, "mass_gam": float,
                 "mass_eta2": float, "mass_average": str, "local_steps": int, "batch_size": int,
                 "aggregate": str, "f": int, "beta": float, "max_norm": float}


def _unknown_setting(key: str) -> str:
    """Why ``key`` cannot follow an algorithm's name: a run-wide setting, or unknown (with the nearest names)."""
    from .runner import Config

    if key in {f.name for f in dataclasses.fields(Config)}:
        return f"{key!r} is a setting of the whole run, not of one algorithm (pass --{key.replace('_', '-')})"
    return (f"unknown setting {key!r}{did_you_mean(key, PER_ALGORITHM)}; per-algorithm settings: "
            f"{', '.join(sorted(PER_ALGORITHM))}")


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"fedavg:server_lr=10:lr=0.05"`` -> ``("fedavg", {"server_lr": 10.0, "lr": 0.05})``; a bare name has no
    overrides. Unknown algorithms, unknown or shared settings and unparsable values are refused."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"an algorithm must be a non-empty name, got {spec!r}")
    name, *pairs = spec.strip().split(":")
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(sorted(ALGORITHMS))}")
    overrides = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise ValueError(f"algorithm {spec!r}: {pair!r} is not key=value")
        if key not in PER_ALGORITHM:
            raise ValueError(f"algorithm {spec!r}: {_unknown_setting(key)}")
        if key in overrides:
            raise ValueError(f"algorithm {spec!r}: {key!r} given twice")
        try:
            overrides[key] = PER_ALGORITHM[key](text.strip())
        except ValueError:
            kind = "an integer" if PER_ALGORITHM[key] is int else "a number"
            raise ValueError(f"algorithm {spec!r}: {key}={text!r} is not {kind}") from None
    return name, overrides


def configure(spec: str, config, data_defaults: dict | None = None):
    """(algorithm name, the run's Config for this algorithm): the data set's per-algorithm paper settings fill the
    settings the run left unset (``None``), then the spec's own overrides apply."""
    name, overrides = parse_spec(spec)
    per_alg = (data_defaults or {}).get("algorithms", {}).get(name, {})
    filled = {k: v for k, v in per_alg.items() if getattr(config, k) is None}
    return name, dataclasses.replace(config, **{**filled, **overrides})
