"""Byzantine-robust aggregation: estimates of the clients' update that a minority of bad clients cannot move far.

Two kinds of rule, each reading the updates where they lie (matrix, list of rows, per-layer lists, state_dicts,
numpy, full models with ``base=``) and never building an ``[M, d]`` copy:

* **coordinate-wise** rules (:class:`Median`, :class:`TrimmedMean`, :class:`MeaMed`) look at each coordinate's M
  values; they run a coordinate-select pass over column blocks (``M x BLOCK`` at a time, float64);
* **whole-update** rules (:class:`Krum`, :class:`MultiKrum`, :class:`Bulyan`, :class:`GeometricMedian`,
  :class:`NormBound`) need only the ``M x M`` Gram matrix of the updates (one pass, float64 block sums, the
  updates formed against ``base`` before any product, so no cancellation of full models) to choose coefficients;
  the estimate is then one weighted-sum pass of fastagg's fused stats kernel (C++ or Triton). Bulyan's last step
  is a coordinate-select pass over the clients it selected; GeometricMedian reads a second Gram matrix, of the
  updates less the medoid's (its Weiszfeld distances would cancel in the first).

A finite float64 update whose squares overflow float64 (values beyond ~1e154) is still measured: the Krum family
orders its Inf distances (farther than every other), GeometricMedian, CenteredClipping and NormBound rerun the
Gram pass on updates scaled by powers of two (plain torch, on the device: an attack is not the fast path); only a
round whose differences overflow even scaled (values near 1.8e308 of both signs) is refused, naming the client.

BatchNorm statistics and other buffers never enter the Gram matrix: the coordinate-wise rules (and Bulyan's last
step) apply to each buffer element, the other whole-update rules take each element's median over the clients left
in (a client they select for its update is not thereby trusted with its statistics).

A client whose update or buffers hold NaN or Inf (or whose ``running_var`` holds a negative variance) is an
attacker here, not an accident: it is left out before any rule sees it and reported (``excluded``); it never
reaches the estimate, and it counts as one of the ``num_malicious`` a rule tolerates (the rule runs over the
clients left with ``num_malicious`` less the left-out ones, at least 0: its bound and its counts hold for the
attackers that can remain). Every rule is available as a
``fastagg.server`` optimizer's ``aggregate=`` (the estimate replaces the weighted mean) and through
:func:`aggregate`.

Both passes run on fastagg's backends (``coord_select`` and ``gram``: C++ on CPU tensors, Triton on CUDA tensors,
plain torch in the reference backend, the oracle); each also yields every client's squared norm and non-finite
mark, so a round that finds every client finite reads the updates once (coordinate-wise rules) or twice (Gram
pass, then the weighted sum; GeometricMedian three times: its centred Gram pass between).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from ._checks import check_int, check_number, normalized_weights
from .backends import column_blocks, resolve, select_sorted
from .compress.fold import densified
from .passes import RoundStats, run_stats
from .rows import Buffers, ClientRows, attach_base, client_rows, compute_dtype, subset_rows

__all__ = ["TooFewClients", "Median", "TrimmedMean", "MeaMed", "Krum", "MultiKrum", "Bulyan", "GeometricMedian",
           "NormBound", "CenteredClipping", "RobustResult", "aggregate", "gram"]

class TooFewClients(ValueError):
    """A rule's bound on the number of clients does not hold this round (Krum: M > 2f + 2; Bulyan: M >= 4f + 3)."""


@dataclasses.dataclass
class RobustResult:
    """One robust round: the ``estimate`` [d] (compute dtype), which clients entered it (``selected``, bool [M]),
    which were left out as non-finite (``excluded``), per-client squared norms (NaN for the excluded), the rule's
    per-client ``scores`` (Krum's; None for other rules), the coefficients of the final weighted sum
    (``coefs``, None for coordinate-wise rules), ``clipped`` (NormBound, CenteredClipping: how many updates were
    scaled) and, for the whole-update rules, the clients' pairwise squared ``distances``."""

    estimate: torch.Tensor
    selected: torch.Tensor
    excluded: torch.Tensor
    sq_norms: torch.Tensor
    scores: torch.Tensor | None = None
    coefs: torch.Tensor | None = None
    clipped: int = 0
    distances: torch.Tensor | None = None  # [M, M] squared distances of the updates (whole-update rules; NaN: left out)


# -- passes ------------------------------------------------------------------------------------------------------
def gram(rows: ClientRows, backend="auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, nonfinite)``: ``G[i, j] = <delta_i, delta_j>`` (float64 [M, M], the updates formed against ``base``
    before any product) and each client's non-finite mark, in one pass of ``backend``'s Gram kernel."""
    backend = resolve(backend, rows.device) if isinstance(backend, str) else backend
    m = rows.num_clients
    g = torch.empty(m * m, dtype=torch.float64, device=rows.device)
    bad = torch.zeros(m, dtype=torch.bool, device=rows.device)
    backend.gram(rows=rows, gram_out=g, nonfinite_out=bad)
    return g.view(m, m), bad


def _select_coords(rows: ClientRows, selection: tuple, backend, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The coordinate-select pass: ``out[j]`` from the sorted values of coordinate j (``selection``: a rule's
    ``positions(M)``, ``(rule, first, count)``, see ``backends.select_sorted``); returns the clients' squared
    norms and non-finite marks from the same read. More clients than the Triton kernel sorts in registers: the
    reference pass (torch.sort over column blocks, on the same device)."""
    backend = resolve(backend, rows.device) if isinstance(backend, str) else backend
    m = rows.num_clients
    sq = torch.empty(m, dtype=torch.float64, device=rows.device)
    bad = torch.zeros(m, dtype=torch.bool, device=rows.device)
    if backend.name == "triton" and m > backend.robust.MAX_SELECT_CLIENTS:
        backend = resolve("reference", rows.device)
    rule, first, count = selection
    backend.coord_select(rows=rows, rule=rule, first=first, count=count, out=out, sq_norms_out=sq, nonfinite_out=bad)
    return sq, bad


def _buffers_valid(rows: ClientRows) -> torch.Tensor:
    """Whether each client's buffers (BatchNorm statistics) are valid: finite, and every variance (a buffer named
    ``running_var`` or ``*.running_var``, BatchNorm's) >= 0. A client sending anything else is left out as well."""
    ok = torch.ones(rows.num_clients, dtype=torch.bool, device=rows.device)
    if rows.buffers is not None:
        for name, values in zip(rows.buffers.names, rows.buffers.values):  # every client's value at once, no host
            same = len({(v.dtype, v.device) for v in values}) == 1 and values[0].device == rows.device  # read
            st = torch.stack(values if same else [v.to(rows.device, torch.float64) for v in values]).reshape(
                len(values), -1)  # (mixed dtypes in float64: an integer is finite there too, its sign kept)
            if st.is_floating_point():
                ok &= torch.isfinite(st).all(1)
            if str(name).rsplit(".", 1)[-1] == "running_var":
                ok &= ~(st < 0).any(1)
    return ok


# -- rules -------------------------------------------------------------------------------------------------------

class _Rule:
    coordinatewise = False
    weighted = False  # whether weights= changes the estimate (else they are refused, not silently ignored)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def _over_kept(self, left_out: int) -> "_Rule":
        """This rule over the clients left after ``left_out`` non-finite ones were left out (a copy: the user's
        rule is never changed). Each left-out client is one of the ``num_malicious`` attackers the rule tolerates,
        so at most ``num_malicious - left_out`` (at least 0) remain, and the bound and counts use that."""
        rule = copy.copy(self)
        if hasattr(rule, "num_malicious"):
            rule.num_malicious = max(0, rule.num_malicious - left_out)
        return rule


class Median(_Rule):
    """Coordinate-wise median (Yin et al., 2018): ``est_j = median_i delta_ij``. With an even number of clients
    ``even="mean"`` (default) averages the two middle values, as numpy's and Flower's ``FedMedian`` do;
    ``even="lower"`` takes the lower one, as ``torch.median`` does. Unweighted (Flower's FedMedian too)."""

    coordinatewise = True

    def __init__(self, even: str = "mean"):
        if even not in ("mean", "lower"):
            raise ValueError(f"even must be 'mean' or 'lower', got {even!r}")
        self.even = even

    def positions(self, m: int) -> tuple:
        if m % 2 or self.even == "lower":
            return "window", (m - 1) // 2, 1
        return "window", m // 2 - 1, 2


class TrimmedMean(_Rule):
    """Coordinate-wise trimmed mean (Yin et al., 2018): drop the ``k = int(beta * M)`` smallest and largest values
    of each coordinate, average the rest -- Flower's ``FedTrimmedAvg`` (``beta``, its rounding) and scipy's
    ``trim_mean``. ``beta`` in [0, 0.5)."""

    coordinatewise = True

    def __init__(self, beta: float = 0.2):
        beta = check_number(beta, "beta")
        if not beta < 0.5:
            raise ValueError(f"beta must be in [0, 0.5) (the fraction cut at each end), got {beta!r}")
        self.beta = beta

    def positions(self, m: int) -> tuple:
        k = int(self.beta * m)
        return "window", k, m - 2 * k


class MeaMed(_Rule):
    """Mean around the median (Xie et al., 2018, "Generalized Byzantine-tolerant SGD"): for each coordinate, the
    mean of the ``M - num_malicious`` values nearest the coordinate's median (``Median(even="mean")``); of two
    values equally far, the lower one is kept (dropping the farther end of the sorted values, the upper on a
    tie). Needs ``num_malicious < M``."""

    coordinatewise = True

    def __init__(self, num_malicious: int):
        self.num_malicious = check_int(num_malicious, "num_malicious")

    def check(self, m: int) -> None:
        if not self.num_malicious < m:
            raise TooFewClients(f"MeaMed needs num_malicious < M (the clients left); {self.num_malicious} >= {m}")

    def positions(self, m: int) -> tuple:
        return "nearest", 0, m - self.num_malicious


def _sq_distances(g: torch.Tensor) -> torch.Tensor:
    """``||delta_i - delta_j||^2 = G_ii + G_jj - 2 G_ij`` (float64, >= 0); Inf where the squares of a finite
    update overflow float64 (Inf - Inf there is a distance beyond float64, not NaN)."""
    d2 = g.diagonal()[:, None] + g.diagonal()[None, :] - 2 * g
    d2 = torch.nan_to_num(d2, nan=float("inf"), posinf=float("inf"), neginf=float("inf")).clamp_min(0)
    return d2.fill_diagonal_(0.0)  # (a client's distance to itself, Inf - Inf when its squares overflow)


def _medoid(d2: torch.Tensor, a: torch.Tensor, sq: torch.Tensor) -> int:
    """The client of least weighted distance ``sum_j a_j ||delta_i - delta_j||`` to the others; distances beyond
    float64 (Inf) are counted first: the client with the least weight beyond reach, then the least finite sum,
    then the least squared norm ``sq`` (of clients that far apart, the one nearest the origin)."""
    far = torch.isinf(d2)
    beyond = far.to(a.dtype) @ a
    inf = torch.full_like(beyond, float("inf"))
    cost = torch.where(beyond == beyond.min(), torch.where(far, torch.zeros_like(d2), d2).sqrt() @ a, inf)
    return int(torch.argmin(torch.where(cost == cost.min(), torch.nan_to_num(sq), inf)))


def _scaled_gram(rows: ClientRows, big: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H, n)`` for updates whose float64 squares overflow: ``n_i`` a power of two (1 unless ``big[i]``; else
    ``max_j |delta_ij| / n_i`` in [1, 2)) and ``H`` the Gram matrix of ``delta_i / n_i`` (float64, every entry
    at most 4d in size). Two reads in plain torch over column blocks on the rows' device (the reference backend's
    blocks): a round with such a client is an attack, not the fast path."""
    m = rows.num_clients
    peak = torch.zeros(m, dtype=torch.float64, device=rows.device)
    for _, x in column_blocks(rows):
        peak = torch.maximum(peak, x.to(torch.float64).abs().amax(dim=1))
    n = torch.where(big, torch.ldexp(torch.full_like(peak, 0.5), torch.frexp(peak).exponent), torch.ones_like(peak))
    h = torch.zeros(m, m, dtype=torch.float64, device=rows.device)
    for _, x in column_blocks(rows):
        y = x.to(torch.float64) / n[:, None]
        h += y @ y.T
    return h, n


def _krum_scores(g: torch.Tensor, f: int, strict: bool = True) -> torch.Tensor:
    """Krum's score of each client: the sum of its squared distances to its ``M - f - 2`` nearest others
    (``max(1, M - f - 2)`` when not ``strict``, as Flower counts; distances ``G_ii + G_jj - 2 G_ij`` of the
    updates, float64)."""
    m = g.shape[0]
    d2 = _sq_distances(g)
    d2.fill_diagonal_(float("inf"))
    k = m - f - 2 if strict else min(max(1, m - f - 2), m - 1)
    if k <= 0:
        return torch.zeros(m, dtype=g.dtype, device=g.device)
    return torch.topk(d2, k, dim=1, largest=False).values.sum(dim=1)


class Krum(_Rule):
    """Krum (Blanchard et al., NeurIPS 2017): the update whose ``M - f - 2`` nearest others are nearest (smallest
    sum of squared distances), ``f = num_malicious``. Needs ``M > 2f + 2`` (``strict=False``: Flower's count,
    ``max(1, M - f - 2)`` neighbours and no bound, for its drop-ins). :class:`MultiKrum` averages the
    ``num_selected`` best-scored."""

    def __init__(self, num_malicious: int, *, strict: bool = True):
        self.num_malicious = check_int(num_malicious, "num_malicious")
        self.strict = bool(strict)

    num_selected = 1

    def check(self, m: int) -> None:
        f = self.num_malicious
        if self.strict and not m > 2 * f + 2:
            raise TooFewClients(f"{type(self).__name__} needs M > 2 num_malicious + 2 = {2 * f + 2}; {m} clients left")

    def choose(self, g: torch.Tensor, coefs: torch.Tensor):
        """The ``num_selected`` clients of lowest score among those of positive weight (a zero-weight client is
        scored, as one of the others, but never chosen: it would enter the estimate with coefficient 0/0)."""
        scores = _krum_scores(g, self.num_malicious, self.strict)
        candidates = torch.where(coefs > 0, scores, torch.full_like(scores, float("inf")))
        chosen = torch.argsort(candidates, stable=True)[:min(self.num_selected, int((coefs > 0).sum()))]
        return chosen, scores


class MultiKrum(Krum):
    """Multi-Krum (Blanchard et al.; Flower's ``MultiKrum``): the ``num_selected`` updates of lowest Krum score,
    averaged with the weights (examples) renormalized over them. ``num_selected`` defaults to ``M - f``."""

    weighted = True

    def __init__(self, num_malicious: int, num_selected: int | None = None, *, strict: bool = True):
        super().__init__(num_malicious, strict=strict)
        if num_selected is not None:
            num_selected = check_int(num_selected, "num_selected", minimum=1)
        self._num_selected = num_selected

    def check(self, m: int) -> None:
        super().check(m)
        if self._num_selected is not None and self._num_selected > m:
            raise TooFewClients(f"num_selected={self._num_selected} but only {m} clients are left")
        self.num_selected = self._num_selected if self._num_selected is not None else m - self.num_malicious


class Bulyan(_Rule):
    """Bulyan (El Mhamdi et al., ICML 2018): select ``theta = M - 2f`` updates by iterated Krum (Krum's winner
    among the remaining ones, removed, again), then for each coordinate average the ``beta = theta - 2f`` selected
    values nearest the coordinate's median. Needs ``M >= 4f + 3``. ``selection="multikrum"``: Flower's variant,
    the ``theta`` best of one Multi-Krum scoring (Flower's neighbour count)."""

    coordinatewise = False

    def __init__(self, num_malicious: int, *, selection: str = "iterated"):
        self.num_malicious = check_int(num_malicious, "num_malicious")
        if selection not in ("iterated", "multikrum"):
            raise ValueError(f"selection must be 'iterated' (the paper's) or 'multikrum' (Flower's), got {selection!r}")
        self.selection = selection

    def check(self, m: int) -> None:
        f = self.num_malicious
        if not m >= 4 * f + 3:
            raise TooFewClients(f"Bulyan needs M >= 4 num_malicious + 3 = {4 * f + 3}; {m} clients left")

    def positions(self, theta: int) -> tuple:
        """The last step over the ``theta`` selected clients: the mean of the ``theta - 2f`` values nearest each
        coordinate's median."""
        return "nearest", 0, theta - 2 * self.num_malicious

    def choose(self, g: torch.Tensor, coefs: torch.Tensor):
        m, f = g.shape[0], self.num_malicious
        if self.selection == "multikrum":
            return torch.argsort(_krum_scores(g, f, strict=False), stable=True)[:m - 2 * f].sort().values, None
        left = list(range(m))
        chosen = []
        for _ in range(m - 2 * f):
            sub = g[left][:, left]
            scores = _krum_scores(sub, f)
            win = left[int(torch.argmin(scores))]
            chosen.append(win)
            left.remove(win)
        return torch.tensor(sorted(chosen)), None


class GeometricMedian(_Rule):
    """Geometric median by smoothed Weiszfeld iterations (RFA, Pillutla et al., 2022): ``z = sum_i c_i delta_i``
    with ``c_i ~ a_i / max(nu, ||z - delta_i||)`` (``a_i`` the weights), repeated until the objective
    ``sum_i a_i ||z - delta_i||`` improves by less than ``tol`` (relative) or ``max_iter`` iterations. Every
    iteration runs on the M x M Gram matrix alone -- of ``delta_i - delta_k``, k the medoid, from a second Gram
    pass: ``||z - delta_j||^2`` from an uncentred G loses ~1e-16 ||delta||^2, all of it when z is near one update
    and the updates share a large part (at 10^6 parameters the iteration froze at the medoid); the estimate is one
    weighted sum. A finite float64 update whose squares overflow float64 is measured scaled by a power of two
    (its weight ``a_j / ||z - delta_j||`` tiny, never 0/0); a round whose differences overflow even scaled is
    refused (ValueError naming the client)."""

    weighted = True

    def __init__(self, nu: float = 1e-6, max_iter: int = 100, tol: float = 1e-10):
        self.nu = check_number(nu, "nu", minimum=0.0, allow_equal=False)
        self.max_iter = check_int(max_iter, "max_iter", minimum=1)
        self.tol = check_number(tol, "tol")

    def coefficients(self, g: torch.Tensor, a: torch.Tensor, n: torch.Tensor | None = None,
                     start: int | None = None) -> torch.Tensor:
        """Weiszfeld's coefficients from ``g``, the Gram matrix of ``delta_i / n_i`` (``n`` powers of two, 1 unless
        a client's squares overflow float64: see ``_scaled_gram``; None: all 1), starting at client ``start``
        (None: the medoid of ``g``'s distances). The iteration runs on ``c_i n_i`` and ``||z - delta_j|| / n_j``,
        which stay finite when a client's distance does not: its weight ``a_j / ||z - delta_j||`` is then tiny,
        never 0/0."""
        # start from the medoid (the update of least weighted distance to the others), not the mean: one client
        # sending 1e38 puts the mean so far out that max_iter iterations do not come back
        n = torch.ones_like(a) if n is None else n
        ch = torch.zeros_like(a)  # c_i n_i: the coefficients of delta_i / n_i
        k = _medoid(_sq_distances(g), a, g.diagonal()) if start is None else start
        ch[k] = n[k]

        def scaled_dists(ch):  # ||z - delta_j|| / n_j with z = sum_i c_i delta_i, from G alone
            gc = g @ ch
            return ((ch @ gc) / n / n - 2 * gc / n + g.diagonal()).clamp_min(0).sqrt()

        exact = bool((n == 1).all())  # the objective sum_j a_j ||z - delta_j|| is finite: stop on its progress
        obj = float((a * n * scaled_dists(ch)).sum())
        for _ in range(self.max_iter):
            wn = a / torch.maximum(scaled_dists(ch), self.nu / n)  # w_j n_j, w_j = a_j / max(nu, ||z - delta_j||)
            ch = wn / (wn / n).sum()
            if exact:
                new = float((a * scaled_dists(ch)).sum())
                if obj - new <= self.tol * max(obj, 1e-300):
                    break
                obj = new
        return ch / n


class NormBound(_Rule):
    """Norm bounding ("clip then average"; Sun et al., 2019): each update is scaled to norm at most ``max_norm``,
    ``est = sum_i p_i min(1, C / ||delta_i||) delta_i``."""

    weighted = True

    def __init__(self, max_norm: float):
        self.max_norm = check_number(max_norm, "max_norm", minimum=0.0, allow_equal=False)


class CenteredClipping(_Rule):
    """Centered clipping (Karimireddy, He and Jaggi, ICML 2021, "Learning from History for Byzantine Robust
    Optimization"): ``iters`` times ``v <- v + sum_i a_i min(1, tau / ||delta_i - v||) (delta_i - v)``
    (``a_i`` the normalized weights; the paper's 1/M when unweighted). The paper starts from the server's momentum;
    here ``v_0 = 0``, so the first iteration is ``NormBound(tau)`` and the later ones re-center on the clipped
    estimate. ``v`` stays a combination of the updates, so every iteration runs on the M x M Gram matrix alone and
    the estimate is one weighted sum. ``clipped`` reports the last iteration's count."""

    weighted = True

    def __init__(self, tau: float, iters: int = 3):
        self.tau = check_number(tau, "tau", minimum=0.0, allow_equal=False)
        self.iters = check_int(iters, "iters", minimum=1)

    def coefficients(self, g: torch.Tensor, a: torch.Tensor, n: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, int]:
        """The iteration's coefficients from ``g``, the Gram matrix of ``delta_i / n_i`` (``n`` as
        :meth:`GeometricMedian.coefficients`'s), run on ``c_i n_i`` and ``t_i = n_i min(1, tau / ||delta_i - v||)``:
        finite when a client's distance is not."""
        n = torch.ones_like(a) if n is None else n
        ch = torch.zeros_like(a)  # c_i n_i
        clipped = 0
        for _ in range(self.iters):
            gc = g @ ch
            q = (g.diagonal() - 2 * gc / n + (ch @ gc) / n / n).clamp_min(0)  # ||delta_i - v||^2 / n_i^2
            t = torch.minimum(n, self.tau / q.sqrt().clamp_min(1e-300))
            clipped = int((t < n).sum())
            ch = ch * (1 - (a * t / n).sum()) + a * t
        return ch / n, clipped


RULES = (Median, TrimmedMean, MeaMed, Krum, MultiKrum, Bulyan, GeometricMedian, NormBound, CenteredClipping)


# -- a round -----------------------------------------------------------------------------------------------------
def robust_round(rows: ClientRows, weights: Any, rule: _Rule, backend, *, mean_out: torch.Tensor | None = None,
                 mean_dtype: torch.dtype | None = None) -> RobustResult:
    """``rule``'s estimate over ``rows`` (non-finite clients left out first); checks every argument before any
    write. Raises ValueError when no client is left or the rule's bound on M does not hold."""
    if not isinstance(rule, RULES):
        raise TypeError(f"aggregate must be one of fastagg.robust's rules ({', '.join(r.__name__ for r in RULES)}), "
                        f"got {type(rule).__name__}")
    if weights is not None and not rule.weighted:
        raise TypeError(f"{type(rule).__name__} is unweighted (as in its paper and in Flower); drop weights=")
    m, dev = rows.num_clients, rows.device
    raw = normalized_weights(weights, m, dev)  # checks the weights (values, count) before anything
    if hasattr(rule, "check"):
        copy.copy(rule).check(m)  # the bound with every client (checked again below if some are left out)
    dtype = mean_dtype or compute_dtype(rows.dtype)
    out = mean_out if mean_out is not None else torch.empty(rows.numel, dtype=dtype, device=dev)
    buffers_ok = _buffers_valid(rows)
    if rule.coordinatewise:  # one read when every client is finite; a second over the finite ones otherwise
        sq_all, bad = _select_coords(rows, rule.positions(m), backend, out)
    else:
        g_all, bad = gram(rows, backend)
        sq_all = g_all.diagonal().clone()
    finite = ~bad & buffers_ok
    keep = [i for i in range(m) if bool(finite[i])]
    if not keep:
        raise ValueError(f"every one of the {m} clients' updates holds NaN or Inf (or its buffers are invalid): "
                         f"nothing to aggregate")
    rule = rule._over_kept(m - len(keep))  # each client left out is one of the attackers the rule tolerates
    if hasattr(rule, "check"):
        rule.check(len(keep))
    if rule.weighted and not bool((raw[finite] > 0).any()):
        raise ValueError(f"every client of positive weight was left out as non-finite (clients "
                         f"{[i for i in range(m) if bool(raw[i] > 0)]}); the {len(keep)} left have weight 0")
    excluded = ~finite
    sq = torch.full((m,), float("nan"), dtype=torch.float64, device=dev)
    selected = torch.zeros(m, dtype=torch.bool, device=dev)
    kept = torch.tensor(keep, device=dev)
    sq[kept] = sq_all[kept]
    if rule.coordinatewise:
        if len(keep) < m:
            _select_coords(subset_rows(rows, keep), rule.positions(len(keep)), backend, out)
        selected[kept] = True
        return RobustResult(out, selected, excluded, sq)
    g = g_all[kept[:, None], kept[None, :]]  # a NaN row of G touches only its own row and column
    d2 = _sq_distances(g)
    # a finite float64 update whose squares overflow: the Krum family only orders distances (one beyond float64 is
    # farther than any other); the others weigh each update by a norm or distance, measured on updates scaled by
    # powers of two (_scaled_gram), and refuse only what even that cannot measure
    scaled = not isinstance(rule, (Krum, Bulyan)) and not bool(torch.isfinite(d2).all())
    a = raw[kept] / raw[kept].sum()
    if scaled:
        sub = subset_rows(rows, keep)
        big = ~(g.diagonal() <= 2.0 ** 900)  # (the sum of two such squares, twice a product, stays finite)
        if isinstance(rule, GeometricMedian):  # (its Gram matrix centred on the medoid, as below)
            sub = dataclasses.replace(sub, base=[seg[_medoid(d2, a, g.diagonal())] for seg in sub.rows])
        h, n = _scaled_gram(sub, big)
        if not bool(torch.isfinite(h).all()):
            worst = keep[int(torch.argmax(g.diagonal()))]
            raise ValueError(f"client {worst}'s update is finite but its squared norm ({float(g_all[worst, worst])}) "
                             f"overflows float64 (about 1.8e308), and so do its differences from the others' even "
                             f"scaled: {type(rule).__name__} cannot weigh it; the round is refused, not guessed")
    dist = torch.full((m, m), float("nan"), dtype=torch.float64, device=dev)
    dist[kept[:, None], kept[None, :]] = d2
    scores = None
    clipped = 0
    if isinstance(rule, (Krum, Bulyan)):
        chosen, sc = rule.choose(g, a)
        if sc is not None:
            scores = torch.full((m,), float("nan"), dtype=torch.float64, device=dev)
            scores[kept] = sc
        if isinstance(rule, Bulyan):
            picked = [keep[int(i)] for i in chosen]
            _select_coords(subset_rows(rows, picked), rule.positions(len(picked)), backend, out)
            selected[torch.tensor(picked, device=dev)] = True
            return RobustResult(out, selected, excluded, sq, distances=dist)
        c = torch.zeros(len(keep), dtype=torch.float64, device=dev)
        w = a[chosen] if rule.weighted else torch.ones(len(chosen), dtype=torch.float64, device=dev)
        c[chosen] = w / w.sum()
    elif isinstance(rule, GeometricMedian):
        # Weiszfeld's distances ||z - delta_j||, z near one update, cancel in G's uncentred entries (an error of
        # ~1e-16 ||delta||^2, more than the distance itself when the updates share a large part): a second Gram
        # pass of the updates less the medoid's, delta_i - delta_k formed in float64 before any product
        k = _medoid(d2, a, g.diagonal())
        if scaled:
            c = rule.coefficients(h, a, n, start=k)
        else:
            sub = subset_rows(rows, keep)
            centred, _ = gram(dataclasses.replace(sub, base=[seg[k] for seg in sub.rows]), backend)
            c = rule.coefficients(centred, a, start=k)
            dist[kept[:, None], kept[None, :]] = _sq_distances(centred)  # (the same distances, no cancellation)
    elif isinstance(rule, CenteredClipping):
        c, clipped = rule.coefficients(h, a, n) if scaled else rule.coefficients(g, a)
    else:  # NormBound: min(1, C / ||delta_i||) as (C / n_i) / ||delta_i / n_i||
        hh, nn = (h, n) if scaled else (g, torch.ones_like(a))
        scale = torch.clamp((rule.max_norm / nn) / hh.diagonal().clamp_min(0).sqrt().clamp_min(1e-300), max=1.0)
        clipped = int((scale < 1).sum())
        c = a * scale
    sub = subset_rows(rows, keep)
    run_stats(sub, c.to(dev), backend, mean_out=out, mean_dtype=dtype)
    coefs = torch.zeros(m, dtype=torch.float64, device=dev)
    coefs[kept] = c
    selected = coefs != 0
    return RobustResult(out, selected, excluded, sq, scores, coefs, clipped, dist)


def robust_stats(rows: ClientRows, weights: Any, rule: _Rule, backend, *, name: str, mean_out=None,
                 mean_dtype=None, model_buffers: list | None = None) -> tuple[RoundStats, RobustResult]:
    """A server step's statistics with the robust estimate as its mean: ``mean_sq = ||est||^2``, ``avg_sq`` the
    weighted mean of ``||delta_i||^2`` over the clients that entered the estimate (FedExP's eta then compares the
    selected clients' spread with the robust estimate), every client finite (the non-finite ones were left out)."""
    res = robust_round(rows, weights, rule, resolve(backend, rows.device) if isinstance(backend, str) else backend,
                       mean_out=mean_out, mean_dtype=mean_dtype)
    est64 = res.estimate.to(torch.float64)
    p = normalized_weights(weights, rows.num_clients, rows.device)
    p = torch.where(res.selected, p, torch.zeros_like(p))
    p = p / p.sum()
    avg_sq = (p * torch.nan_to_num(res.sq_norms)).sum()
    stats = RoundStats(res.estimate, res.sq_norms, torch.zeros(rows.num_clients, dtype=torch.bool,
                                                                device=rows.device), est64 @ est64, avg_sq,
                       rows.num_clients, rows.form, name)
    stats.coefs = p
    if rows.buffers is not None:
        stats.buffers = Buffers(rows.buffers.names, [])
        stats.buffer_sums = _robust_buffers(rows, rule._over_kept(int(res.excluded.sum())), res,
                                            dict(model_buffers or {}))
    return stats, res


def _robust_buffers(rows: ClientRows, rule: _Rule, res: RobustResult, model_buffers: dict) -> list:
    """The model's buffers (BatchNorm statistics, counters), estimated element by element so that no minority of
    clients moves them far: a coordinate-wise rule (and Bulyan's last step) applies to each buffer element over the
    clients it kept (Flower's FedMedian takes the median of every array, statistics included); the other
    whole-update rules take each element's median (``Median(even="mean")``) over every client left in (finite,
    variances >= 0). Their choice says nothing of the buffers, which never enter the Gram matrix: a client the
    rule selects or weighs for its update may send any statistics, and one client's statistics taken as sent (or
    averaged in) would reach the model. Returned as what ``passes.buffer_updates`` takes for sums: the new value of
    a floating buffer sent by full models, else the change (integer buffers: the advance)."""
    models = rows.base is not None
    if rule.coordinatewise or isinstance(rule, Bulyan):  # (Bulyan: its last step, over the clients it selected)
        kept, positions = res.selected, rule.positions
    else:
        kept, positions = ~res.excluded, Median().positions
    kept = [i for i in range(rows.num_clients) if bool(kept[i])]
    names, allvals = rows.buffers.names, rows.buffers.values
    # two groups, each estimated in one sort: buffers taken as sent, and counters sent by full models (their
    # advances, the model's counter subtracted); every buffer's elements side by side in one [kept, total] float64
    # matrix (copied in one call a client), sorted along the clients: column by column what a sort per buffer gives
    advance = [models and not allvals[k][0].is_floating_point() and model_buffers.get(n) is not None
               for k, n in enumerate(names)]
    out = [None] * len(names)
    for group in ([k for k in range(len(names)) if not advance[k]], [k for k in range(len(names)) if advance[k]]):
        if not group:
            continue
        shapes, sizes = [allvals[k][0].shape for k in group], [allvals[k][0].numel() for k in group]
        vals = torch.empty(len(kept), sum(sizes), dtype=torch.float64, device=allvals[group[0]][0].device)
        for r, i in enumerate(kept):
            torch._foreach_copy_([v.view(sh) for v, sh in zip(vals[r].split(sizes), shapes)],
                                 [allvals[k][i] for k in group])
        if advance[group[0]]:  # the clients' advances
            vals = vals - torch.cat([model_buffers[names[k]].reshape(-1).to(vals.device, torch.float64) for k in group])
        est = select_sorted(torch.sort(vals.T, dim=1).values, *positions(len(kept)))
        for k, e, sh in zip(group, est.split(sizes), shapes):
            out[k] = e.reshape(sh)
    return out


def aggregate(deltas: Any, rule: _Rule, *, weights: Any = None, base: Any = None,
              backend: str = "auto") -> RobustResult:
    """``rule``'s robust estimate of the clients' update (any form :func:`fastagg.fedexp_step` accepts; with
    ``base`` the clients' full models, the updates formed against it block by block). Returns a
    :class:`RobustResult`; the inputs are never written. Compressed updates (:mod:`fastagg.compress`, float tensors
    beside them) are dequantized into rows, float32 (float64 when a float update beside them is), as the server's
    ``aggregate=`` path reads them: one that no quantizer writes (NaN/Inf, an invalid code, a scale <= 0) is a
    non-finite row, left out."""
    deltas = densified(deltas, base)
    rows = client_rows(deltas, name="models" if base is not None else "deltas")
    if base is not None:
        rows, _ = attach_base(rows, base)
    return robust_round(rows, weights, rule, resolve(backend, rows.device))
