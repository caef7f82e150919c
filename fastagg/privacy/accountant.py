"""Privacy accounting: the (epsilon, delta) a run has spent, from Google's ``dp-accounting`` library (pinned in
fastagg's ``[dp]`` extra; imported only when an accountant is made). fastagg writes no accountant of its own.

Each release of a mechanism adds ``N(0, (z C / n)^2 I)`` to the clipped updates' sum divided by ``n`` (the fixed
denominator a mechanism with an accountant uses: dividing by the random number of replies would let the added
client move the mean by up to ``2 C / (M + 1)``, see :mod:`.mechanisms`), i.e. noise of std ``z C`` to their *sum*
(adaptive clipping's two queries together are one Gaussian query of multiplier ``z`` by
construction, Andrew et al. Theorem 1). dp-accounting's events take the noise std over the query's L2
*sensitivity*, which depends on the neighbouring relation, amplified by how the round's clients were drawn:

* ``sampling="poisson"``: each of ``population_size`` clients joins a round independently with probability
  ``q = num_sampled / population_size`` (``PoissonSampledDpEvent``); add-or-remove-one neighbours: one client
  moves the clipped sum by at most ``C``, so the event's multiplier is ``z``; the DP-FedAvg analysis;
* ``sampling="without-replacement"``: a fixed-size sample of ``num_sampled`` out of ``population_size``
  (``SampledWithoutReplacementDpEvent``, Wang et al. 2019 Theorem 27; RDP only), what fastagg's simulator and
  Flower's ``fraction_train`` draw. Its neighbours are replace-one: one client's clipped update ``u`` (norm <= C)
  replaced by another ``u'`` moves the sum by ``||u - u'|| <= 2 C``, so the event's multiplier is ``z / 2``
  (a pair that attains it: every other client sends ``+C e``, the replaced one ``+C e`` against ``-C e``). The
  tight epsilon of this mode lies between the Poisson-subsampled Gaussian of multiplier ``z / 2`` (a lower bound:
  that pair's privacy loss) and this RDP bound, which is conservative (1.7-3.4x above that lower bound at the
  settings of ``tests/test_privacy_accountants.py``);
* ``sampling="none"``: no amplification; add-or-remove-one neighbours, multiplier ``z`` (every release counts in
  full; Flower 1.42's only accounted mode).

The accounting is incremental: the one-release RDP curve (or PLD) is computed once, and epsilon after ``T``
releases is computed from ``T`` times it, identical to dp-accounting composing the event ``T`` times from scratch
(``compose(event, T)``) -- a round costs microseconds (RDP) instead of recomputing the event's RDP every round.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .._checks import check_int
from .._optional import require

__all__ = ["PrivacyAccountant"]

SAMPLING = ("none", "poisson", "without-replacement")
METHODS = ("rdp", "pld")
PLD_INTERVAL = 1e-4  # dp-accounting's PLDAccountant default
MAX_NOISE_MULTIPLIER = 1e6  # (epsilon is 0 to float precision far below; dp-accounting overflows near 1e155)
MAX_RELEASES = 2 ** 63  # (a mechanism's release count is below it: noise.COUNT_QUERY_ROUND)
STATE_KEYS = ("noise_multiplier", "sampling", "method", "population_size", "num_sampled", "delta", "releases")


def _dp_accounting():
    require("dp_accounting", "dp", "privacy accounting")
    import dp_accounting.pld  # (loads the submodules dp_accounting.pld / .rdp the callers read)
    import dp_accounting.rdp

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
            tighter; ``"none"`` and ``"poisson"``; each epsilon self-composes the cached one-release PLD, ~1 s).

    A mechanism given ``accountant=`` refuses one of another noise multiplier or sample size
    (:meth:`for_mechanism` makes a matching one); the population is the accountant's alone. The mechanism's
    ``state_dict`` carries the accountant's, and a mechanism whose accountant has composed fewer releases than it
    has made steps it up (with a warning) at its next release: the epsilon never counts fewer releases than made.
    """

    def __init__(self, noise_multiplier: float, *, sampling: str = "none", population_size: int | None = None,
                 num_sampled: int | None = None, delta: float | None = None, method: str = "rdp"):
        if not isinstance(noise_multiplier, numbers.Real) or isinstance(noise_multiplier, bool):
            raise TypeError(f"noise_multiplier must be a real number, got {type(noise_multiplier).__name__} "
                            f"{noise_multiplier!r}")
        z = float(noise_multiplier)
        if not (math.isfinite(z) and 0 < z <= MAX_NOISE_MULTIPLIER):
            raise ValueError(f"noise_multiplier must be a number in (0, {MAX_NOISE_MULTIPLIER:g}] to account for "
                             f"(z = 0 gives no privacy; epsilon is 0 long before {MAX_NOISE_MULTIPLIER:g}), got "
                             f"{noise_multiplier!r}")
        if sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {SAMPLING}, got {sampling!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if sampling != "none":
            need = f"an integer >= 1 (sampling={sampling!r} needs it)"
            population_size = check_int(population_size, "population_size", minimum=1, what=need)
            num_sampled = check_int(num_sampled, "num_sampled", minimum=1, what=need)
            if num_sampled > population_size:
                raise ValueError(f"num_sampled={num_sampled} exceeds population_size={population_size}")
        if sampling == "without-replacement" and method != "rdp":
            raise ValueError("sampling='without-replacement' is accounted with method='rdp' only (dp-accounting's "
                             "PLD accountant does not take it)")
        if delta is None:
            delta = population_size ** -1.1 if population_size else 1e-5
        delta = _check_delta(delta)
        _dp_accounting()  # (a missing dp-accounting fails here, not at the first release)
        self.noise_multiplier, self.sampling, self.method = z, sampling, method
        self.population_size, self.num_sampled, self.delta = population_size, num_sampled, delta
        self.releases = 0
        self._one = None  # the one-release RDP curve (orders, rdp) or PLD, computed at the first epsilon
        self._memo: dict = {}  # (releases, delta) -> epsilon

    @classmethod
    def for_mechanism(cls, mechanism, *, sampling: str = "none", population_size: int | None = None,
                      delta: float | None = None, method: str = "rdp") -> "PrivacyAccountant":
        """The accountant of ``mechanism`` (a :mod:`fastagg.privacy` mechanism): its noise multiplier and its
        ``num_sampled_clients`` as the sample size; ``sampling`` and ``population_size`` as above."""
        return cls(mechanism.noise_multiplier, sampling=sampling, population_size=population_size,
                   num_sampled=mechanism.num_sampled_clients if sampling != "none" else None, delta=delta,
                   method=method)

    @property
    def event_noise_multiplier(self) -> float:
        """The noise std over the L2 sensitivity under the mode's neighbouring relation (module docstring): ``z``
        (add-or-remove-one) or ``z / 2`` (replace-one: one replaced client moves the clipped sum by ``2 C``)."""
        return self.noise_multiplier / 2 if self.sampling == "without-replacement" else self.noise_multiplier

    def _event(self):
        dpa = _dp_accounting()
        event = dpa.GaussianDpEvent(self.event_noise_multiplier)
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
            return dpa.pld.PLDAccountant(neighboring_relation=relation, value_discretization_interval=PLD_INTERVAL)
        return dpa.rdp.RdpAccountant(neighboring_relation=relation)

    def step(self, count: int = 1) -> None:
        """Compose ``count`` more releases."""
        count = check_int(count, "count")
        if self.releases + count >= MAX_RELEASES:
            raise ValueError(f"count={count} would take the releases past 2^63 (they are {self.releases})")
        self.releases += count

    def _single(self):
        """What one release costs, from dp-accounting, computed once: RDP, the curve ``(orders, rdp)``; PLD with
        Poisson sampling, the event's PLD (what ``PLDAccountant.compose(event, T)`` self-composes ``T`` times)."""
        if self._one is None:
            acc = self._new()
            if self.method == "rdp":
                acc.compose(self._event(), 1)
                self._one = (np.array(acc._orders), np.array(acc._rdp))
            else:
                from dp_accounting.pld import privacy_loss_distribution as pld

                self._one = pld.from_gaussian_mechanism(
                    standard_deviation=self.event_noise_multiplier, value_discretization_interval=PLD_INTERVAL,
                    sampling_prob=self.num_sampled / self.population_size,
                    neighboring_relation=acc.neighboring_relation)
        return self._one

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the accountant's); 0 before any release."""
        delta = self.delta if delta is None else _check_delta(delta)
        if self.releases == 0:
            return 0.0
        key = (self.releases, delta)
        if key not in self._memo:
            t = self.releases
            if self.method == "rdp":
                from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

                orders, rdp = self._single()
                eps = compute_epsilon(orders, t * rdp, delta)[0]  # compose(event, T) holds 0 + T rdp
            elif self.sampling == "none":  # (closed form: one Gaussian of std z / sqrt(T))
                eps = self._new().compose(self._event(), t).get_epsilon(delta)
            else:
                from dp_accounting.pld import privacy_loss_distribution as pld

                start = pld.identity(value_discretization_interval=PLD_INTERVAL)
                eps = start.compose(self._single().self_compose(t)).get_epsilon_for_delta(delta)
            self._memo = {key: float(eps)}
        return self._memo[key]

    def from_scratch(self) -> float:
        """Epsilon at the accountant's delta from dp-accounting composing the event ``releases`` times in a fresh
        accountant (what :meth:`epsilon` computes incrementally; slow: for checks)."""
        if self.releases == 0:
            return 0.0
        return float(self._new().compose(self._event(), self.releases).get_epsilon(self.delta))

    def state_dict(self) -> dict:
        """The releases so far and the configuration: a restored accountant recomposes them."""
        return {"noise_multiplier": self.noise_multiplier, "sampling": self.sampling, "method": self.method,
                "population_size": self.population_size, "num_sampled": self.num_sampled, "delta": self.delta,
                "releases": self.releases}

    def load_state_dict(self, state: dict) -> None:
        """Restore the releases of :meth:`state_dict`. The configuration is this accountant's: a state of another
        one (noise multiplier, sampling, method, population, sample size, delta: the keys of :meth:`state_dict`,
        exactly, of their types) is refused, as the mechanism refuses an accountant of another noise multiplier;
        nothing changes on a refusal."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict (PrivacyAccountant.state_dict()), got {type(state).__name__}")
        if set(state) != set(STATE_KEYS):
            raise ValueError(f"state must hold exactly the keys {STATE_KEYS}, got {sorted(map(str, state))}")
        mine = self.state_dict()
        for key in STATE_KEYS[:-1]:
            got, want = state[key], mine[key]
            if type(got) is not type(want) or got != want:
                raise ValueError(f"state's {key}={got!r} is not this accountant's {key}={want!r}: a state of another "
                                 "configuration would account for releases this accountant's mechanism did not make "
                                 "(build the accountant with the checkpoint's configuration)")
        self.releases = check_int(state["releases"], "state's releases", maximum=MAX_RELEASES - 1,
                                  what="an integer in [0, 2^63)")

    def __repr__(self) -> str:
        return (f"PrivacyAccountant(z={self.noise_multiplier}, sampling={self.sampling!r}, releases={self.releases}, "
                f"epsilon={self.epsilon():.4g} at delta={self.delta:g})")


def _check_delta(delta) -> float:
    d = float(delta) if isinstance(delta, numbers.Real) and not isinstance(delta, bool) else None
    if d is None or not 0 < d < 1:  # (NaN fails the comparison)
        raise ValueError(f"delta must be a number in (0, 1), got {delta!r}")
    return d
