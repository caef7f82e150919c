"""Central differential privacy mechanisms, fused into the server step.

Every mechanism releases ``est = sum_i p_i min(1, C / ||delta_i||) delta_i + N(0, sigma^2 I)`` with
``sigma = z C / n`` (``z`` the noise multiplier, ``C`` the clipping norm, ``n = num_sampled_clients``; McMahan et
al., "Learning Differentially Private Recurrent Language Models", ICLR 2018, and Flower 1.42's
``compute_stdv``) and ``p_i`` uniform: ``1 / n`` (``denominator="expected"``, McMahan et al.'s fixed-denominator
estimator: the sensitivity of the release is ``C / n`` whatever the number of replies) or ``1 / M`` over the ``M``
replies (``denominator="replies"``, as Flower's FedAvg averages them). Dividing by ``M`` is not sound against an
add-or-remove-one accountant: ``M`` is random under Poisson sampling and moves with the added client, and a client
sending ``-C e`` against ``M`` sending ``+C e`` moves the mean by ``2 C / (M + 1)``, up to twice the ``C / n`` the
noise is calibrated to. So the default is ``"expected"`` whenever the mechanism has an accountant, ``"replies"``
(Flower's numbers) when it has none; ``"replies"`` with a ``"poisson"`` or ``"none"`` accountant is refused, and with
a ``"without-replacement"`` one (replace-one: ``M = n`` fixed) a round of ``M != n`` replies is refused. Any
``fastagg.server`` optimizer then steps on ``est`` (``aggregate=`` of the optimizer): the noise enters before the
optimizer, so the release is the noised mean and whatever the optimizer does with it is post-processing. Flower's
wrappers add the noise to the wrapped strategy's *output* model instead; for FedAvg (server lr 1) the two are the
same model, for FedAdam / FedAvgM Flower's noise is not calibrated to what the optimizer did with the clipped
mean (Flower's own accountant accepts only FedAvg for that reason).

The kernels: the stats pass yields every client's squared norm; the clipped, noised mean is then one more
weighted-sum pass with the coefficients ``p_i min(1, C / ||delta_i||)`` and the noise added as each block of the
mean is written (csrc/round_stats.cpp, the Triton stats kernel), never materialized as a d-vector of its own.
Server-side clipping reads the updates twice (the second pass launched before the round's one host read, so the
two run back to back; a third time, without those clients, when some update holds NaN or Inf); client-side once (a
second time only when some client sent an update longer than ``C``: the server clips it again, so a buggy or hostile
client cannot break the sensitivity bound). One read is not possible server-side: a client's clip factor needs the
norm of its whole update before any coordinate of the clipped sum, and holding the M updates until then (or
writing per-client partial sums) would cost more than reading them again. The noise comes from fastagg's
counter-based generator keyed by ``(seed, round, coordinate)`` (:mod:`fastagg.privacy.noise`), or from
``noise_source=``.

A client whose update holds NaN or Inf contributes nothing (coefficient 0, reported in ``excluded``): that is
clipping it to zero, which keeps the sensitivity bound. The model's buffers (BatchNorm statistics) are not
averaged under DP (an unnoised average would leak): the model keeps its own, with a warning once; a server
optimizer built with ``buffers="optimizer"`` treats floating buffers as parameters, clipped and noised with them.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from typing import Any

import torch

from .._checks import check_int, check_number, normalized_weights
from ..passes import RoundStats, run_stats
from ..rows import Buffers, ClientRows, client_rows, compute_dtype, subset_rows
from .noise import COUNT_QUERY_ROUND, NoiseSource, check_seed, count_noise

__all__ = ["ServerSideFixedClipping", "ServerSideAdaptiveClipping", "ClientSideFixedClipping",
           "ClientSideAdaptiveClipping", "DPResult", "MECHANISMS", "adaptive_noise_params"]

DENOMINATORS = ("expected", "replies")
CLIENTS_DISCREPANCY = ("{replies} clients replied but num_sampled_clients={expected}: the noise std z C / n uses "
                       "num_sampled_clients, so the privacy guarantee holds for that many contributions (Flower "
                       "warns the same way)")


@dataclasses.dataclass
class DPResult:
    """One private release: the noised ``estimate`` [d]; ``clipping_norm`` used and ``noise_std`` added
    (per coordinate); ``clipped`` (bool [M]: updates longer than C, scaled down), ``excluded`` (non-finite,
    left out), the clients' squared norms before clipping (NaN for the excluded), ``round`` (the release index
    keying the noise), ``next_clipping_norm`` (adaptive: the norm of the next round) and
    ``noisy_clipped_fraction`` (adaptive: the noised fraction that moved it); ``epsilon`` after this release when
    the mechanism has an accountant; ``mean_sq``, the release's squared norm."""

    estimate: torch.Tensor
    clipping_norm: float
    noise_std: float
    clipped: torch.Tensor
    excluded: torch.Tensor
    sq_norms: torch.Tensor
    round: int
    next_clipping_norm: float | None = None
    noisy_clipped_fraction: float | None = None
    epsilon: float | None = None
    mean_sq: torch.Tensor | None = None  # ||estimate||^2 (float64, 0-d), from the pass that wrote the estimate

    @property
    def selected(self) -> torch.Tensor:
        """The clients that entered the release (every finite one)."""
        return ~self.excluded


def _check_rounds(rounds: Any) -> int:
    """A release count: an integer in [0, 2^63). Round 2^63 and beyond would key the update's noise with the top
    bit set, the adaptive count query's stream (noise.COUNT_QUERY_ROUND), and past 2^64 no kernel takes it."""
    return check_int(rounds, "rounds", maximum=COUNT_QUERY_ROUND - 1,
                     what="an integer in [0, 2^63) (the release count keying the noise)")


class _Mechanism:
    """What every mechanism shares: the noise multiplier, ``num_sampled_clients``, the seed and the release count
    that key the noise, an optional noise source and accountant, and ``denominator`` (``None``: ``"expected"``
    with an accountant, ``"replies"`` without; see the module docstring)."""

    client_side = False
    adaptive = False

    def __init__(self, noise_multiplier: float, num_sampled_clients: int, *, seed: int | None = None,
                 noise_source: NoiseSource | None = None, accountant: Any = None, weighted: bool = False,
                 denominator: str | None = None):
        self.denominator = denominator
        self.noise_multiplier = check_number(noise_multiplier, "noise_multiplier")
        self.num_sampled_clients = check_int(num_sampled_clients, "num_sampled_clients", minimum=1)
        self.seed = check_seed(seed)
        if noise_source is not None and not callable(noise_source):
            raise TypeError(f"noise_source must be callable (numel, round, dtype, device) -> tensor, got "
                            f"{type(noise_source).__name__}")
        self.noise_source = noise_source
        self.accountant = accountant
        self.weighted = bool(weighted)
        self._check_denominator()
        self.rounds = 0  # releases so far: the round index of the next release's noise
        self.last: DPResult | None = None
        self._check_accountant()

    @property
    def update_noise_multiplier(self) -> float:
        """The noise multiplier of the update's noise (adaptive clipping raises it; see adaptive_noise_params)."""
        return self.noise_multiplier

    def noise_std(self, clipping_norm: float | None = None) -> float:
        """``z C / num_sampled_clients`` (Flower's ``compute_stdv``)."""
        c = self.clipping_norm if clipping_norm is None else clipping_norm
        return self.update_noise_multiplier * c / self.num_sampled_clients

    def divides_by_expected(self) -> bool:
        """Whether the release divides the clipped sum by ``num_sampled_clients`` (``denominator="expected"``,
        the default with an accountant) rather than by the replies (module docstring)."""
        if self.denominator is None:
            return self.accountant is not None
        return self.denominator == "expected"

    def state_dict(self) -> dict:
        """The seed, the release count and the clipping norm: restoring them continues the noise stream where it
        stopped (never replays a round's noise); with an accountant, its state too (``"accountant"``), so that a
        checkpoint restored the torch.optim way (the optimizer's ``load_state_dict``) restores the releases
        accounted with the releases made."""
        out = {"seed": self.seed, "rounds": self.rounds, "clipping_norm": self.clipping_norm}
        if self.accountant is not None and hasattr(self.accountant, "state_dict"):
            out["accountant"] = self.accountant.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; its ``"accountant"`` state goes into this mechanism's accountant (which
        refuses one of another configuration). Everything is checked before anything changes."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict (the mechanism's state_dict), got {type(state).__name__}")
        seed = check_seed(state["seed"])
        rounds = _check_rounds(state["rounds"])
        norm = check_number(state["clipping_norm"], "clipping_norm", allow_equal=False)
        self._check_restored_norm(norm)
        acc_state = state.get("accountant")
        if acc_state is not None and self.accountant is not None:
            self.accountant.load_state_dict(acc_state)  # (checks everything first; the last step that can fail)
        self.seed, self.rounds, self.clipping_norm = seed, rounds, norm

    def __copy__(self):
        """A copy with its own copy of the accountant (a restore checked on a copy never touches the original's)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        if self.accountant is not None:
            new.accountant = copy.copy(self.accountant)
        return new

    def _check_restored_norm(self, norm: float) -> None:
        """(adaptive: within the norm's bounds)"""

    def __repr__(self) -> str:
        shown = {k: v for k, v in vars(self).items()
                 if not k.startswith("_") and k not in ("seed", "last", "noise_source", "accountant")}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def _next_norm(self, clipped: torch.Tensor, finite: torch.Tensor, round_: int) -> tuple[float | None, float | None]:
        return None, None

    def _check_live(self) -> None:
        """The settings a release uses, checked again (attributes may have been set since the constructor)."""
        check_number(self.clipping_norm, "clipping_norm", allow_equal=False)
        check_number(self.noise_multiplier, "noise_multiplier")
        check_int(self.num_sampled_clients, "num_sampled_clients", minimum=1)
        _check_rounds(self.rounds)
        self._check_denominator()
        self._check_accountant()

    def _check_denominator(self) -> None:
        if self.denominator is not None and self.denominator not in DENOMINATORS:
            raise ValueError(f"denominator must be None, 'expected' or 'replies', got {self.denominator!r}")
        if self.weighted and self.denominator == "expected":
            raise ValueError("weighted=True averages with the weights over the replies; denominator='expected' "
                             "divides the uniform sum by num_sampled_clients: choose one")

    def _check_accountant(self) -> None:
        """The accountant must account for this mechanism's releases: the same noise multiplier (an accountant of
        z = 1 stepped by a mechanism adding no noise would report a finite epsilon) and, when it amplifies by
        sampling, ``num_sampled_clients`` as its sample size. (The population is the accountant's alone.)"""
        acc = self.accountant
        if acc is None:
            return
        if not all(hasattr(acc, k) for k in ("step", "epsilon", "noise_multiplier", "sampling", "num_sampled")):
            raise TypeError(f"accountant must be a fastagg.privacy.PrivacyAccountant, got {type(acc).__name__}")
        if not math.isclose(acc.noise_multiplier, self.noise_multiplier, rel_tol=1e-12):
            raise ValueError(f"the accountant composes releases of noise multiplier {acc.noise_multiplier} but "
                             f"{type(self).__name__} adds noise of multiplier {self.noise_multiplier}: its epsilon "
                             "would not be this mechanism's (PrivacyAccountant.for_mechanism makes a matching one)")
        if acc.sampling != "none" and acc.num_sampled != self.num_sampled_clients:
            raise ValueError(f"the accountant samples num_sampled={acc.num_sampled} clients a round but "
                             f"{type(self).__name__} has num_sampled_clients={self.num_sampled_clients}: its "
                             "sampling rate would not be this mechanism's")
        if self.weighted:
            raise ValueError(f"{type(self).__name__}(weighted=True) averages with the clients' weights: its "
                             "sensitivity max_i p_i C is not the C / n the accountant composes; drop weighted=True "
                             "to account for it")
        if self.denominator == "replies" and acc.sampling in ("none", "poisson"):
            raise ValueError(f"{type(self).__name__}(denominator='replies') divides by the number of replies, "
                             f"which the added or removed client changes: the release moves by up to 2 C / (M + 1), "
                             f"not the C / n the accountant's sampling={acc.sampling!r} composes; use "
                             "denominator='expected' (the default with an accountant: McMahan et al.'s fixed "
                             "denominator n = num_sampled_clients)")


class _Fixed(_Mechanism):
    def __init__(self, noise_multiplier: float, clipping_norm: float, num_sampled_clients: int, **kw):
        super().__init__(noise_multiplier, num_sampled_clients, **kw)
        self.clipping_norm = check_number(clipping_norm, "clipping_norm", allow_equal=False)


NORM_RANGE = 1e6  # adaptive clipping's default norm_bounds: the initial norm / 1e6 .. * 1e6


def adaptive_noise_params(noise_multiplier: float, num_sampled_clients: int,
                          clipped_count_stddev: float | None) -> tuple[float, float]:
    """``(clipped_count_stddev, z_update)`` of adaptive clipping (Andrew et al. 2021, Theorem 1; Flower 1.42's
    ``compute_adaptive_noise_params``): the count query's std defaults to ``n / 20``, and the update's noise
    multiplier is raised to ``(z^-2 - (2 sigma_b)^-2)^(-1/2)`` so that the two queries together are as private as
    one Gaussian query of multiplier ``z``. Needs ``z < 2 sigma_b``."""
    if noise_multiplier > 0:
        if clipped_count_stddev is None:
            clipped_count_stddev = num_sampled_clients / 20
        if noise_multiplier >= 2 * clipped_count_stddev:
            raise ValueError(f"noise_multiplier={noise_multiplier} needs clipped_count_stddev > noise_multiplier / 2 "
                             f"(got {clipped_count_stddev}; its default is num_sampled_clients / 20): increase "
                             "clipped_count_stddev or decrease noise_multiplier")
        z = (noise_multiplier ** -2 - (2 * clipped_count_stddev) ** -2) ** -0.5
        if z / noise_multiplier >= 2:
            warnings.warn(f"adaptive clipping raises the update's noise multiplier {z / noise_multiplier:.2f}x "
                          f"(to {z:.4g}); consider a larger clipped_count_stddev or num_sampled_clients",
                          RuntimeWarning, stacklevel=3)
        return float(clipped_count_stddev), float(z)
    return float(clipped_count_stddev or 0.0), 0.0


class _Adaptive(_Mechanism):
    adaptive = True

    def __init__(self, noise_multiplier: float, num_sampled_clients: int, initial_clipping_norm: float = 0.1,
                 target_clipped_quantile: float = 0.5, clip_norm_lr: float = 0.2,
                 clipped_count_stddev: float | None = None, *, direction: str = "paper",
                 norm_bounds: tuple[float, float] | None = None, **kw):
        super().__init__(noise_multiplier, num_sampled_clients, **kw)
        self.clipping_norm = check_number(initial_clipping_norm, "initial_clipping_norm", allow_equal=False)
        if norm_bounds is None:
            norm_bounds = (self.clipping_norm / NORM_RANGE, self.clipping_norm * NORM_RANGE)
        if not (isinstance(norm_bounds, (tuple, list)) and len(norm_bounds) == 2):
            raise ValueError(f"norm_bounds must be (lowest, highest) clipping norms, got {norm_bounds!r}")
        lo = check_number(norm_bounds[0], "norm_bounds[0]", allow_equal=False)
        hi = check_number(norm_bounds[1], "norm_bounds[1]", allow_equal=False)
        if not lo <= self.clipping_norm <= hi:
            raise ValueError(f"norm_bounds={norm_bounds!r} must hold initial_clipping_norm={self.clipping_norm}")
        self.norm_bounds = (lo, hi)
        q = check_number(target_clipped_quantile, "target_clipped_quantile")
        if not q <= 1:
            raise ValueError(f"target_clipped_quantile must be in [0, 1], got {q!r}")
        self.target_clipped_quantile = q
        self.clip_norm_lr = check_number(clip_norm_lr, "clip_norm_lr", allow_equal=False)
        if clipped_count_stddev is not None:
            clipped_count_stddev = check_number(clipped_count_stddev, "clipped_count_stddev")
        if direction not in ("paper", "flower"):
            raise ValueError(f"direction must be 'paper' or 'flower', got {direction!r}")
        self.direction = direction
        self.clipped_count_stddev, self._z_update = adaptive_noise_params(self.noise_multiplier,
                                                                          self.num_sampled_clients,
                                                                          clipped_count_stddev)

    @property
    def update_noise_multiplier(self) -> float:
        return self._z_update

    def _next_norm(self, clipped: torch.Tensor, finite: torch.Tensor, round_: int) -> tuple[float, float]:
        """Andrew et al.'s geometric update from a noised count: with ``f`` the noised fraction of clipped updates
        (``(count + N(0, sigma_b^2)) / M``), ``C <- C exp(lr (f - q))`` (``direction="paper"``: too many clipped,
        C grows towards the ``1 - q`` quantile of the norms, i.e. a fraction ``q`` clipped) or Flower 1.42's
        ``C <- C exp(-lr (f - q))`` (``direction="flower"``, its sign: C moves away from the target)."""
        count = float(clipped.sum())
        total = self.num_sampled_clients if self.divides_by_expected() else clipped.numel()
        noisy = (count + self.clipped_count_stddev * count_noise(self.seed, round_)) / total
        sign = 1.0 if self.direction == "paper" else -1.0
        # the noised fraction projected on [0, 1] (post-processing: a fraction is in [0, 1]); with few replies
        # against num_sampled_clients the count's noise dominates, and unprojected it random-walks C to 0 or Inf
        frac = min(max(noisy, 0.0), 1.0)
        lo, hi = self.norm_bounds
        log_c = math.log(self.clipping_norm) + sign * self.clip_norm_lr * (frac - self.target_clipped_quantile)
        return math.exp(min(max(log_c, math.log(lo)), math.log(hi))), noisy

    def _check_restored_norm(self, norm: float) -> None:
        lo, hi = self.norm_bounds
        if not lo <= norm <= hi:
            raise ValueError(f"clipping_norm {norm!r} is outside the mechanism's norm_bounds {self.norm_bounds}")


class ServerSideFixedClipping(_Fixed):
    """Central DP with server-side fixed clipping (Flower's ``DifferentialPrivacyServerSideFixedClipping``):
    ``est = (1/D) sum_i min(1, C / ||delta_i||) delta_i + N(0, (z C / n)^2 I)`` with ``delta_i`` the client's
    update against the current model (what Flower clips), ``n = num_sampled_clients``, ``D`` = ``n`` or the ``M``
    replies (``denominator``, module docstring). Two reads of the updates
    (norms, then the clipped sum with the noise written in)."""


class ClientSideFixedClipping(_Fixed):
    """Central DP with client-side fixed clipping (Flower's ``DifferentialPrivacyClientSideFixedClipping``): the
    clients clip to ``C`` (``fastagg.client.clip_updates`` or ``fastagg.flower.fixedclipping_mod``) and the
    server adds ``N(0, (z C / n)^2 I)`` to their mean: one read of the updates, what FedAvg costs. An update that
    arrives longer than ``C`` is clipped again here (counted in ``clipped``)."""

    client_side = True


class ServerSideAdaptiveClipping(_Adaptive):
    """Central DP with server-side adaptive clipping (Andrew et al., "Differentially Private Learning with Adaptive
    Clipping", NeurIPS 2021; Flower's ``DifferentialPrivacyServerSideAdaptiveClipping`` and its arguments): clip to
    the current ``C``, add ``N(0, (z_u C / n)^2 I)`` with ``z_u`` from :func:`adaptive_noise_params`, then move
    ``C`` geometrically with the noised fraction of clipped updates (``_next_norm``). The noise is calibrated to
    the ``C`` the round clipped with (the sensitivity); Flower 1.42 calibrates it to the updated ``C``, which is
    smaller than the sensitivity whenever ``C`` shrinks. The norm moves with the noised fraction projected on
    [0, 1] (a factor of at most ``exp(clip_norm_lr)`` a round) and stays within ``norm_bounds`` (default
    ``initial_clipping_norm / 1e6`` to ``* 1e6``): with few replies against ``num_sampled_clients`` the count's
    noise would otherwise random-walk it to 0 or Inf, after which every release is refused."""


class ClientSideAdaptiveClipping(_Adaptive):
    """Adaptive clipping with the clipping done by the clients (Flower's
    ``DifferentialPrivacyClientSideAdaptiveClipping`` with ``adaptiveclipping_mod``): they clip to the ``C`` they
    were sent and report whether they clipped (``norm_bits``, passed with :meth:`set_norm_bits` before the step;
    without them, a client counts as clipped when its update's norm is within 1e-5 of ``C``, as clipping leaves
    it). The server adds the noise and moves ``C``."""

    client_side = True

    def set_norm_bits(self, bits) -> None:
        """The clients' reports for the next release (1: the client clipped its update), in reply order."""
        self._norm_bits = torch.as_tensor(bits).to(torch.bool).reshape(-1)


MECHANISMS = (ServerSideFixedClipping, ServerSideAdaptiveClipping, ClientSideFixedClipping,
              ClientSideAdaptiveClipping)


# -- a release ---------------------------------------------------------------------------------------------------
def dp_round(rows: ClientRows, weights: Any, mech: _Mechanism, backend, *, mean_out: torch.Tensor | None = None,
             mean_dtype: torch.dtype | None = None) -> DPResult:
    """One private release over ``rows`` (see the module docstring); every argument is checked before any
    write, and the mechanism's state (release count, clipping norm) advances only after the release."""
    if not isinstance(mech, MECHANISMS):
        raise TypeError(f"expected a fastagg.privacy mechanism, got {type(mech).__name__}")
    mech._check_live()
    if weights is not None and not mech.weighted:
        raise TypeError(f"{type(mech).__name__} averages the clipped updates uniformly (its noise is calibrated to "
                        "the sensitivity C / n of that mean); drop weights=, or pass weighted=True to the mechanism "
                        "to average with them as Flower's FedAvg does (the sensitivity is then max_i p_i C)")
    m, dev = rows.num_clients, rows.device
    p = normalized_weights(weights, m, dev)
    if mech.divides_by_expected():  # McMahan et al.'s fixed denominator: sensitivity C / n whatever m is
        p = torch.full((m,), 1.0 / mech.num_sampled_clients, dtype=p.dtype, device=dev)
    _check_replies(mech, m, 3)
    bits = getattr(mech, "_norm_bits", None)
    if bits is not None and bits.numel() != m:
        raise ValueError(f"set_norm_bits gave {bits.numel()} reports for {m} clients")
    round_, c = mech.rounds, mech.clipping_norm
    sigma = mech.noise_std(c)
    dtype = mean_dtype or compute_dtype(rows.dtype)
    out = mean_out if mean_out is not None else torch.empty(rows.numel, dtype=dtype, device=dev)
    fused = (sigma, mech.seed, round_) if sigma > 0 and mech.noise_source is None else None
    # pass 1: the norms (client-side: already the release when every update is finite and within C)
    _, sq, bad, msq = run_stats(rows, p, backend, mean_out=out, mean_dtype=dtype,
                              noise=fused if mech.client_side else None)
    norms = sq.sqrt()
    finite = ~bad
    scale = torch.where(norms > c, c / norms, torch.ones_like(norms))
    scale = torch.where(finite, scale, torch.zeros_like(scale))
    clipped = finite & (norms > c)
    # one host read a release: which clients are non-finite (and, client-side, whether any must be clipped). The
    # server-side clipped sum over every client is launched before it, so the two passes run back to back; it is
    # redone without the non-finite clients when there are some (0 * NaN would be NaN)
    if mech.client_side:
        bad_host, clipped_host = torch.stack((bad, clipped)).tolist()
        again = any(bad_host) or any(clipped_host)
    else:
        _, _, _, msq = run_stats(rows, p * scale, backend, mean_out=out, mean_dtype=dtype, noise=fused)
        bad_host = bad.tolist()
        again = any(bad_host)
    if all(bad_host):
        raise ValueError(f"every one of the {m} clients' updates holds NaN or Inf: nothing to release")
    if again:
        keep = [i for i, b in enumerate(bad_host) if not b]  # a non-finite client is left out
        sub = rows if len(keep) == m else subset_rows(rows, keep)
        coefs = p * scale if len(keep) == m else (p * scale)[torch.tensor(keep, device=dev)]
        _, _, _, msq = run_stats(sub, coefs, backend, mean_out=out, mean_dtype=dtype, noise=fused)
    if _add_source_noise(mech, out, sigma, round_):
        msq = None
    if mech.adaptive and mech.client_side:
        reported = bits.to(dev) if bits is not None else finite & (norms >= c * (1 - 1e-5))
        counted = reported & finite
    else:
        counted = clipped
    sq = torch.where(finite, sq, torch.full_like(sq, float("nan")))
    return _finish(mech, out, c, sigma, clipped, ~finite, sq, round_, counted, msq)


def _check_replies(mech: _Mechanism, m: int, stacklevel: int) -> None:
    """``m`` replies against ``num_sampled_clients``: nothing to say with the fixed denominator (the sensitivity is
    ``C / n`` for any ``m``); dividing by ``m``, a warning, or a refusal when an accountant composes replace-one
    releases of exactly ``n`` clients (``m < n`` would move the mean by ``2 C / m > 2 C / n``)."""
    n = mech.num_sampled_clients
    if m == n or mech.divides_by_expected():
        return
    if mech.accountant is not None:
        raise ValueError(f"{m} clients replied but the accountant composes releases of num_sampled_clients={n} "
                         f"(sampling={mech.accountant.sampling!r}); {type(mech).__name__}(denominator='replies') "
                         f"would divide by {m}, so its epsilon would not hold: use denominator='expected'; nothing "
                         "was released")
    warnings.warn(CLIENTS_DISCREPANCY.format(replies=m, expected=n), RuntimeWarning, stacklevel=stacklevel + 1)


def _add_source_noise(mech: _Mechanism, out: torch.Tensor, sigma: float, round_: int) -> bool:
    """With ``noise_source=``: its samples times sigma, added in a pass of their own; returns whether it did."""
    if sigma > 0 and mech.noise_source is not None:
        z = mech.noise_source(out.numel(), round_, out.dtype, out.device)
        if not isinstance(z, torch.Tensor) or z.numel() != out.numel():
            raise ValueError(f"noise_source must return a tensor of {out.numel()} samples")
        if not bool(torch.isfinite(z).all()):
            raise ValueError("noise_source returned NaN or Inf; nothing was updated")
        out.add_(z.to(device=out.device, dtype=out.dtype).reshape(-1), alpha=sigma)
        return True
    return False


def _finish(mech: _Mechanism, out, c, sigma, clipped, excluded, sq, round_, counted, mean_sq=None) -> DPResult:
    """Advance the mechanism after a release: the release count, the adaptive clipping norm (from ``counted``,
    the clients counted as clipped), the accountant."""
    next_c, noisy = mech._next_norm(counted, ~excluded, round_)
    mech.rounds = round_ + 1
    if next_c is not None:
        mech.clipping_norm = next_c
    if getattr(mech, "_norm_bits", None) is not None:
        mech._norm_bits = None
    eps = None
    if mech.accountant is not None:
        behind = round_ - mech.accountant.releases
        if behind > 0:  # (a restored mechanism with a fresh or older accountant: never an epsilon below its releases)
            warnings.warn(f"{type(mech).__name__} has made {round_} releases before this one but its accountant "
                          f"has composed {mech.accountant.releases}: the accountant is stepped {behind} more "
                          "(restore the accountant with the mechanism: its state_dict carries it)", RuntimeWarning,
                          stacklevel=4)
            mech.accountant.step(behind)
        mech.accountant.step()
        eps = mech.accountant.epsilon()
    if mean_sq is None:  # (noise from noise_source= was added after the pass)
        est64 = out.to(torch.float64)
        mean_sq = est64 @ est64
    mech.last = DPResult(out, c, sigma, clipped, excluded, sq, round_, next_c, noisy, eps, mean_sq)
    return mech.last


def clip_scale(norm: float, clipping_norm: float) -> float:
    """``min(1, C / ||delta||)`` (1 for a zero update; NaN for a non-finite one)."""
    return clipping_norm / norm if norm > clipping_norm else (1.0 if norm == norm else float("nan"))


def release_from_sum(clipped_sum: Any, clipped: list, mech: _Mechanism, backend, *,
                     mean_dtype: torch.dtype | None = None) -> DPResult:
    """A server-side release from the *sum* of the clipped updates ``sum_i min(1, C/||delta_i||) delta_i``
    (folded as the results arrived, e.g. into an :class:`fastagg.Accumulator` with the clip scales as weights),
    for aggregators that stream results instead of holding them (fastagg.nvflare): one pass reads the sum, scales
    it by ``1/D`` (``1/n`` or ``1/M``, the mechanism's ``denominator``) and writes the release with the noise as it goes. ``clipped``: one bool per folded client
    (whether it was scaled), for adaptive clipping's count. The clipping norm used is ``mech.clipping_norm``."""
    if mech.client_side:
        raise TypeError("release_from_sum releases a server-side mechanism's sum of clipped updates")
    mech._check_live()
    m = len(clipped)
    if m < 1:
        raise ValueError("release_from_sum needs at least one folded client")
    _check_replies(mech, m, 2)
    rows = client_rows([clipped_sum], name="clipped_sum")
    round_, c = mech.rounds, mech.clipping_norm
    sigma = mech.noise_std(c)
    fused = (sigma, mech.seed, round_) if sigma > 0 and mech.noise_source is None else None
    denominator = mech.num_sampled_clients if mech.divides_by_expected() else m
    coef = torch.full((1,), 1.0 / denominator, dtype=torch.float64, device=rows.device)
    out, _, bad, msq = run_stats(rows, coef, backend, mean_dtype=mean_dtype, noise=fused)
    if bool(bad.any()):
        raise ValueError("the sum of the clipped updates holds NaN or Inf")
    if _add_source_noise(mech, out, sigma, round_):
        msq = None
    flags = torch.tensor([bool(x) for x in clipped], dtype=torch.bool, device=rows.device)
    none = torch.zeros_like(flags)
    return _finish(mech, out, c, sigma, flags, none, torch.full((m,), float("nan"), dtype=torch.float64,
                                                                device=rows.device), round_, flags, msq)


def dp_stats(rows: ClientRows, weights: Any, mech: _Mechanism, backend, *, name: str, mean_out=None,
             mean_dtype=None) -> tuple[RoundStats, DPResult]:
    """A server step's statistics with the private release as its mean: ``mean_sq = ||est||^2`` (noise
    included), ``avg_sq`` the mean of the *clipped* squared norms ``min(||delta_i||, C)^2`` (what FedExP's eta
    should see under DP: the raw norms are not private; see :class:`fastagg.server.FedExP`), every client finite
    (the non-finite ones were left out)."""
    res = dp_round(rows, weights, mech, backend, mean_out=mean_out, mean_dtype=mean_dtype)
    mean_sq = res.mean_sq
    keep = ~res.excluded
    p = normalized_weights(weights if mech.weighted else None, rows.num_clients, rows.device)
    p = torch.where(keep, p, torch.zeros_like(p))
    p = p / p.sum()
    clipped_sq = torch.nan_to_num(res.sq_norms).clamp(max=res.clipping_norm ** 2)
    stats = RoundStats(res.estimate, clipped_sq, torch.zeros(rows.num_clients, dtype=torch.bool, device=rows.device),
                       mean_sq, (p * clipped_sq).sum(), rows.num_clients, rows.form, name)
    stats.coefs = p
    if rows.buffers is not None:  # an unnoised average of BatchNorm statistics would leak what the noise hides
        if not getattr(mech, "_warned_buffers", False):
            warnings.warn(f"{type(mech).__name__}: the clients' buffers ({', '.join(rows.buffers.names[:3])}...) are "
                          "not private when averaged, so the model keeps its own; buffers='optimizer' clips and "
                          "noises the floating ones with the parameters", RuntimeWarning, stacklevel=4)
            mech._warned_buffers = True
        stats.buffers = Buffers(rows.buffers.names, [])
        stats.buffer_sums = [None] * len(rows.buffers.names)
    return stats, res
