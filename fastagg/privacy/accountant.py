"""Privacy accounting: the (epsilon, delta) a run has spent, from Google's ``dp-accounting`` library (pinned in
fastagg's ``[dp]`` extra; imported only when an accountant is made). fastagg writes no accountant of its own.

Each release of a mechanism is one Gaussian event of noise multiplier ``z`` (the sensitivity of the clipped mean
is ``C / n`` and the noise std ``z C / n``; adaptive clipping's two queries together are one event of multiplier
``z`` by construction, Andrew et al. Theorem 1), amplified by how the round's clients were drawn:

* ``sampling="poisson"``: each of ``population_size`` clients joins a round independently with probability
  ``q = num_sampled / population_size`` (``PoissonSampledDpEvent``; add-or-remove-one neighbours), the DP-FedAvg
  analysis;
* ``sampling="without-replacement"``: a fixed-size sample of ``num_sampled`` out of ``population_size``
  (``SampledWithoutReplacementDpEvent``; replace-one neighbours, RDP only), what fastagg's simulator and
  Flower's ``fraction_train`` draw;
* ``sampling="none"``: no amplification (every release counts in full; Flower 1.42's only accounted mode).
"""
from __future__ import annotations

import math

from .._optional import require

__all__ = ["PrivacyAccountant"]

SAMPLING = ("none", "poisson", "without-replacement")
METHODS = ("rdp", "pld")


def _dp_accounting():
    require("dp_accounting", "dp", "privacy accounting")
    import dp_accounting
    from dp_accounting import pld, rdp  # noqa: F401 (submodules: dp_accounting.pld / .rdp)

    return dp_accounting


class PrivacyAccountant:
    """Tracks the privacy spent by a sequence of Gaussian releases of noise multiplier ``noise_multiplier``.

    Args:
        noise_multiplier: ``z`` of every release (> 0).
        sampling: ``"none"``, ``"poisson"`` or ``"without-replacement"`` (module docstring).
        population_size, num_sampled: the client population and the clients per round (needed by the sampled
            modes).
        delta: the delta at which :meth:`epsilon` reports (default ``1 / population_size^1.1``, a common choice,
            when the population is known; else 1e-5).
        method: ``"rdp"`` (Renyi DP, Mironov 2017; every sampling mode) or ``"pld"`` (privacy loss distributions,
            tighter; ``"none"`` and ``"poisson"``).
    """

    def __init__(self, noise_multiplier: float, *, sampling: str = "none", population_size: int | None = None,
                 num_sampled: int | None = None, delta: float | None = None, method: str = "rdp"):
        z = float(noise_multiplier)
        if not (math.isfinite(z) and z > 0):
            raise ValueError(f"noise_multiplier must be a finite number > 0 to account for (z = 0 gives no privacy), "
                             f"got {noise_multiplier!r}")
        if sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {SAMPLING}, got {sampling!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if sampling != "none":
            for name, v in (("population_size", population_size), ("num_sampled", num_sampled)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"sampling={sampling!r} needs {name} (an integer >= 1), got {v!r}")
            if num_sampled > population_size:
                raise ValueError(f"num_sampled={num_sampled} exceeds population_size={population_size}")
        if sampling == "without-replacement" and method != "rdp":
            raise ValueError("sampling='without-replacement' is accounted with method='rdp' only (dp-accounting's "
                             "PLD accountant does not take it)")
        if delta is None:
            delta = population_size ** -1.1 if population_size else 1e-5
        delta = float(delta)
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        self.noise_multiplier, self.sampling, self.method = z, sampling, method
        self.population_size, self.num_sampled, self.delta = population_size, num_sampled, delta
        self.releases = 0
        self._acc = self._new()

    def _event(self):
        dpa = _dp_accounting()
        event = dpa.GaussianDpEvent(self.noise_multiplier)
        if self.sampling == "poisson":
            return dpa.PoissonSampledDpEvent(self.num_sampled / self.population_size, event)
        if self.sampling == "without-replacement":
            return dpa.SampledWithoutReplacementDpEvent(self.population_size, self.num_sampled, event)
        return event

    def _new(self):
        dpa = _dp_accounting()
        rel = dpa.NeighboringRelation
        relation = rel.REPLACE_ONE if self.sampling == "without-replacement" else rel.ADD_OR_REMOVE_ONE
        if self.method == "pld":
            return dpa.pld.PLDAccountant(neighboring_relation=relation)
        return dpa.rdp.RdpAccountant(neighboring_relation=relation)

    def step(self, count: int = 1) -> None:
        """Compose ``count`` more releases."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        if count:
            self._acc.compose(self._event(), count)
            self.releases += count

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the accountant's); 0 before any release."""
        if self.releases == 0:
            return 0.0
        return float(self._acc.get_epsilon(self.delta if delta is None else float(delta)))

    def state_dict(self) -> dict:
        """The releases so far and the configuration: a restored accountant recomposes them."""
        return {"noise_multiplier": self.noise_multiplier, "sampling": self.sampling, "method": self.method,
                "population_size": self.population_size, "num_sampled": self.num_sampled, "delta": self.delta,
                "releases": self.releases}

    def load_state_dict(self, state: dict) -> None:
        fresh = PrivacyAccountant(state["noise_multiplier"], sampling=state["sampling"], method=state["method"],
                                  population_size=state["population_size"], num_sampled=state["num_sampled"],
                                  delta=state["delta"])
        fresh.step(int(state["releases"]))
        self.__dict__.update(fresh.__dict__)

    def __repr__(self) -> str:
        return (f"PrivacyAccountant(z={self.noise_multiplier}, sampling={self.sampling!r}, releases={self.releases}, "
                f"epsilon={self.epsilon():.4g} at delta={self.delta:g})")
