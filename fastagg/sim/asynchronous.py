"""The simulator on a virtual clock: how long each client takes to train (``--client-time``), the synchronous round
loop timed on it (a round waits for its slowest participant), and the asynchronous mode (``--mode async``):
FedBuff / FedAsync through :class:`fastagg.asynchronous.AsyncServer`.

Client times (FLSim's and FedScale's models), drawn from a generator of their own (the run's sampling and
minibatches are untouched):

    exponential:mean=1.0            each training takes Exp(mean) time units
    lognormal:mu=0.0,sigma=0.5      each training takes exp(N(mu, sigma^2))
    ...,slow=0.1,factor=10          a fraction of the clients (drawn once per seed) takes factor x as long

The asynchronous mode: ``concurrency`` clients train at once (default: the participants per round); when one
finishes (the earliest on the clock) its update is submitted with the version it started from, and a client not
training starts from the current model. Every ``buffer_size`` updates the server optimizer steps (one "round" of
the metrics: a version); ``--rounds`` counts versions. Clients that start from the same version are trained
together, as rows of one batch (their training does not depend on when they finish), so the mode costs what the
synchronous loop costs per update. Stateless client rules only (no per-client momentum or control variates).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import time

import torch

from ..asynchronous import AsyncServer, Constant, Hinge, Polynomial

DISTRIBUTIONS = {"exponential": {"mean": 1.0}, "lognormal": {"mu": 0.0, "sigma": 0.5}}
STALENESS = {"constant": Constant, "polynomial": Polynomial, "hinge": Hinge}
STALENESS_ARGS = {"constant": (), "polynomial": ("a",), "hinge": ("a", "b")}  # --staleness hinge:a,b


@dataclasses.dataclass(frozen=True)
class ClockSpec:
    kind: str
    params: tuple  # ((name, value), ...)
    slow: float = 0.0
    factor: float = 1.0


def parse_clock(spec: str) -> ClockSpec:
    """``kind:key=value,...`` (module docstring); a ValueError names what is wrong."""
    kind, _, rest = str(spec).partition(":")
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"--client-time must start with one of {', '.join(DISTRIBUTIONS)}, got {kind!r}")
    params = dict(DISTRIBUTIONS[kind])
    slow, factor = 0.0, 1.0
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        try:
            val = float(value)
        except ValueError:
            raise ValueError(f"--client-time {kind}: {item!r} is not key=number") from None
        if not eq or key not in (*params, "slow", "factor") or not math.isfinite(val):
            raise ValueError(f"--client-time {kind}: {item!r} is not key=value with a key among "
                             f"{', '.join((*params, 'slow', 'factor'))}")
        if key == "slow":
            slow = val
        elif key == "factor":
            factor = val
        else:
            params[key] = val
    if not 0 <= slow <= 1:
        raise ValueError(f"--client-time: slow (the fraction of slow clients) must be in [0, 1], got {slow}")
    if not factor >= 1:
        raise ValueError(f"--client-time: factor (how much slower the slow clients are) must be >= 1, got {factor}")
    if kind == "exponential" and not params["mean"] > 0:
        raise ValueError(f"--client-time exponential: mean must be > 0, got {params['mean']}")
    if kind == "lognormal" and not params["sigma"] >= 0:
        raise ValueError(f"--client-time lognormal: sigma must be >= 0, got {params['sigma']}")
    return ClockSpec(kind, tuple(sorted(params.items())), slow, factor)


class VirtualClock:
    """Training durations of the clients of one run (a seed): the slow clients drawn once, each training's
    duration drawn as it starts, from a generator apart from the run's."""

    def __init__(self, spec: ClockSpec, num_clients: int, seed: int):
        self.spec = spec
        self.gen = torch.Generator().manual_seed(40_009 + seed)
        slow = torch.zeros(num_clients, dtype=torch.bool)
        k = int(round(spec.slow * num_clients))
        if k:
            slow[torch.randperm(num_clients, generator=self.gen)[:k]] = True
        self.factor = torch.where(slow, spec.factor, 1.0).to(torch.float64)

    def durations(self, clients: torch.Tensor) -> torch.Tensor:
        """One training duration per client of ``clients`` (float64)."""
        p = dict(self.spec.params)
        n = len(clients)
        if self.spec.kind == "exponential":
            base = torch.empty(n, dtype=torch.float64).exponential_(1.0 / p["mean"], generator=self.gen)
        else:
            base = torch.exp(p["mu"] + p["sigma"] * torch.randn(n, generator=self.gen, dtype=torch.float64))
        return base * self.factor[clients.cpu()]


def parse_staleness(spec: str):
    """``polynomial:0.5`` | ``constant`` | ``hinge:10,4`` as a staleness rule."""
    kind, _, rest = str(spec).partition(":")
    if kind not in STALENESS:
        raise ValueError(f"--staleness must be one of {', '.join(STALENESS)} (with its numbers after ':'), got {kind!r}")
    try:
        args = [float(a) if kind != "hinge" or i == 0 else int(a) for i, a in enumerate(filter(None, rest.split(",")))]
    except ValueError:
        raise ValueError(f"--staleness {kind}: {rest!r} is not numbers") from None
    if len(args) != len(STALENESS_ARGS[kind]):  # never a default filled in for a number left out
        names = STALENESS_ARGS[kind]
        raise ValueError(f"--staleness {kind} takes {kind + ':' + ','.join(names) if names else 'no numbers'}, "
                         f"got {len(args)}: {spec!r}")
    return STALENESS[kind](*args)


def run_async(cfg, *, opt, data, n, m, gen, lr_at, local_steps, record, clock, progress=None, algorithm="",
              seed=0) -> str | None:
    """The asynchronous loop (module docstring); ``record(version, eta, virtual time, wall seconds)`` writes a
    metrics row; ``local_steps(ids, anchor, lr)`` trains clients ``ids`` from ``anchor`` (their models, rows).
    Returns why it stopped early (a non-finite loss), or None."""
    server = AsyncServer(opt, buffer_size=cfg.buffer_size or max(1, m // 2), staleness=parse_staleness(cfg.staleness),
                         max_staleness=cfg.max_staleness)
    concurrency = cfg.concurrency or m
    if concurrency > n:
        raise ValueError(f"concurrency {concurrency} exceeds the {n} clients")
    device = data.x.device
    events: list = []            # (finish time, sequence, client, start version, update row index, batch)
    pending: list = []           # (client, finish time): started from the current version, not trained yet
    training = set()
    seq = 0
    now = 0.0
    loss = float("nan")

    def start(count: int, t: float) -> None:
        idle = torch.tensor(sorted(set(range(n)) - training), dtype=torch.long)
        pick = idle[torch.randperm(len(idle), generator=gen)[:count]]
        for c, dur in zip(pick.tolist(), clock.durations(pick).tolist()):
            training.add(c)
            pending.append((c, t + dur))

    def train_pending() -> None:
        """Every client started from the current version: one batch of rows from the current model."""
        nonlocal seq
        if not pending:
            return
        ids = torch.tensor([c for c, _ in pending], dtype=torch.long, device=device)
        anchor = torch.as_tensor(opt.broadcast()).clone()
        x = local_steps(ids, anchor, lr_at(server.version))
        batch = {"updates": x - anchor, "weights": data.counts[ids].to(torch.float64)}
        for j, (c, finish) in enumerate(pending):
            heapq.heappush(events, (finish, seq, c, server.version, j, batch))
            seq += 1
        pending.clear()

    start(concurrency, 0.0)
    since = time.perf_counter()  # wall time since the last metrics row (evaluation excluded)
    while server.version < cfg.rounds:
        steps_next = server.pending % server.buffer_size == server.buffer_size - 1
        if pending and (steps_next or not events or min(f for _, f in pending) < events[0][0]):
            train_pending()  # before the model moves, or when a client not trained yet finishes first
        finish, _, c, v, j, batch = heapq.heappop(events)
        now = finish
        weight = float(batch["weights"][j]) if cfg.weighting == "examples" else 1.0
        before = server.version
        server.submit(batch["updates"][j], v, weight=weight)
        training.discard(c)
        start(1, now)
        if server.version > before:
            t = server.version
            eta = float(opt.last_stats.eta)
            if t % cfg.eval_every == 0 or t == cfg.rounds:
                loss = record(t, eta, now, time.perf_counter() - since)
                since = time.perf_counter()
            if progress:
                progress(algorithm, seed, t, cfg.rounds, loss)
            if not math.isfinite(loss):
                return f"version {t}: the training loss is {loss}"
    return None
