"""The simulator's differential privacy (``--dp``): a spec string into a :mod:`fastagg.privacy` mechanism and its
accountant, for any algorithm's server step.

    --dp server-fixed:clip=1.0,z=1.0            server-side fixed clipping (clip: C, z: noise multiplier)
    --dp server-adaptive:clip=0.1,z=1.0[,quantile=0.5][,lr=0.2][,count_std=...]
    --dp client-fixed:clip=1.0,z=1.0            the clients clip (fastagg.client.clip_updates), the server adds noise
    --dp client-adaptive:clip=0.1,z=1.0,...     the clients clip and report whether they did
    clip and z are required (no default privacy: a spec without them is refused); z = 0 adds no noise (epsilon
    inf), a positive z is at least Z_MIN (1e-3). The adaptive kinds' quantile (default 0.5), lr (0.2) and
    count_std (default: the mechanism's) are optional.
    optional everywhere: delta=1e-5 (the delta epsilon is reported at; default 1 / clients^1.1), seed=N (the noise's
    seed, an integer in [0, 2^64); default derived from the run's seed); a key given twice is refused

The round's participants are a uniform sample without replacement of ``participation * clients``, so the
accountant (Google's dp-accounting, RDP) composes one sampled-without-replacement Gaussian event per round; the
simulator reports epsilon after every evaluated round (``metrics.csv``'s ``epsilon`` column, the summary and
``epsilon.png``). Adaptive clipping moves the norm by Andrew et al.'s rule (``direction="paper"``).
"""
from __future__ import annotations

import dataclasses
import math

from .. import privacy

KINDS = {"server-fixed": privacy.ServerSideFixedClipping, "server-adaptive": privacy.ServerSideAdaptiveClipping,
         "client-fixed": privacy.ClientSideFixedClipping, "client-adaptive": privacy.ClientSideAdaptiveClipping}
SEED_LIMIT = 1 << 64
REQUIRED = ("clip", "z")
# the smallest positive noise multiplier: at z = 1e-3 one round already spends epsilon ~ 10^6 (no privacy worth
# reporting), and below ~1e-154 z^2 underflows to 0 in dp-accounting's RDP (a ZeroDivisionError at the first
# evaluated round, after the run's files were written)
Z_MIN = 1e-3
KEYS = {"clip": float, "z": float, "quantile": float, "lr": float, "count_std": float, "delta": float, "seed": int}


@dataclasses.dataclass(frozen=True)
class DPSpec:
    kind: str
    clip: float = 1.0
    z: float = 1.0
    quantile: float = 0.5
    lr: float = 0.2
    count_std: float | None = None
    delta: float | None = None
    seed: int | None = None

    @property
    def client_side(self) -> bool:
        return self.kind.startswith("client")


def parse(spec: str) -> DPSpec:
    """``kind:key=value,...`` (module docstring) as a DPSpec; a ValueError names what is wrong."""
    kind, _, rest = str(spec).partition(":")
    if kind not in KINDS:
        raise ValueError(f"--dp kind must be one of {', '.join(KINDS)}, got {kind!r}")
    values = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in KEYS:
            raise ValueError(f"--dp {kind}: {item!r} is not key=value with a key among {', '.join(KEYS)}")
        if key in values:  # the first or the last? neither: said once
            raise ValueError(f"--dp {kind}: {key} is given twice")
        try:
            values[key] = KEYS[key](value)
        except ValueError:
            raise ValueError(f"--dp {kind}: {key}={value!r} is not a {KEYS[key].__name__}") from None
    missing = [k for k in REQUIRED if k not in values]
    if missing:
        raise ValueError(f"--dp {kind}: {' and '.join(missing)} must be given (e.g. {kind}:clip=1.0,z=1.0); there "
                         "is no default privacy")
    z = values["z"]
    if math.isfinite(z) and 0 < z < Z_MIN:  # (NaN, Inf and negatives: the mechanism names them)
        raise ValueError(f"--dp {kind}: z must be 0 (no noise) or at least {Z_MIN:g}, got {z:g} (epsilon would "
                         "exceed 10^6 in one round, or overflow the accountant)")
    seed = values.get("seed")
    if seed is not None and not 0 <= seed < SEED_LIMIT:  # the mechanism's generator takes a 64-bit seed
        raise ValueError(f"--dp {kind}: seed must be an integer in [0, 2^64), got {seed}")
    if "fixed" in kind:
        for key in ("quantile", "lr", "count_std"):
            if key in values:
                raise ValueError(f"--dp {kind}: {key} is an adaptive clipping setting")
    return DPSpec(kind, **values)


def make(spec: DPSpec, *, participants: int, clients: int, run_seed: int):
    """(mechanism, accountant) for one run (one algorithm and seed); the accountant is None when z = 0 (no privacy
    to account)."""
    if spec.seed is not None and not 0 <= spec.seed < SEED_LIMIT:
        raise ValueError(f"--dp seed must be an integer in [0, 2^64), got {spec.seed}")
    # the default derived from the run's seed (any integer) and reduced to 64 bits
    seed = spec.seed if spec.seed is not None else ((0x5EED_D1FF << 16) ^ run_seed) % SEED_LIMIT
    common = dict(seed=seed)
    if "fixed" in spec.kind:
        mech = KINDS[spec.kind](spec.z, spec.clip, participants, **common)
    else:
        mech = KINDS[spec.kind](spec.z, participants, spec.clip, spec.quantile, spec.lr, spec.count_std, **common)
    acc = None
    if spec.z > 0:
        acc = privacy.PrivacyAccountant(spec.z, sampling="without-replacement" if participants < clients else "none",
                                        population_size=clients, num_sampled=participants, delta=spec.delta)
        mech.accountant = acc
    return mech, acc


def check(spec: str, *, participants: int, clients: int) -> None:
    """Everything a run's --dp needs, checked before any work: the spec, the mechanism's arguments, dp-accounting."""
    parsed = parse(spec)
    _, acc = make(parsed, participants=participants, clients=clients, run_seed=0)
    if acc is not None:  # the accountant answers for this z before a file is written (a probe: one release)
        acc.step()
        try:
            acc.epsilon()
        except ArithmeticError as e:
            raise ValueError(f"--dp {parsed.kind}: dp-accounting cannot account z={parsed.z:g} "
                             f"({type(e).__name__}: {e})") from None
