"""The round loop: clients of a round train together as rows of one [M, d] buffer, then one server step."""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import errno
import json
import math
import os
import stat
import sys
import time
from typing import Any

import torch

from .. import client
from .._checks import check_int, check_number, check_prob, did_you_mean
from .._optional import require
from . import algorithms, attacks, data as datasets, graphs as step_graphs, models, outdir
from . import asynchronous as sim_async
from . import privacy as sim_privacy
from ..asynchronous import AsyncServer
from ..compress import spec as compress_spec

# seconds: wall time of the rounds since the previous row, as the user waits for it: local steps, server step and
# the checkpoint written after each round (a round's checkpoint counts toward the next row); evaluation excluded.
# eval_seconds: this row's evaluation (train loss of the reported and last iterate on the evaluation sample of the
# clients' data, test metrics)
SEED_SCOPES = ("all", "model", "sampling")
METRIC_FIELDS = ["algorithm", "seed", "round", "train_loss", "train_loss_last", "test_loss", "test_acc", "eta",
                 "seconds", "eval_seconds"]
SUMMARY_FIELDS = ["algorithm", "status", "seeds", "rounds", "train_loss_mean", "train_loss_std", "test_acc_mean",
                  "test_acc_std", "target", "rounds_to_target_mean", "seeds_reaching_target", "seconds_per_round",
                  "eval_seconds"]
DP_FIELDS = ["epsilon"]  # with --dp: the privacy spent after the row's round (metrics) and at the end (summary)
CLOCK_FIELDS = ["virtual_time"]  # with --client-time: the virtual clock when the row's round (version) ended
# with --compress: the bytes the clients uploaded from round 1 to the row's round (metrics), per round (summary)
COMPRESS_FIELDS = ["bytes_sent"]


def metric_fields(cfg: "Config") -> list:
    return METRIC_FIELDS + (DP_FIELDS if cfg.dp else []) + (CLOCK_FIELDS if cfg.client_time else []) + \
        (COMPRESS_FIELDS if cfg.compress else [])


def summary_fields(cfg: "Config") -> list:
    return SUMMARY_FIELDS + (DP_FIELDS if cfg.dp else []) + (["bytes_per_round"] if cfg.compress else [])


# Default size of the fixed sample of clients' training data the training loss is measured on: every data set of
# the papers' claims holds fewer samples (at most 22,349), so their train loss is exact; cifar-synthetic's 50,000
# images default to 2,000 (data.py), so evaluation stays a fraction of a round.
EVAL_SAMPLES = 25_000


@dataclasses.dataclass
class Config:
    """Every setting of a run; ``None`` means the data set's paper default (``resolved()`` fills them in)."""

    dataset: str = "fedexp-linreg"
    dirichlet: float | None = None  # digits: label-split alpha (0 = IID); default 0.3
    model: str | None = None
    algorithms: tuple = ("fedexp",)
    rounds: int | None = None
    clients: int | None = None
    participation: float | None = None
    local_steps: int | None = None
    batch_size: int | None = None  # 0: full batch
    lr: float | None = None
    lr_decay: float = 1.0  # per round
    lr_c: float | None = None  # paper 004's schedule: local iteration t (over all rounds) uses min(lr, lr_c / (1 + t))
    weight_decay: float = 0.0
    clip_norm: float | None = None
    server_lr: float | None = None
    server_momentum: float = 0.9
    weighting: str = "examples"
    eps: float | None = None
    eps_mode: str = "paper"
    eps_decay: float = 1.0
    fedexpm_beta: float = 0.9
    lam: float = 0.85
    acg_beta: float = 0.01
    prox_mu: float = 0.01
    tau: float = 1e-3
    sps_c: float = 0.5
    gamma_b: float = 1.0
    nesterov_momentum: float = 0.1
    mass_gam: float = 0.1
    mass_eta2: float = 0.0
    mass_average: str = "w"  # FedMaSS synchronizes w (paper 004, App. G); "u" averages the extrapolated iterate
    # Byzantine clients (fastagg.sim.attacks) and robust aggregation (fastagg.robust)
    attack: str | None = None  # sign-flip | gaussian | scale | label-flip | alie | ipm
    malicious: float = 0.0  # the fraction of the clients that attack (drawn once per seed)
    attack_scale: float | None = None  # the attack's strength (see attacks.py); None: its default
    aggregate: str | None = None  # a robust rule for any algorithm's server step (median, krum, ...)
    f: int | None = None  # the attackers a robust rule assumes per round; None: round(malicious * participants)
    beta: float = 0.2  # trimmed mean: the fraction cut at each end (Flower's default)
    max_norm: float = 1.0  # norm bounding: the largest update norm kept
    dp: str | None = None  # differential privacy (fastagg/sim/privacy.py): "server-fixed:clip=1.0,z=1.0", ...
    # what each client uploads (fastagg/compress/spec.py): none | bf16 | int8:block=256 | fp8 | qsgd:s=16 | topk:0.01
    compress: str | None = None
    # the virtual clock and the asynchronous mode (fastagg/sim/asynchronous.py)
    client_time: str | None = None  # "exponential:mean=1,slow=0.1,factor=10": training durations; rows get the time
    mode: str = "sync"  # "async": FedBuff/FedAsync through fastagg.asynchronous.AsyncServer (rounds = versions)
    concurrency: int | None = None  # async: clients training at once (default: the participants per round)
    buffer_size: int | None = None  # async: updates per server step (default: half the participants per round)
    staleness: str = "polynomial:0.5"  # async: constant | polynomial:a | hinge:a,b
    max_staleness: int | None = None  # async: staler updates are refused
    target: float | None = None  # train loss; the summary reports the rounds to reach it
    eval_every: int = 1  # evaluate (and write a metrics row) every this many rounds (round 0 too), and after the last
    eval_samples: int | None = None  # train loss on a fixed sample of this many clients' samples; None: the data set's
    seeds: tuple = (0,)
    # what a seed varies: "all" (client sampling and minibatches, the initial model, the data split), "model" (not
    # the split), "sampling" (only the sampling and minibatches: fastagg before 2026-11-27, and runs saved then)
    seed_scope: str = "all"
    device: str = "cpu"
    backend: str = "auto"
    cuda_graph: bool = True  # on CUDA, stateless client rules replay each local step from a CUDA graph (graphs.py)
    dtype: str | None = None  # float64 for fedexp-linreg, float32 otherwise
    out: str | None = None

    def resolved(self, data: datasets.FederatedData) -> "Config":
        d = data.defaults
        c = dataclasses.replace(self)
        for field in ("model", "rounds", "participation", "local_steps", "batch_size", "lr", "eps", "eval_samples"):
            if getattr(c, field) is None:
                setattr(c, field, d.get(field, {"eps": 1e-3, "eval_samples": EVAL_SAMPLES}.get(field)))
        if c.dtype is None:
            c.dtype = "float64" if data.name == "fedexp-linreg" else "float32"
        c.clients = data.num_clients
        c.algorithms, c.seeds = tuple(c.algorithms), tuple(c.seeds)
        return c

    def for_algorithm(self, spec: str, data: datasets.FederatedData | None = None) -> tuple[str, "Config"]:
        """(algorithm name, this run's settings for the algorithm ``spec``): the data set's per-algorithm paper
        settings where the run left a setting unset, then the spec's own ``key=value`` overrides."""
        return algorithms.configure(spec, self, data.defaults if data is not None else None)

    def check(self, data: datasets.FederatedData | None = None) -> None:
        """Impossible settings fail before any work starts (and before anything is written): ranges, the device,
        the algorithms (with their own settings), and (with ``data``) whether the model fits the data set."""
        if not self.algorithms:
            raise ValueError("no algorithm to run")
        if len(set(self.algorithms)) != len(self.algorithms):
            raise ValueError(f"algorithms given twice: {list(self.algorithms)}")
        for spec in self.algorithms:
            name, cfg = self.for_algorithm(spec, data)
            try:
                cfg._check_settings()
                alg = algorithms.resolve(name, cfg)
                alg.server_cls(torch.zeros(2, dtype=torch.float64), **alg.server_kwargs)  # its own checks, now
                if alg.aggregate is not None and hasattr(alg.aggregate, "check") and cfg.clients:
                    alg.aggregate.check(max(1, int(round(cfg.participation * cfg.clients))))  # Krum's M > 2f + 2
                if cfg.dp is not None:
                    if alg.aggregate is not None:
                        raise ValueError("--dp with a robust aggregate: DP's noise is calibrated to the clipped mean")
                    if cfg.clients:
                        sim_privacy.check(cfg.dp, participants=max(1, int(round(cfg.participation * cfg.clients))),
                                          clients=cfg.clients)
                if cfg.mode not in ("sync", "async"):
                    raise ValueError(f"mode must be 'sync' or 'async', got {cfg.mode!r}")
                if cfg.compress is not None:
                    compress_spec.parse(cfg.compress)
                    if cfg.mode == "async":
                        raise ValueError("--compress runs in the synchronous mode (--mode sync) for now")
                if cfg.client_time is not None:
                    sim_async.parse_clock(cfg.client_time)
                if cfg.mode == "async":
                    sim_async.parse_staleness(cfg.staleness)
                    if alg.client_rule != "sgd" and alg.client_rule not in step_graphs.GRAPHED_RULES:
                        raise ValueError(f"--mode async runs stateless client rules; {name}'s keeps per-client "
                                         "state")
                    if alg.aggregate is not None or cfg.dp is not None or cfg.attack is not None:
                        raise ValueError("--mode async folds updates into running sums: no robust aggregate, --dp or "
                                         "--attack")
                    for key in ("concurrency", "buffer_size"):
                        v = getattr(cfg, key)
                        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                            raise ValueError(f"{key} must be an integer >= 1, got {v!r}")
                    if cfg.clients:  # (run_async refused a concurrency above the clients after round 0's row)
                        m = max(1, int(round(cfg.participation * cfg.clients)))
                        concurrency, buffer = cfg.concurrency or m, cfg.buffer_size or max(1, m // 2)
                        if concurrency > cfg.clients:
                            raise ValueError(f"concurrency {concurrency} exceeds the {cfg.clients} clients")
                        if buffer > concurrency:  # FedBuff's K is below its concurrency: K = 10 of 1,000
                            raise ValueError(f"buffer_size {buffer} exceeds the {concurrency} clients training at "
                                             "once (--concurrency, default: the participants per round): each "
                                             "server step would wait for several updates of the same clients")
                    v = cfg.max_staleness
                    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                        raise ValueError(f"max_staleness must be an integer >= 0 (None: no bound), got {v!r}")
                    if cfg.clients:  # the server the run builds, with the run's settings: its own checks, now
                        AsyncServer(alg.server_cls(torch.zeros(2, dtype=torch.float64), **alg.server_kwargs),
                                    buffer_size=buffer,
                                    staleness=sim_async.parse_staleness(cfg.staleness),
                                    max_staleness=cfg.max_staleness)
                    if cfg.client_time is None:  # its clients are scheduled by the virtual clock
                        raise ValueError("--mode async needs --client-time (the virtual clock that decides when "
                                         "each client's update arrives), e.g. --client-time exponential:mean=1")
                if alg.client_rule == "scaffold" and not cfg.lr > 0:
                    raise ValueError(f"lr must be > 0 for {name} (its control variates divide by it), got {cfg.lr}")
            except (TypeError, ValueError) as e:
                raise ValueError(f"{spec}: {e}" if ":" in spec else str(e)) from None
        if self.target is not None and not (isinstance(self.target, (int, float)) and math.isfinite(self.target)):
            raise ValueError(f"target must be a finite number, got {self.target!r}")
        if not self.seeds or not all(isinstance(x, int) and not isinstance(x, bool) for x in self.seeds):
            raise ValueError(f"seeds must be integers, got {self.seeds!r}")
        if len(set(self.seeds)) != len(self.seeds):  # it would run once: the summary's count of seeds would lie
            twice = sorted({x for x in self.seeds if list(self.seeds).count(x) > 1})
            raise ValueError(f"seeds given twice: {', '.join(map(str, twice))} (in {list(self.seeds)})")
        if self.seed_scope not in SEED_SCOPES:
            raise ValueError(f"seed_scope must be one of {SEED_SCOPES}, got {self.seed_scope!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device {self.device!r} is not a device: {e}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: CUDA is not available here")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: the simulator runs on cpu or cuda")
        if data is not None:
            self._check_attack(data)
            models.make(self.model, data)

    def _check_attack(self, data: datasets.FederatedData) -> None:
        """The attack fits the data set: label-flip needs labels, and the malicious fraction must make at least one
        attacker of the data set's clients (``round(malicious * clients)``, attacks.malicious_clients)."""
        if self.attack is None:
            return
        if self.attack == "label-flip" and data.task != "classification":
            raise ValueError(f"--attack label-flip needs a classification data set; {data.name} is {data.task}")
        if int(round(self.malicious * data.num_clients)) == 0:
            raise ValueError(f"--malicious {self.malicious:g} of {data.num_clients} clients makes no attacker "
                             f"(round({self.malicious:g} x {data.num_clients}) = 0); raise it above "
                             f"{0.5 / data.num_clients:.3g}")

    def _check_settings(self) -> None:
        if not 0 < self.participation <= 1:
            raise ValueError(f"participation must be in (0, 1], got {self.participation}")
        for name in ("rounds", "local_steps", "eval_every", "eval_samples"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.batch_size < 0:
            raise ValueError(f"batch_size must be >= 0 (0 = full batch), got {self.batch_size}")
        # every number a run's algorithms will read, checked here (not at an algorithm's first step, after the
        # earlier ones trained and files were written): >= 0, > 0 (positive), or in [0, 1) (prob)
        for name in ("lr", "weight_decay", "eps", "prox_mu", "acg_beta", "tau", "mass_eta2"):
            check_number(getattr(self, name), name)
        for name in ("lr_decay", "sps_c", "gamma_b"):  # a decay of 0 leaves rounds without a local step
            check_number(getattr(self, name), name, allow_equal=False)
        for name in ("nesterov_momentum", "mass_gam", "server_momentum", "fedexpm_beta", "lam"):
            check_prob(getattr(self, name), name)
        for name, positive in (("lr_c", True), ("clip_norm", True), ("server_lr", False)):  # optional ones
            if getattr(self, name) is not None:
                check_number(getattr(self, name), name, allow_equal=not positive)
        if self.attack is not None and self.attack not in attacks.ATTACKS:
            raise ValueError(f"unknown attack {self.attack!r}{did_you_mean(self.attack, attacks.ATTACKS)}; choose "
                             f"one of {', '.join(attacks.ATTACKS)}")
        if not (isinstance(self.malicious, (int, float)) and 0 <= self.malicious < 1):
            raise ValueError(f"malicious must be a fraction in [0, 1), got {self.malicious!r}")
        if (self.attack is None) != (self.malicious == 0):
            raise ValueError("an attack needs a malicious fraction > 0 and the reverse (--attack with --malicious)")
        if self.attack_scale is not None:
            check_number(self.attack_scale, "attack_scale")
            if self.attack in (None, "label-flip"):  # it would be ignored
                raise ValueError(f"--attack-scale sets the strength of a model-poisoning --attack; "
                                 f"{'there is no --attack' if self.attack is None else 'label-flip has none'}")
        if self.f is not None and (not isinstance(self.f, int) or isinstance(self.f, bool) or self.f < 0):
            raise ValueError(f"f must be an integer >= 0, got {self.f!r}")
        if not (isinstance(self.beta, (int, float)) and 0 <= self.beta < 0.5):
            raise ValueError(f"beta must be in [0, 0.5) (the trimmed mean's cut at each end), got {self.beta!r}")
        check_number(self.max_norm, "max_norm", allow_equal=False)
        if self.weighting not in ("examples", "uniform"):
            raise ValueError(f"weighting must be 'examples' or 'uniform', got {self.weighting!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")
        if self.eps_mode not in ("paper", "official"):
            raise ValueError(f"eps_mode must be 'paper' or 'official', got {self.eps_mode!r}")
        if self.mass_average not in ("w", "u"):
            raise ValueError(f"mass_average must be 'w' (paper 004) or 'u', got {self.mass_average!r}")
        for name, top in (("local_steps", 10**7), ("batch_size", 10**7), ("rounds", 10**9), ("eval_every", 10**9),
                          ("eval_samples", 10**9)):
            if getattr(self, name) > top:  # work or memory in proportion to a mistaken value: refused at once
                raise ValueError(f"{name} must be at most {top:.0e}, got {getattr(self, name)}")


@dataclasses.dataclass
class History:
    """Rows of metrics (one per algorithm, seed and round; round 0 is the initial model) and the resolved config."""

    config: Config
    rows: list
    stopped: str | None = None
    planned: dict = dataclasses.field(default_factory=dict)  # algorithm -> its rounds; a seed short of them is unfinished

    def series(self, algorithm: str, field: str, seed: int | None = None) -> list:
        return [r[field] for r in self.rows if r["algorithm"] == algorithm and (seed is None or r["seed"] == seed)]

    def rounds_to(self, algorithm: str, field: str, target: float, seed: int = 0) -> int | None:
        """First round whose ``field`` is at or below ``target`` (None if never)."""
        for r in self.rows:
            if r["algorithm"] == algorithm and r["seed"] == seed and r[field] <= target:
                return r["round"]
        return None


# client rules whose step is the local lr times a gradient (SPS-type rules pick their own step size)
_LR_RULES = ("sgd", "prox", "acg", "scaffold", "nesterov", "mass")


def check_stable(cfg: Config, data) -> None:
    """Least squares: refuse a local lr under which every local step expands the error (e.g. npz features or
    targets on a scale the data set's default lr was not chosen for), with what would work, before any work."""
    if data.task != "least_squares":
        return
    model = models.make(cfg.model, data)
    for spec in cfg.algorithms:
        name, c = cfg.for_algorithm(spec, data)
        if algorithms.ALGORITHMS[name][0] not in _LR_RULES:
            continue
        limit = model.max_stable_lr(c.batch_size)
        if c.lr >= limit:
            x_scale = float(data.x.abs().max())
            y_scale = float(data.y.abs().max())
            raise ValueError(
                f"{spec}: local lr {c.lr:g} diverges on {data.name}: its local steps need lr < {limit:.3g} (2 / the "
                f"largest curvature of a client's {'data' if c.batch_size == 0 else 'samples'}; features reach "
                f"{x_scale:.3g}, targets {y_scale:.3g}). Pass --lr below {limit:.3g} or scale the features")


def _full_batch(data, ids):
    """The participants' whole data sets (gathered once per round: every full-batch step reuses them)."""
    x, y, counts = data.x[ids], data.y[ids], data.counts[ids]
    mask = (torch.arange(x.shape[1], device=x.device)[None, :] < counts[:, None]).to(data.x.dtype)
    return x, y, mask


def _batch(data, ids, batch_size, gen, mine=None):
    """Every participant's minibatch indices drawn at once (so a rank drawing for all of a round's clients and
    keeping ``mine`` sees the numbers one process would), then the samples of ``ids[mine]``."""
    counts = data.counts[ids].to(torch.float64)
    idx = (torch.rand(len(ids), batch_size, generator=gen, dtype=torch.float64) * counts[:, None].cpu()).long()
    if mine is not None:
        ids, idx = ids[mine], idx[mine.cpu()]
    idx = idx.to(data.x.device)
    rows = ids[:, None].expand_as(idx)
    return data.x[rows, idx], data.y[rows, idx], torch.ones(idx.shape, dtype=data.x.dtype, device=data.x.device)


def _local_steps(alg, cfg, model, data, ids, anchor, state, lr, gen, control=None, mine=None, graphs=None):
    """cfg.local_steps fused steps of every participant at once, from ``anchor``; returns their models [M, d].
    ``lr``: one local lr for the round, or a list of one per local step. ``mine``: indices into ``ids`` of the
    clients this process trains (several ranks); the random draws are still made for all of ``ids``. ``graphs``:
    a :class:`~fastagg.sim.graphs.StepGraphs` of this run (:func:`step_graphs_for`) replays each step of a
    stateless client rule from a CUDA graph."""
    kw = dict(backend=cfg.backend, clip_norm=cfg.clip_norm)
    everyone, ids = ids, (ids if mine is None else ids[mine])
    lrs = lr if isinstance(lr, list) else [lr] * cfg.local_steps
    if len(ids) == 0:  # a rank with no participant this round: it joins the server step with a zero share; its
        if cfg.batch_size != 0:  # minibatch draws are still made, so its generator stays in step with the others'
            for _ in lrs:
                _batch(data, everyone, cfg.batch_size, gen, mine)
        return anchor.new_zeros((0, anchor.numel()))
    if not isinstance(lr, list) and cfg.batch_size == 0 and alg.client_rule == "sgd" and cfg.weight_decay == 0 and \
            cfg.clip_norm is None and hasattr(model, "local_gd"):
        return model.local_gd(anchor, ids, cfg.local_steps, lr)
    full = _full_batch(data, ids) if cfg.batch_size == 0 else None
    if graphs is not None:
        shape = None
        for lr in lrs:
            batch = full if full is not None else _batch(data, everyone, cfg.batch_size, gen, mine)
            if shape is None:
                shape = graphs.start(anchor.expand(len(ids), -1), batch)
            shape.step(batch, lr)
        return shape.x.clone()  # the static buffer is the next round's
    sync_w = alg.client_rule == "mass" and cfg.mass_average == "w"
    x = _mass_start(cfg, state, ids, anchor) if sync_w else anchor.expand(len(ids), -1).clone()
    for lr in lrs:
        xb, yb, mask = full if full is not None else _batch(data, everyone, cfg.batch_size, gen, mine)
        losses, grads = model.loss_grad(x, xb, yb, mask)
        rule = alg.client_rule
        if rule in step_graphs.GRAPHED_RULES:  # the step a CUDA graph replays, the same function
            _stateless_step(alg, cfg, x, grads, losses, lr)
        elif rule == "decsps":
            client.decsps_step(params=x, grads=grads, losses=losses, state=state, client_ids=ids.cpu(),
                               c0=cfg.sps_c, gamma_b=cfg.gamma_b, **kw)
        elif rule in ("nesterov", "mass"):
            gam = cfg.nesterov_momentum if rule == "nesterov" else cfg.mass_gam
            eta2 = 0.0 if rule == "nesterov" else cfg.mass_eta2
            client.mass_step(params=x, grads=grads, state=state, client_ids=ids.cpu(), eta1=lr, gam=gam, eta2=eta2,
                             **kw)
        else:
            prox = None
            if rule == "prox":
                prox = (anchor, cfg.prox_mu)
            elif rule == "acg":
                prox = (anchor, cfg.acg_beta)
            ctrl = None
            if rule == "scaffold":  # direction g - c_i + c
                ctrl = (control, state.vector("control"))
                kw["client_ids"] = ids.cpu()
            client.local_step(params=x, grads=grads, lr=lr, prox=prox, control=ctrl, weight_decay=cfg.weight_decay,
                              **kw)
    return _mass_end(state, ids, x) if sync_w else x


def _stateless_step(alg, cfg, x, grads, losses, lr) -> None:
    """The client step of a rule without per-client state (``step_graphs.GRAPHED_RULES``), eager or captured."""
    kw = dict(backend=cfg.backend, clip_norm=cfg.clip_norm)
    if alg.client_rule == "sps":
        client.sps_step(params=x, grads=grads, losses=losses, c=cfg.sps_c, gamma_b=cfg.gamma_b, **kw)
    else:
        client.local_step(params=x, grads=grads, lr=lr, weight_decay=cfg.weight_decay, **kw)


def step_graphs_for(alg, cfg, model, device: torch.device):
    """A :class:`~fastagg.sim.graphs.StepGraphs` replaying this algorithm's local step, or None where steps run
    eagerly: off in the config, not on CUDA, or a client rule with per-client state."""
    if not cfg.cuda_graph or device.type != "cuda" or alg.client_rule not in step_graphs.GRAPHED_RULES:
        return None

    def step(x, xb, yb, mask, lr):
        losses, grads = model.loss_grad(x, xb, yb, mask)
        _stateless_step(alg, cfg, x, grads, losses, lr)
    return step_graphs.StepGraphs(step)


# FedMaSS as paper 004 synchronizes it (App. G): the server averages each client's w_{t+1} = u_t - eta1 g(u_t),
# and a client continues from u_{t+1} = wbar + gam (wbar - w_t) + eta2 g(u_t) with its own w_t and g(u_t). Since
# the client's last step already formed u = w + gam (w - w_t) + eta2 g(u_t) from its own w, the continuation is
# u' = wbar + gam (wbar - w) + (u - w): the client keeps w (state "mass") and the offset u - w (state
# "momentum"). A client that skipped rounds continues from its stale w and offset when it next trains (the
# paper's analysis steps every client every iteration); one that never trained starts at wbar.
def _mass_start(cfg, state, ids, wbar):
    """The participants' u at the start of a round from the broadcast wbar; their w_t becomes wbar."""
    w_prev, offset = state.vector("mass")[ids], state.vector("momentum")[ids]
    started = state.scalar("mass_started")[ids].to(wbar.dtype)[:, None]
    u = wbar + started * (cfg.mass_gam * (wbar - w_prev) + offset)
    state.vector("mass")[ids] = wbar
    return u


def _mass_end(state, ids, u):
    """After the round's steps: keep the offset u - w, return w (what the server averages)."""
    w = state.vector("mass")[ids]
    state.vector("momentum")[ids] = u - w
    return w


def _evaluate(model, data, w, last):
    """(train loss of w, train loss of the last iterate ``last``, test loss, test accuracy of w); NaN where the data
    set has no test set."""
    if last is w:
        loss = last_loss = float(model.loss(w, data))
    elif hasattr(model, "losses"):  # both models in one read of the data
        loss, last_loss = (float(v) for v in model.losses(torch.stack([w, last]), data))
    else:
        loss, last_loss = float(model.loss(w, data)), float(model.loss(last, data))
    if data.test_x is None or not hasattr(model, "test_metrics"):
        return loss, last_loss, float("nan"), float("nan")
    test_loss, test_acc = model.test_metrics(w, data.test_x, data.test_y)
    return loss, last_loss, float(test_loss), float(test_acc)


CHECKPOINT = outdir.CHECKPOINT

# Below this many bytes in a round's largest tensor (the participants' parameters or data), torch ops run on one
# thread. Such ops last tens of microseconds: a second thread saves little when the machine is quiet and, when
# another process holds a core, makes every op wait for it (measured, bench/RESULTS.md: the FedExP regression 5x
# slower with 2 threads beside one CPU-bound process, unchanged with 1). fastagg's own kernels decide per call
# (csrc/segments.h threads_for).
SMALL_WORK_BYTES = 16 << 20


def intra_op_threads(data, model, participants: int, batch_size: int, itemsize: int) -> int:
    """torch's intra-op thread count for a run: 1 for small work, else torch's default. The work is the largest of
    the participants' parameters, their samples in one step, and the training samples evaluated."""
    samples = batch_size if batch_size else data.x.shape[1]
    evaluated = min(data.num_samples, data.eval_limit or data.num_samples)
    largest = max(participants * max(model.dim, samples * data.num_features),
                  evaluated * data.num_features) * itemsize
    return 1 if largest < SMALL_WORK_BYTES else torch.get_num_threads()


def run_one(cfg: Config, data, algorithm: str, seed: int, *, on_row=None, on_round=None, resume: dict | None = None,
            progress=None) -> str | None:
    """One algorithm and seed. Every metrics row (round 0 = the initial model) goes to ``on_row`` as soon as it is
    measured; ``on_round(snapshot)`` receives a checkpoint after every round; ``resume`` is such a snapshot to
    continue from. Returns why the run stopped early, or None. torch's thread count is chosen for the run's work
    size (``intra_op_threads``) and restored afterwards."""
    previous = torch.get_num_threads()
    try:
        return _run_one(cfg, data, algorithm, seed, on_row=on_row, on_round=on_round, resume=resume,
                        progress=progress)
    finally:
        torch.set_num_threads(previous)


def seeded_data(cfg: Config, data, seed: int):
    """The data a seed trains on: the run's (seed 0's split) unless the seed scope is "all", then the split drawn
    with ``seed`` (data sets without a random split, fedexp-linreg and quadratic, are the same for every seed)."""
    if cfg.seed_scope != "all" or seed == 0:
        return data
    return datasets.load(cfg.dataset, clients=cfg.clients, dirichlet=cfg.dirichlet, seed=seed)


def _run_one(cfg: Config, data, algorithm: str, seed: int, *, on_row, on_round, resume, progress) -> str | None:
    data = seeded_data(cfg, data, seed)
    name, cfg = cfg.for_algorithm(algorithm, data)
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    d = data.to(device, dtype).with_eval_limit(cfg.eval_samples)
    model = models.make(cfg.model, d, seed=seed if cfg.seed_scope in ("all", "model") else 0)
    alg = algorithms.resolve(name, cfg)
    gen = torch.Generator().manual_seed(seed)
    w = model.init(dtype, device) if hasattr(model, "init") else torch.zeros(model.dim, dtype=dtype, device=device)
    group, rank, world = ranks()
    if (cfg.attack is not None or alg.aggregate is not None or cfg.dp is not None or cfg.compress is not None) \
            and group is not None:
        raise ValueError("attacks, robust rules, --dp and --compress run on one process for now (no torchrun)")
    n = d.num_clients
    m = max(1, int(round(cfg.participation * n)))
    dp, accountant = (None, None) if cfg.dp is None else \
        sim_privacy.make(sim_privacy.parse(cfg.dp), participants=m, clients=n, run_seed=seed)
    opt = alg.server_cls(w, backend=cfg.backend, on_nonfinite="raise", group=group,
                         aggregate=alg.aggregate if dp is None else dp, **alg.server_kwargs)
    bad = attacks.malicious_clients(d.num_clients, cfg.malicious, seed).to(device) if cfg.attack else None
    train_d = attacks.label_flipped(d, bad) if cfg.attack == "label-flip" else d
    attack_gen = torch.Generator().manual_seed(20_011 + seed)  # the attacks' draws, apart from the run's
    torch.set_num_threads(intra_op_threads(d, model, m, cfg.batch_size, d.x.element_size()))
    comp = None if cfg.compress is None else compress_spec.parse(cfg.compress)
    needs_state = alg.client_rule in ("decsps", "nesterov", "mass", "scaffold") or (comp is not None and
                                                                                   comp.error_feedback)
    state = client.ClientState(n, model.dim, dtype=dtype, device=device) if needs_state else None
    graphs = step_graphs_for(alg, cfg, model, device)

    train_s = 0.0  # training time since the last row
    clock = None if cfg.client_time is None and cfg.mode == "sync" else \
        sim_async.VirtualClock(sim_async.parse_clock(cfg.client_time or "exponential"), n, seed)
    vclock = 0.0  # the virtual time (with a clock): a synchronous round lasts as long as its slowest participant
    sent = 0  # with --compress: the bytes the clients uploaded so far

    def record(t, eta, vtime=None, wall=None):
        nonlocal train_s
        if wall is not None:  # (the asynchronous loop times its own rounds)
            train_s = wall
        started = time.perf_counter()
        eval_w = torch.as_tensor(opt.eval_params())
        loss, last, test_loss, test_acc = _evaluate(model, d, eval_w, w)
        if on_row:
            row = dict(algorithm=algorithm, seed=seed, round=t, train_loss=loss, train_loss_last=last,
                       test_loss=test_loss, test_acc=test_acc, eta=eta, seconds=train_s,
                       eval_seconds=time.perf_counter() - started)
            if dp is not None:
                row["epsilon"] = accountant.epsilon() if accountant is not None else float("inf")
            if clock is not None:
                row["virtual_time"] = vclock if vtime is None else vtime
            if comp is not None:
                row["bytes_sent"] = sent
            on_row(row)
        train_s = 0.0
        return loss

    start, loss = 1, float("nan")
    if resume is not None:
        w.copy_(resume["params"])
        opt.load_state_dict(resume["optimizer"])
        if state is not None:
            state.load_state_dict(resume["clients"])
        if dp is not None:
            dp.load_state_dict(resume["privacy"]["mechanism"])
            if accountant is not None:
                accountant.load_state_dict(resume["privacy"]["accountant"])
        gen.set_state(resume["generator"])
        start = resume["round"] + 1
        train_s = resume.get("train_seconds", 0.0)
        vclock = resume.get("virtual_time", 0.0)
        sent = resume.get("bytes_sent", 0)
        if clock is not None:  # the clock's generator as if the rounds before had drawn from it
            for _ in range(resume["round"]):
                clock.durations(torch.arange(m))
    else:
        loss = record(0, float("nan"))
    if cfg.mode == "async":
        if resume is not None:
            raise ValueError("an asynchronous run cannot be resumed (its clients in flight are not checkpointed); "
                             "run it again")

        def local(ids, anchor, lr):
            return _local_steps(alg, cfg, model, train_d, ids, anchor, state, lr, gen, graphs=graphs)

        return sim_async.run_async(cfg, opt=opt, data=d, n=n, m=m, gen=gen, lr_at=lambda v: cfg.lr * cfg.lr_decay ** v,
                                   local_steps=local, record=record, clock=clock, progress=progress,
                                   algorithm=algorithm, seed=seed)
    for t in range(start, cfg.rounds + 1):
        started = time.perf_counter()
        ids = torch.sort(torch.randperm(n, generator=gen)[:m]).values.to(device)
        if clock is not None:  # the round waits for its slowest participant
            vclock += float(clock.durations(ids).max())
        anchor = torch.as_tensor(opt.broadcast()).clone()
        lr = cfg.lr * cfg.lr_decay ** (t - 1)
        if cfg.lr_c is not None:
            first = (t - 1) * cfg.local_steps
            lr = [min(lr, cfg.lr_c / (1 + first + k)) for k in range(cfg.local_steps)]
        control = opt.control if alg.client_rule == "scaffold" else None
        # several ranks: each trains a contiguous share of the sorted participants; the server step reduces them
        mine = None if group is None else torch.tensor_split(torch.arange(len(ids)), world)[rank].to(device)
        x = _local_steps(alg, cfg, model, train_d, ids, anchor, state, lr, gen, control, mine=mine, graphs=graphs)
        participants = ids
        if mine is not None:
            ids = ids[mine]
        weights = None
        if cfg.weighting == "examples" and name not in algorithms.UNWEIGHTED:
            weights = d.counts[ids].to(torch.float64)
        extra = ()
        if control is not None:  # SCAFFOLD option II: c_i_new = c_i - c + (w - y_i) / (K lr)
            extra = ((anchor - x) / (sum(lr) if isinstance(lr, list) else cfg.local_steps * lr) - control,)
        try:
            if dp is not None and dp.client_side:  # the clients clip their own updates before they leave them
                _, clipped = client.clip_updates(x, anchor, dp.clipping_norm, backend=cfg.backend)
                if dp.adaptive:
                    dp.set_norm_bits(clipped)
            updates = x - anchor
            if bad is not None:
                updates = attacks.attack_updates(cfg.attack, updates, bad[ids], cfg.attack_scale, attack_gen)
            if (alg.aggregate is not None and not alg.aggregate.weighted) or dp is not None:
                weights = None  # median, trimmed mean, Krum, Bulyan, DP's clipped mean: unweighted, as in their papers
            if comp is not None:  # what the clients send; the server folds it where it lies
                updates = client.compress_updates(updates, comp, state=state, client_ids=ids, seed=seed, round=t)
                sent += compress_spec.sent_bytes(updates)
            opt.step(updates, *extra, weights=weights)
        except ValueError as e:
            return f"round {t}: {e}"
        if extra:
            state.vector("control")[ids] += extra[0]
        if group is not None and state is not None:
            _share_client_state(state, participants, world, group)
        eta = float(opt.last_stats.eta)  # a read-back: the round's device work is done
        train_s += time.perf_counter() - started
        evaluated = t % cfg.eval_every == 0 or t == cfg.rounds
        if evaluated:
            loss = record(t, eta)
        if on_round:
            saving = time.perf_counter()
            snap = dict(algorithm=algorithm, seed=seed, round=t, params=w.clone(), optimizer=opt.state_dict(),
                        clients=None if state is None else state.state_dict(), generator=gen.get_state(),
                        train_seconds=train_s, virtual_time=vclock, bytes_sent=sent)
            if dp is not None:  # the noise stream, the clipping norm and the releases accounted so far
                snap["privacy"] = {"mechanism": dp.state_dict(),
                                   "accountant": None if accountant is None else accountant.state_dict()}
            on_round(snap)
            train_s += time.perf_counter() - saving  # what the user waits for: counted in the next row's seconds
        if progress:
            progress(algorithm, seed, t, cfg.rounds, loss)
        if evaluated and not math.isfinite(loss):
            return f"round {t}: the training loss is {loss}"
    return None


DIST_TIMEOUT_S = 300


def ranks() -> tuple:
    """(group, rank, world size) when this run is one of several torch.distributed processes (torchrun), else
    (None, 0, 1)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None, 0, 1
    return dist.group.WORLD, dist.get_rank(), dist.get_world_size()


def join_ranks() -> tuple:
    """Under torchrun (WORLD_SIZE > 1 in the environment) joins the gloo group the launcher describes; returns
    :func:`ranks`. A rank that dies or hangs ends the others' collectives after DIST_TIMEOUT_S seconds."""
    import datetime

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=DIST_TIMEOUT_S))
    return ranks()


def _share_client_state(state, participants, world: int, group) -> None:
    """After a round on several ranks: every rank gets the state rows (momentum, step sizes, control variates) of
    the participants the other ranks trained, so each rank's ClientState is whole and the same on every rank
    (whoever trains a client next starts from its latest state). One all_gather per state entry."""
    import torch.distributed as dist

    shares = torch.tensor_split(torch.arange(len(participants)), world)
    top = max(len(s) for s in shares)
    rank = dist.get_rank(group)
    for table in (state.vectors, state.scalars):
        for name in sorted(table):
            full = table[name]
            mine = full[participants[shares[rank]]].cpu()
            padded = torch.zeros((top, *full.shape[1:]), dtype=full.dtype)
            padded[:len(mine)] = mine
            parts = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(parts, padded, group=group)
            for r, share in enumerate(shares):
                full[participants[share]] = parts[r][:len(share)].to(full.device)


def _agree(ok: bool) -> bool:
    """Whether every rank is ready (one all_reduce of a flag)."""
    import torch.distributed as dist

    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag)
    return int(flag) == 0


def _resume_state(cfg: Config, data) -> tuple:
    """(checkpoint, metric rows, extensions of finished runs) of the run folder, validated before anything in the
    folder is rewritten."""
    ckpt = outdir.load_checkpoint(cfg.out, cfg)
    rows = _rows_of(cfg, ckpt)
    check_resume_state(cfg, data, ckpt, rows)
    extensions = {(a, sd): snap for a, sd in map(tuple, ckpt["done"])
                  if (snap := _extension(cfg, data, ckpt.get("finals", []), rows, a, sd, ckpt["run"])) is not None}
    return ckpt, rows, extensions


def _shared(world: int, rank: int, read):
    """``read()`` on rank 0 (the rank that owns the run folder), its result sent to every rank; an error there is
    raised on rank 0 and reported on the others at once, never a wait until the group's timeout."""
    if world == 1:
        return read()
    import torch.distributed as dist

    box = [None]
    if rank == 0:
        try:
            box[0] = ("ok", read())
        except Exception as e:  # noqa: BLE001 (re-raised below, after the others know)
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        if rank == 0:
            raise value
        raise ValueError(f"rank 0 could not resume the run: {value}")
    return value


# a settings file (--config, a run folder's config.json) nests at most a table per algorithm holding plain values:
# deeper or larger ones are refused before anything walks them recursively (a RecursionError, or a YAML file
# whose aliases multiply into billions of entries)
MAX_SETTINGS_DEPTH = 8
MAX_SETTINGS_VALUES = 100_000
MAX_CONFIG_BYTES = 1 << 20  # a run folder's config.json: a few kB


def check_settings_shape(settings: Any, where: str) -> None:
    """``settings`` nests at most MAX_SETTINGS_DEPTH containers deep and holds at most MAX_SETTINGS_VALUES values;
    walked without recursion. Raises ValueError, one line."""
    stack, seen = [(settings, 1)], 0
    while stack:
        value, depth = stack.pop()
        seen += 1
        if seen > MAX_SETTINGS_VALUES:
            raise ValueError(f"{where} holds more than {MAX_SETTINGS_VALUES:,} values; a settings file is a few "
                             "dozen")
        if isinstance(value, (dict, list, tuple)):
            if depth > MAX_SETTINGS_DEPTH:
                raise ValueError(f"{where} is nested more than {MAX_SETTINGS_DEPTH} levels deep; settings nest "
                                 "at most a table per algorithm")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))


def saved_config(out: str) -> dict:
    """The settings a run folder's config.json recorded (checked: a regular file of at most MAX_CONFIG_BYTES,
    read without following a link planted at its name; JSON of known keys only, plainly nested)."""
    path = os.path.join(out, "config.json")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(f"nothing to resume: no config.json in {out!r}") from None
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else os.strerror(e.errno or errno.EIO)
        raise ValueError(f"cannot read {path!r}: {why}") from None
    try:
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ValueError("not a regular file")
            if info.st_size > MAX_CONFIG_BYTES:
                raise ValueError(f"{info.st_size:,} bytes; a run's config.json is a few kB")
            saved = json.loads(f.read(MAX_CONFIG_BYTES + 1).decode("utf-8"))
    except RecursionError:
        raise ValueError(f"cannot read {path!r}: nested too deeply") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
            from None
    saved = checked_settings(saved, path)
    saved.setdefault("seed_scope", "sampling")  # saved before seeds varied the model and the split
    return saved


def checked_settings(settings: Any, where: str) -> dict:
    """A dict of Config fields (lists for tuples); unknown keys are refused, not ignored. A table whose key is an
    entry of ``algorithms`` holds that algorithm's own settings (a config file's per-algorithm section, as
    ``[fedavg]`` / ``fedavg:`` with ``server_lr = 10`` under it): it becomes that entry's ``NAME:KEY=VALUE`` spec."""
    if not isinstance(settings, dict):
        raise ValueError(f"{where} must hold a mapping of settings (an object, a table)")
    check_settings_shape(settings, where)
    settings = _per_algorithm_sections(settings, where)
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(settings) - known)
    if unknown:
        hints = [k + did_you_mean(k, known) for k in unknown]
        raise ValueError(f"{where}: unknown settings {', '.join(hints)} (known: {', '.join(sorted(known))})")
    out = dict(settings)
    for k in ("algorithms", "seeds"):
        if k in out:
            if not isinstance(out[k], (list, tuple)):
                raise ValueError(f"{where}: {k} must be a list")
            out[k] = tuple(out[k])
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    for k, v in out.items():
        if not _of_type(v, types[k]):
            raise ValueError(f"{where}: {k} must be {types[k].replace('|', 'or')}, got {type(v).__name__} {v!r:.60}")
    return out


def _per_algorithm_sections(settings: dict, where: str) -> dict:
    """``{"algorithms": ["fedavg", "fedexp"], "fedavg": {"server_lr": 10}}`` ->
    ``{"algorithms": ["fedavg:server_lr=10", "fedexp"]}``; each section's keys are checked as per-algorithm
    settings are (``algorithms.parse_spec``)."""
    entries = settings.get("algorithms")
    fields = {f.name for f in dataclasses.fields(Config)}  # a table under a setting's own name is a type error
    sections = {k: v for k, v in settings.items() if isinstance(v, dict) and k not in fields}
    if not sections:
        return settings
    if not isinstance(entries, (list, tuple)):
        raise ValueError(f"{where}: sections {', '.join(sorted(sections))} need an algorithms list naming them")
    out = {k: v for k, v in settings.items() if k not in sections}
    specs = list(entries)
    for name, table in sections.items():
        if name not in specs:
            raise ValueError(f"{where}: section {name!r} is not an entry of algorithms ({list(entries)})")
        pairs = []
        for key, value in table.items():
            if isinstance(value, (dict, list)) or value is None:
                raise ValueError(f"{where}: section {name!r}: {key} must be a number or a word, got {value!r:.40}")
            pairs.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
        spec = ":".join([name, *pairs])
        try:
            algorithms.parse_spec(spec)
        except ValueError as e:
            raise ValueError(f"{where}: section {name!r}: {str(e).split(': ', 1)[-1]}") from None
        specs[specs.index(name)] = spec
    out["algorithms"] = specs
    return out


def _of_type(value: Any, annotation: str) -> bool:
    """``value`` fits a Config field's annotation (``"float | None"``, ``"int"``, ``"tuple"``...): ints count as
    floats, bools as neither, and a tuple's items are names (algorithms) or integers (seeds)."""
    for t in (a.strip() for a in annotation.split("|")):
        if t == "None" and value is None:
            return True
        if t == "bool" and isinstance(value, bool):
            return True
        if isinstance(value, bool):
            continue
        if t == "int" and isinstance(value, int) or t == "float" and isinstance(value, (int, float)) or \
                t == "str" and isinstance(value, str):
            return True
        if t == "tuple" and isinstance(value, tuple) and all(isinstance(x, (str, int)) and not isinstance(x, bool)
                                                             for x in value):
            return True
    return False


def run(config: Config, *, verbose: bool = False, resume: bool = False, overwrite: bool = False) -> History:
    """Run every algorithm and seed of ``config``; returns the metrics. With ``config.out``, writes config.json,
    metrics.csv (row by row: a run that stops keeps every metric so far), a checkpoint after every round and the
    plots. The folder is locked while the run writes it; a folder holding another run's results is refused unless
    ``overwrite``. ``resume=True`` continues the run in ``config.out`` from its checkpoint, with the settings its
    config.json recorded (``config``'s other fields are not used, except a larger ``rounds``: a finished run is
    extended, each algorithm and seed continuing from its final state, and ``model``: a ``package.module:factory``
    the folder names is imported only when ``config.model`` names it too). A finished run without a larger
    ``rounds`` and an asynchronous run are refused (ValueError) before anything is imported or written."""
    if resume:
        if not config.out:
            raise ValueError("resume needs the run's folder (--out)")
        saved = saved_config(config.out)
        rounds = saved.get("rounds")
        if config.rounds is not None and rounds is not None and config.rounds != rounds:
            if config.rounds < rounds:
                raise ValueError(f"--resume cannot shorten {config.out!r}: it runs {rounds} rounds; got --rounds "
                                 f"{config.rounds}")
            rounds = config.rounds
        _check_trusted_model(config, saved)
        config = Config(**{**saved, "rounds": rounds, "out": config.out})  # the folder given, wherever it moved
        if config.mode == "async":
            raise ValueError(f"{config.out!r} holds an asynchronous run (--mode async), which cannot be resumed or "
                             "extended (its clients in flight are not checkpointed); run it again in another --out")
    if config.out:
        require("matplotlib", "sim", "--out (for its loss, accuracy and eta plots)")
    data = datasets.load(config.dataset, clients=config.clients, dirichlet=config.dirichlet)
    cfg = config.resolved(data)
    if resume:  # the folder's files, before its model is built (a factory it names is imported then)
        _check_resumable(cfg)
    cfg.check(data)
    check_stable(cfg, data)
    _, rank, world = join_ranks()
    _check_one_process(cfg, data, world)
    # several ranks: fewer sampled clients than ranks is fine (a rank with none takes part in the step with a zero
    # share); --resume is read by rank 0 and sent to the others (_shared)
    if rank != 0:  # every rank computes the same metrics; rank 0 alone writes and prints them
        cfg = dataclasses.replace(cfg, out=None)
        verbose = False
    try:
        lock = outdir.claim(cfg.out, resume=resume, overwrite=overwrite) if cfg.out else None
    except ValueError:
        if world > 1:  # the other ranks must not wait for rank 0 until the group's timeout
            _agree(False)
        raise
    if world > 1 and not _agree(True):
        raise ValueError("rank 0 could not start the run (its error is in its output); nothing was run")
    try:
        if resume:
            ckpt, rows, extensions = _shared(world, rank, lambda: _resume_state(cfg, data))
        else:
            ckpt, rows = {"rows_written": 0, "done": [], "current": None, "run": outdir.signature(cfg)}, []
            extensions = {}
        return _run_all(cfg, data, ckpt, rows, verbose, extensions)
    finally:
        if lock is not None:
            lock.release()


def _check_trusted_model(config: Config, saved: dict) -> None:
    """A run folder's config.json may name a model factory (``package.module:factory``): resuming imports and runs
    that module as whoever resumes. Anyone able to write into the folder (a shared runs/ directory) could name a
    module of their own there (a package under the current directory, imported from it) -- so such a name is
    imported only when the caller names the same factory (``--model package.module:factory`` beside ``--resume``,
    ``Config(model=...)``); built-in models and names registered in this process (``register_model``) need
    nothing. Raises ValueError before anything is imported."""
    model = saved.get("model")
    if not models.imports_code(model) or config.model == model:
        return
    raise ValueError(f"{os.path.join(config.out, 'config.json')!r} names the model factory {model!r}: resuming "
                     f"would import and run that code; if it is yours, pass --model {model} beside --resume")


def _check_resumable(cfg: Config) -> None:
    """Before anything in ``cfg.out`` is imported, built or written: its checkpoint is a fastagg-sim checkpoint
    of this run (loaded without running code), its metrics file holds the rows the checkpoint counted, and the run
    has something left to do -- a run in progress, an (algorithm, seed) not yet finished, or, with a larger
    ``rounds``, a finished one to extend. A finished run is refused: resuming it would only rewrite its results."""
    ckpt = outdir.load_checkpoint(cfg.out, cfg)
    rows = _rows_of(cfg, ckpt)
    done = ckpt["done"]
    if not isinstance(done, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in done):
        raise ValueError(f"{os.path.join(cfg.out, CHECKPOINT)!r}: its finished runs are not (algorithm, seed) pairs")
    pairs = [[a, sd] for a in cfg.algorithms for sd in cfg.seeds]
    if ckpt["current"] is not None or any(p not in [list(d) for d in done] for p in pairs):
        return
    last = {}
    for r in rows if isinstance(rows, list) else []:
        if isinstance(r, dict) and isinstance(r.get("round"), int):
            key = (r.get("algorithm"), r.get("seed"))
            last[key] = max(last.get(key, 0), r["round"])
    if all(last.get(tuple(p), 0) >= cfg.rounds for p in pairs):
        raise ValueError(f"nothing to resume: every algorithm and seed in {cfg.out!r} finished its {cfg.rounds} "
                         "rounds; pass a larger --rounds to extend the run")


def _check_one_process(cfg: Config, data, world: int) -> None:
    """Attacks, robust rules, --dp and --compress run on one process: refused under torchrun before the folder is
    claimed (every rank raises the same error, so none waits for another)."""
    if world == 1:
        return
    robust = [spec for spec in cfg.algorithms
              if algorithms.resolve(*cfg.for_algorithm(spec, data)).aggregate is not None]
    if cfg.attack is not None or robust or cfg.dp is not None or cfg.compress is not None:
        raise ValueError("attacks, robust rules, --dp and --compress run on one process for now (no torchrun)")


def _rows_of(cfg: Config, ckpt: dict) -> list:
    """The metric rows a checkpoint covers: the first ``rows_written`` rows of metrics.csv (the checkpoint holds the
    state, not the metrics, so it costs O(state) however many rounds ran); a checkpoint of fastagg 0.1's first
    format carries its rows itself."""
    if "rows" in ckpt:
        return ckpt["rows"]
    try:
        count = check_int(ckpt["rows_written"], "rows_written")
    except ValueError:
        raise ValueError(f"{os.path.join(cfg.out, CHECKPOINT)!r}: its metric row count {ckpt['rows_written']!r} is "
                         "malformed") from None
    return outdir.read_metrics(cfg.out, count, metric_fields(cfg))


def check_resume_state(cfg: Config, data, ckpt: dict, rows: list) -> None:
    """A checkpoint's contents fit this run: the metric rows, the finished (algorithm, seed) pairs, and the run in
    progress -- its round, params (size and dtype of the model), optimizer state (loaded into a probe optimizer of
    its algorithm, which checks shapes, dtypes, counters and the rule's invariants), clients' state and random
    generator. Raises ValueError naming the first problem; nothing is written or changed here."""
    where = f"{os.path.join(cfg.out, CHECKPOINT)!r}"
    done, current = ckpt["done"], ckpt["current"]
    if not isinstance(rows, list) or not all(isinstance(r, dict) and set(metric_fields(cfg)) <= set(r) for r in rows):
        raise ValueError(f"{where}: its metric rows are malformed")
    pairs = {(a, sd) for a in cfg.algorithms for sd in cfg.seeds}
    if not isinstance(done, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 and tuple(p) in pairs
                                             for p in done):
        raise ValueError(f"{where}: its finished runs are not (algorithm, seed) pairs of this run")
    if current is not None:
        check_snapshot(cfg, data, current, where, pairs)


def check_snapshot(cfg: Config, data, current: dict, where: str, pairs: set | None = None) -> None:
    """A run's state after some round (a checkpoint's run in progress, or a finished run's final state kept for
    an extension) fits this run; raises ValueError naming the first problem."""
    if pairs is None:
        pairs = {(a, sd) for a in cfg.algorithms for sd in cfg.seeds}
    keys = {"algorithm", "seed", "round", "params", "optimizer", "clients", "generator"}
    if not isinstance(current, dict) or not keys <= set(current):
        raise ValueError(f"{where}: its run in progress is malformed (needs {sorted(keys)})")
    if (current["algorithm"], current["seed"]) not in pairs:
        raise ValueError(f"{where}: its run in progress ({current['algorithm']!r}, seed {current['seed']!r}) is not "
                         "one of this run's")
    name, acfg = cfg.for_algorithm(current["algorithm"], data)
    try:
        check_int(current["round"], "round", maximum=acfg.rounds)
    except ValueError:
        raise ValueError(f"{where}: its round {current['round']!r} is not in 0..{acfg.rounds}") from None
    device, dtype = torch.device(acfg.device), getattr(torch, acfg.dtype)
    model = models.make(acfg.model, data)
    params = current["params"]
    if not isinstance(params, torch.Tensor) or tuple(params.shape) != (model.dim,) or params.dtype != dtype:
        got = f"{params.dtype} of shape {tuple(params.shape)}" if isinstance(params, torch.Tensor) else \
            type(params).__name__
        raise ValueError(f"{where}: its params are {got}; the model has {model.dim} {dtype} parameters")
    if not bool(torch.isfinite(params).all()):
        raise ValueError(f"{where}: its params hold NaN or Inf")
    alg = algorithms.resolve(name, acfg)
    probe = alg.server_cls(torch.zeros(model.dim, dtype=dtype, device=device), backend=acfg.backend,
                           **alg.server_kwargs)
    try:
        probe.load_state_dict(current["optimizer"])
        if alg.client_rule in ("decsps", "nesterov", "mass", "scaffold"):
            state = client.ClientState(data.num_clients, model.dim, dtype=dtype, device=device)
            state.load_state_dict(current["clients"])
        torch.Generator().set_state(current["generator"])
        if acfg.dp is not None:
            n = data.num_clients
            mech, acc = sim_privacy.make(sim_privacy.parse(acfg.dp), clients=n, run_seed=0,
                                         participants=max(1, int(round(acfg.participation * n))))
            mech.load_state_dict(current["privacy"]["mechanism"])
            if acc is not None:
                acc.load_state_dict(current["privacy"]["accountant"])
    except (TypeError, ValueError, RuntimeError, AttributeError, KeyError) as e:
        raise ValueError(f"{where}: its run in progress cannot be restored ({str(e).splitlines()[0][:160]})") \
            from None


def _run_all(cfg: Config, data, ckpt: dict, rows: list, verbose: bool, extensions: dict) -> History:
    rows = list(rows)
    ckpt.pop("rows", None)  # an old-format checkpoint is rewritten in the current one
    ckpt["rows_written"] = len(rows)
    planned = {spec: cfg.for_algorithm(spec, data)[1].rounds for spec in cfg.algorithms}
    ckpt["run"] = outdir.signature(cfg)  # a folder of a legacy checkpoint is signed whole from now on
    out_file = writer = None
    staged = False
    if cfg.out:  # never through a link planted in the folder (outdir.open_new)
        # staged: config.json and metrics.csv are written under STAGED names and renamed into place at the first
        # checkpoint (commit): a run that fails before it (a setting refused at round 0 or 1) leaves the folder as
        # it was -- the results --overwrite was to replace, or the run --resume was to continue, untouched
        with outdir.open_new(cfg.out, STAGED["config.json"]) as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        out_file = outdir.open_new(cfg.out, STAGED["metrics.csv"])
        writer = csv.DictWriter(out_file, fieldnames=metric_fields(cfg))
        writer.writeheader()
        writer.writerows(rows)
        out_file.flush()
        staged = True

    def commit(save: bool) -> None:
        """The staged files renamed into place (metrics first: a config.json whose checkpoint is not saved yet is
        refused on --resume by the signature), then, with ``save``, the checkpoint as it stands."""
        nonlocal staged
        if not staged:
            return
        for name in ("metrics.csv", "config.json"):
            os.replace(os.path.join(cfg.out, STAGED[name]), os.path.join(cfg.out, name))
        staged = False
        if save:
            outdir.save_checkpoint(cfg.out, ckpt)

    def on_row(row):
        rows.append(row)
        if writer:
            writer.writerow(row)
            out_file.flush()
            if cfg.mode == "async" and row["round"] >= 1:  # no checkpoints: committed at its first server step
                commit(save=True)

    def on_round(snapshot):
        if cfg.out:  # after the round's metrics row (if any) was flushed to metrics.csv
            ckpt["current"] = snapshot
            ckpt["rows_written"] = len(rows)
            commit(save=False)
            outdir.save_checkpoint(cfg.out, ckpt)

    progress = _progress if verbose else None
    stopped = None
    finals = ckpt.setdefault("finals", [])  # [algorithm, seed, file]: finished runs' final states, for extensions
    try:
        for algorithm in cfg.algorithms:
            for seed in cfg.seeds:
                snap = None
                if [algorithm, seed] in ckpt["done"]:
                    snap = extensions.get((algorithm, seed))  # a finished run that --rounds extends
                    if snap is None:
                        continue
                    ckpt["done"].remove([algorithm, seed])
                current = ckpt["current"]
                if snap is None:
                    snap = current if current and (current["algorithm"], current["seed"]) == (algorithm, seed) \
                        else None
                t0 = time.perf_counter()
                stop = run_one(cfg, data, algorithm, seed, on_row=on_row, on_round=on_round, resume=snap,
                               progress=progress)
                commit(save=False)  # (saved just below)
                if cfg.out and not stop and ckpt["current"] is not None:  # its final state, once: O(state)
                    name = f"final-{cfg.algorithms.index(algorithm)}-{cfg.seeds.index(seed)}.pt"
                    final = {**ckpt["current"], "run": ckpt["run"]}  # signed: never another run's to extend
                    outdir.write_file(cfg.out, name, lambda f: torch.save(final, f), binary=True)
                    finals[:] = [e for e in finals if e[:2] != [algorithm, seed]] + [[algorithm, seed, name]]
                ckpt["done"].append([algorithm, seed])
                ckpt["current"] = None
                ckpt["rows_written"] = len(rows)  # an asynchronous run's rows (it calls no on_round) counted too
                if cfg.out:
                    outdir.save_checkpoint(cfg.out, ckpt)
                if verbose:
                    last = [r for r in rows if r["algorithm"] == algorithm and r["seed"] == seed][-1]
                    redraw = "\r" if sys.stderr.isatty() else ""  # ends the progress bar's line
                    print(f"{redraw}{algorithm:>16} seed {seed}: {last['round']} rounds, train loss "
                          f"{last['train_loss']:.4g} (last iterate {last['train_loss_last']:.4g}), "
                          f"{time.perf_counter() - t0:.1f} s" + (f"  STOPPED {stop}" if stop else ""), flush=True)
                if stop:
                    stopped = f"{algorithm} seed {seed} stopped at {stop}"
                    break
            if stopped:
                break
    except KeyboardInterrupt:
        last = rows[-1] if rows else None
        where = f" after round {last['round']} of {last['algorithm']} seed {last['seed']}" if last else ""
        stopped = f"interrupted (Ctrl-C){where}; every metric so far is in metrics.csv; --resume continues"
        commit(save=True)  # the user stopped a run that was under way: its files are its folder's now
    except BaseException:
        if staged:  # refused before its first checkpoint: the folder keeps what it held
            out_file.close()
            for name in STAGED.values():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(cfg.out, name))
        raise
    finally:
        if out_file:
            out_file.close()
    history = History(cfg, rows, stopped, planned)
    if rows:
        table = summary(history)
        if verbose:
            print(format_summary(table), flush=True)
        if cfg.out:
            def write_summary(f):
                w = csv.DictWriter(f, fieldnames=summary_fields(cfg))
                w.writeheader()
                w.writerows(table)

            outdir.write_file(cfg.out, "summary.csv", write_summary)
            from .plots import plot

            plot(history, cfg.out)
    return history


# the names _run_all writes config.json and metrics.csv under until its first checkpoint (commit)
STAGED = {"config.json": "config.json.staged", "metrics.csv": "metrics.csv.staged"}


def _extension(cfg: Config, data, finals: list, rows: list, algorithm: str, seed: int, run_sig) -> dict | None:
    """A finished run to extend: its final state when ``cfg.rounds`` is past the rounds it ran (its last metrics
    row), else None. The state is loaded without running code (``weights_only``) and checked like a checkpoint's,
    its signature too (another run's final state copied in is refused); one saved without a signature is taken only
    in a folder whose checkpoint predates full signatures (``run_sig``, the checkpoint's, is legacy)."""
    done_rounds = max((r["round"] for r in rows if r["algorithm"] == algorithm and r["seed"] == seed), default=None)
    if done_rounds is None or done_rounds >= cfg.rounds:
        return None
    entry = next((e for e in finals if e[:2] == [algorithm, seed]), None)
    if entry is None:
        raise ValueError(f"{algorithm} seed {seed} ended at round {done_rounds} and its final state was not kept "
                         f"(a stopped run, or a folder written before extensions existed): it cannot be extended")
    where = repr(os.path.join(cfg.out, entry[2]))
    snap = outdir.load_state(cfg.out, entry[2])
    if "run" in snap or not outdir.is_legacy(run_sig):
        outdir.check_signature(snap.get("run"), cfg, os.path.join(cfg.out, entry[2]), cfg.out)
    check_snapshot(cfg, data, snap, where)
    if snap["round"] != done_rounds:
        raise ValueError(f"{where} holds round {snap['round']}; the metrics end at round {done_rounds}")
    return snap


def summary(history: History) -> list:
    """One row per algorithm over its finished seeds: final train loss and test accuracy, mean and (population)
    std; with ``config.target``, the mean rounds to reach a train loss <= target (at an evaluated round) over the
    seeds that reached it; the wall time per round (local steps, server step, checkpoint; each seed's first round,
    its warm-up, left out) and of one evaluation.
    A seed that stopped short of its algorithm's rounds (Ctrl-C, a non-finite loss) gets a row of its own,
    ``status`` "unfinished" with the rounds it reached: it is never averaged with finished seeds."""
    out = []
    for algorithm in dict.fromkeys(r["algorithm"] for r in history.rows):
        rows = [r for r in history.rows if r["algorithm"] == algorithm]
        seeds = list(dict.fromkeys(r["seed"] for r in rows))
        planned = history.planned.get(algorithm)
        last = {s: [r for r in rows if r["seed"] == s][-1]["round"] for s in seeds}
        finished = [s for s in seeds if planned is None or last[s] >= planned]
        if finished:
            out.append(_summary_row(history, algorithm, [r for r in rows if r["seed"] in finished], "finished"))
        for s in seeds:
            if s not in finished:
                out.append(_summary_row(history, algorithm, [r for r in rows if r["seed"] == s], "unfinished"))
    return out


def _steady_time(rows: list, seeds: list) -> tuple:
    """(seconds, rounds) of the seeds' rounds after the first: the first row after round 0 carries each run's
    warm-up (first calls of torch and the kernels, buffers allocated, tables built), which would make the first
    algorithm of a run look slower than the others. A seed with a single timed row counts it whole."""
    seconds = rounds = 0.0
    for s in seeds:
        timed = [r for r in rows if r["seed"] == s and r["round"] > 0]
        if not timed or any(r.get("seconds") in (None, "") for r in timed):
            return 0.0, 0
        later = timed[1:] or timed
        seconds += sum(float(r["seconds"]) for r in later)
        rounds += timed[-1]["round"] - (timed[0]["round"] if len(timed) > 1 else 0)
    return seconds, rounds


def _summary_row(history: History, algorithm: str, rows: list, status: str) -> dict:
    target = history.config.target
    seeds = list(dict.fromkeys(r["seed"] for r in rows))
    finals = [[r for r in rows if r["seed"] == s][-1] for s in seeds]
    loss = torch.tensor([f["train_loss"] for f in finals], dtype=torch.float64)
    acc = torch.tensor([f["test_acc"] for f in finals], dtype=torch.float64)
    reached = [history.rounds_to(algorithm, "train_loss", target, s) for s in seeds] if target is not None else []
    reached = [r for r in reached if r is not None]
    train_s, timed_rounds = _steady_time(rows, seeds)
    evals = [float(r["eval_seconds"]) for r in rows if r.get("eval_seconds") not in (None, "")]
    extra = {}
    if history.config.dp:  # the privacy each seed's run spent (the same for every seed of a run: reported as the mean)
        extra["epsilon"] = sum(float(f.get("epsilon", float("nan"))) for f in finals) / len(finals)
    if history.config.compress:  # the bytes the clients uploaded per round, averaged over the seeds
        extra["bytes_per_round"] = sum(float(f.get("bytes_sent", 0)) / max(1, int(f["round"])) for f in finals) / \
            len(finals)
    return extra | dict(
        algorithm=algorithm, status=status if status == "finished" else f"unfinished (seed {seeds[0]})",
        seeds=len(seeds), rounds=max(f["round"] for f in finals),
        train_loss_mean=float(loss.mean()), train_loss_std=float(loss.std(unbiased=False)),
        test_acc_mean=float(acc.mean()), test_acc_std=float(acc.std(unbiased=False)),
        target=float("nan") if target is None else target,
        rounds_to_target_mean=sum(reached) / len(reached) if reached else float("nan"),
        seeds_reaching_target=len(reached) if target is not None else "",
        seconds_per_round=train_s / timed_rounds if timed_rounds else float("nan"),
        eval_seconds=sum(evals) / len(evals) if evals else float("nan"))



def _duration(seconds: float) -> str:
    return "-" if not math.isfinite(seconds) else f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B" if math.isfinite(n) else "nan"


def format_summary(table: list) -> str:
    """The summary as an aligned text table."""
    has_acc = any(math.isfinite(r["test_acc_mean"]) for r in table)
    has_target = any(math.isfinite(r["target"]) for r in table)
    has_status = any(r["status"] != "finished" for r in table)
    has_eps = any("epsilon" in r for r in table)
    has_bytes = any("bytes_per_round" in r for r in table)
    head = ["algorithm"] + (["status"] if has_status else []) + ["seeds", "rounds", "final train loss"] + (["test accuracy"] if has_acc else []) + \
        ([f"rounds to loss <= {table[0]['target']:g}"] if has_target else []) + (["epsilon"] if has_eps else []) + \
        (["uploaded / round"] if has_bytes else []) + ["time / round", "evaluation"]
    lines = []
    for r in table:
        cells = [r["algorithm"]] + ([r["status"]] if has_status else []) + [str(r["seeds"]), str(r["rounds"]),
                 f"{r['train_loss_mean']:.4g} +- {r['train_loss_std']:.2g}"]
        if has_acc:
            cells.append(f"{r['test_acc_mean']:.4f} +- {r['test_acc_std']:.4f}")
        if has_target:
            cells.append("never" if not r["seeds_reaching_target"] else
                         f"{r['rounds_to_target_mean']:.1f} ({r['seeds_reaching_target']}/{r['seeds']} seeds)")
        if has_eps:
            cells.append(f"{r.get('epsilon', float('nan')):.4g}")
        if has_bytes:
            cells.append(_size(r.get("bytes_per_round", float("nan"))))
        cells += [_duration(r["seconds_per_round"]), _duration(r["eval_seconds"])]
        lines.append(cells)
    widths = [max(len(c) for c in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines])


def _progress(algorithm, seed, t, total, loss):
    """A bar redrawn in place on a terminal; elsewhere (CI logs, files) a whole line each time, at most ~50 lines a
    seed: ``\r`` redraws would pile up in one unreadable line."""
    if t == total or t % max(1, total // 50) == 0:
        if sys.stderr.isatty():
            bar = "#" * int(30 * t / total)
            sys.stderr.write(f"\r{algorithm:>16} seed {seed} [{bar:<30}] round {t}/{total} loss {loss:.4g}")
        else:
            sys.stderr.write(f"{algorithm} seed {seed}: round {t}/{total} loss {loss:.4g}\n")
        sys.stderr.flush()
