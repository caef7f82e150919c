"""``python -m fastagg.sim.reproduce [--out DIR] [--quick] [--claims 1,2,...] [--full-speedup]``: re-runs the
papers' claims on the set-ups closest to the papers' that fit this simulator and a 2-core CPU, and writes
``REPRODUCTION.md``: per claim, the paper's set-up beside ours, what was seen, and "reproduced" / "not
reproduced" by a rule fixed in this file before the runs. Settings are never tuned until a claim passes; where a
method is tuned (a baseline's lr grid), the grid is stated and every point reported.

Set-ups follow a review of the first run against the papers (REPRODUCTION.md's introduction): noisy labels so that
FedSPS's step is not stuck at its cap, F - F* instead of raw losses where the claim is about the optimum, paper
004's decaying lr and an F - F* target for the speedup, a K = 20 low-participation set-up for FedACG, and a tuned
FedAvg baseline for FedExP.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import time

import numpy as np
import torch

from .. import client
from .._optional import MissingDependency, require
from . import data as datasets, models, outdir
from .runner import Config, run


@dataclasses.dataclass
class Claim:
    number: int
    title: str
    paper: dict  # the paper's set-up, field by field
    ours: dict   # ours, the same fields
    reproduced: bool
    seen: str    # what the runs showed, with the numbers
    seconds: float = 0.0


FIELDS = ("data", "model", "clients", "participation", "local steps", "learning rates", "rounds", "seeds", "metric")


def _mean_std(values) -> str:
    v = np.asarray(values, dtype=float)
    return f"{v.mean():.4g} +- {v.std():.2g}"


def _final(h, algorithm, field="train_loss"):
    seeds = sorted({r["seed"] for r in h.rows})
    return [h.series(algorithm, field, s)[-1] for s in seeds]


def optimum(data: datasets.FederatedData, model_name: str, weight_decay: float = 0.0, rounds: int = 20) -> float:
    """F* of softmax regression on the pooled training data (the global objective the simulator reports), by L-BFGS
    in float64 to a gradient norm of 1e-10 (at most ``rounds`` x 500 iterations); weight_decay adds
    (weight_decay / 2) ||w||^2 (the clients' L2 term)."""
    d = data.to("cpu", torch.float64)
    model = models.make(model_name, d)
    w = torch.zeros(model.dim, dtype=torch.float64, requires_grad=True)
    x, y = d.samples()
    opt = torch.optim.LBFGS([w], lr=1, max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-16,
                            history_size=50, line_search_fn="strong_wolfe")

    def objective():
        opt.zero_grad()
        f = model.test_metrics(w, x, y)[0] + 0.5 * weight_decay * w.square().sum()
        f.backward()
        return f

    for _ in range(rounds):
        opt.step(objective)
        if float(w.grad.abs().max()) <= 1e-10:
            break
    return float(objective().detach())


@contextlib.contextmanager
def counting_sps_caps(counts: dict):
    """Counts FedSPS steps and those at the cap gamma_b (the step then equals FedAvg's with lr gamma_b)."""
    real = client.sps_step

    def counted(**kw):
        steps = real(**kw)
        taken = steps[steps > 0]
        counts["steps"] = counts.get("steps", 0) + int(taken.numel())
        counts["capped"] = counts.get("capped", 0) + int((taken >= kw["gamma_b"] * (1 - 1e-9)).sum())
        return steps

    client.sps_step = counted
    try:
        yield counts
    finally:
        client.sps_step = real


def claim_sps(quick: bool) -> Claim:
    """Paper 003: FedSPS, untuned, is competitive with FedAvg whose lr was tuned (convex, IID)."""
    rounds, seeds = (40, (0,)) if quick else (500, (0, 1, 2))
    common = dict(dataset="digits-noisy", clients=10, dirichlet=0.0, model="softmax", participation=1.0,
                  local_steps=5, batch_size=20, rounds=rounds, seeds=seeds, eval_every=10)
    lrs = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
    grid = run(Config(algorithms=tuple(f"fedavg:lr={lr:g}" for lr in lrs), **common))
    fedavg = {lr: _final(grid, f"fedavg:lr={lr:g}") for lr in lrs}
    finite = {lr: np.mean(v) for lr, v in fedavg.items() if all(math.isfinite(x) for x in v)}
    best_lr = min(finite, key=finite.get)
    sps, caps = {}, {}
    for gb in (1.0, 5.0, 10.0):
        counts = {}
        with counting_sps_caps(counts):
            h = run(Config(algorithms=("fedsps",), sps_c=0.5, gamma_b=gb, **common))
        sps[gb], caps[gb] = _final(h, "fedsps"), counts["capped"] / max(1, counts["steps"])
    # rule (fixed before the runs): some gamma_b whose steps are capped less than half the time ends within 10% of
    # the best-tuned FedAvg (a FedSPS that is always capped is FedAvg with lr gamma_b, not an adaptive step)
    ratio = {gb: np.mean(v) / finite[best_lr] for gb, v in sps.items()}
    ok = any(ratio[gb] <= 1.10 and caps[gb] < 0.5 for gb in sps)
    seen = ("final train loss (mean +- std over seeds). FedAvg by local lr: " +
            ", ".join(f"{lr:g}: {_mean_std(v)}" for lr, v in fedavg.items()) +
            f"; best {best_lr:g}. FedSPS (c = 0.5) by gamma_b: " +
            ", ".join(f"{gb:g}: {_mean_std(v)} ({ratio[gb]:.3f} x best FedAvg, {100 * caps[gb]:.1f}% of steps "
                      "capped)" for gb, v in sps.items()) +
            ". Rule: some gamma_b with < 50% capped steps within 1.10 x the best FedAvg.")
    return Claim(1, "FedSPS without tuning is competitive with the best-tuned FedAvg (paper 003)",
                 dict(data="MNIST (logistic regression), IID", model="logistic regression", clients="10",
                      participation="all", **{"local steps": "tau = 5, batch 20",
                                              "learning rates": "FedAvg lr grid 1e-4 .. 1; FedSPS c = 0.5, gamma_b "
                                              "from its grid"}, rounds="500", seeds="not stated",
                      metric="train loss"),
                 dict(data="scikit-learn digits with 20% of the training labels replaced (so no model interpolates;"
                      " on clean digits the step sat at its cap in 99.8% of steps), IID", model="softmax regression",
                      clients="10", participation="all", **{"local steps": "5, batch 20", "learning rates":
                                                            "FedAvg lr 0.1 .. 30 (up to divergence); FedSPS c = 0.5, "
                                                            "gamma_b 1, 5, 10"},
                      rounds=str(rounds), seeds=str(len(seeds)), metric="final train loss; share of capped steps"),
                 bool(ok), seen)


def claim_decsps(quick: bool) -> Claim:
    """Paper 003: FedDecSPS converges to the optimum where FedSPS stalls in a neighbourhood (non-interpolating)."""
    rounds, seeds = (40, (0,)) if quick else (1000, (0, 1, 2))
    parts, gaps = [], {}
    for name, model in (("digits-noisy", "softmax"), ("synthetic-iid", "softmax")):
        kw = dict(clients=100, dirichlet=0.0) if name == "digits-noisy" else dict(clients=100)
        data = datasets.load(name, **kw)
        f_star = optimum(data, model, rounds=1 if quick else 20)
        h = run(Config(dataset=name, model=model, algorithms=("fedsps", "feddecsps"), participation=0.1,
                       local_steps=5, batch_size=20, rounds=rounds, seeds=seeds, eval_every=10, sps_c=0.5,
                       gamma_b=5.0, **kw))
        gaps[name] = {a: [v - f_star for v in _final(h, a)] for a in ("fedsps", "feddecsps")}
        parts.append(f"{name} (F* = {f_star:.5f}): F - F* FedSPS {_mean_std(gaps[name]['fedsps'])}, FedDecSPS "
                     f"{_mean_std(gaps[name]['feddecsps'])}")
    # rule: FedDecSPS ends with a smaller F - F* than FedSPS on both data sets (mean over seeds)
    ok = all(np.mean(g["feddecsps"]) < np.mean(g["fedsps"]) for g in gaps.values())
    return Claim(2, "FedDecSPS ends closer to the optimum than FedSPS (paper 003)",
                 dict(data="MNIST convex, 2 classes per client (non-IID)", model="logistic regression",
                      clients="100, 10 sampled a round", participation="10%",
                      **{"local steps": "tau = 5", "learning rates": "FedSPS c = 0.5, gamma_b; FedDecSPS c_0, "
                         "gamma_b"}, rounds="500", seeds="not stated", metric="F - F*"),
                 dict(data="digits with 20% noisy labels, IID; Synthetic(1,1) pooled and split IID (both "
                      "balanced, non-interpolating)", model="softmax regression", clients="100, 10 sampled a round",
                      participation="10%", **{"local steps": "5, batch 20", "learning rates": "c = c_0 = 0.5, "
                                              "gamma_b = 5 for both"}, rounds=str(rounds), seeds=str(len(seeds)),
                      metric="F - F* at the last round (F* by L-BFGS on the pooled data)"),
                 bool(ok), "; ".join(parts) + ". Rule: FedDecSPS's F - F* below FedSPS's on both.")


def claim_speedup(quick: bool, full: bool) -> Claim:
    """Paper 004: with the lr tuned per N, FedAvg's iterations to reach F - F* <= eps fall ~1/N."""
    if quick:
        ns, cs, seeds, rounds = (1, 4), (400.0,), (0,), 60
    elif full:
        ns, cs, seeds, rounds = (1, 2, 4, 8, 16, 32), (100.0, 200.0, 400.0, 800.0, 1600.0), (0, 1, 2), 1000
    else:
        ns, cs, seeds, rounds = (1, 2, 4, 8, 16), (100.0, 400.0, 1600.0), (0,), 600
    # eps: a pilot (N = 1 and 16, three (eta_0, c) pairs, 400 rounds) showed N = 1 at best 0.04 above F* after
    # 2000 iterations, so the review's eps = 0.01 is out of this budget; 0.05 is the smallest round target N = 1
    # reaches. eta_0 = 2: the pilot's lr 0.2 with c = 20 stalled at 0.2 above F* for every N.
    eps, steps, n, lr0 = 0.05, 5, 20_000, 2.0
    f_star = optimum(datasets.w8a_like(num_clients=1, num_samples=n), "softmax")
    iterations = {}
    for clients in ns:
        best = None
        for c in cs:
            h = run(Config(dataset="w8a-like", clients=clients, algorithms=("fedavg",), model="softmax",
                           participation=1.0, local_steps=steps, batch_size=4, lr=lr0, lr_c=c, rounds=rounds,
                           seeds=seeds, target=f_star + eps))
            hits = [h.rounds_to("fedavg", "train_loss", f_star + eps, s) for s in seeds]
            hits = [r * steps for r in hits if r is not None]
            if hits and (best is None or min(hits) < best[0]):
                best = (min(hits), c)
        iterations[clients] = best
    pts = [(k, v[0]) for k, v in iterations.items() if v]
    slope = float(np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)[0]) if len(pts) > 1 else 0.0
    # rule (unchanged from the first experiments): every N reaches the target and the log-log slope is <= -0.5
    ok = len(pts) == len(ns) and slope <= -0.5
    seen = (f"iterations (rounds x {steps}) to F - F* <= {eps} (F* = {f_star:.5f}), best "
            "over c and seeds: " + ", ".join(f"N={k}: {v[0]} (c = {v[1]:g})" if v else f"N={k}: not reached"
                                            for k, v in iterations.items()) +
            f"; log-log slope {slope:.2f} (ideal -1). Rule: all N reach it and slope <= -0.5. eps = {eps}, not the "
            "review's 0.01: a pilot before this run (N = 1 and 16, 400 rounds) left N = 1 at best 0.04 above F* "
            "after 2000 iterations." +
            ("" if full else " The full grid (N up to 32, 5 values of c, 3 seeds): "
             "`python -m fastagg.sim.reproduce --claims 3 --full-speedup`, about 10 minutes here (519 s on a "
             "loaded machine)."))
    return Claim(3, "FedAvg's iterations to a target fall ~1/N with N clients (linear speedup, paper 004)",
                 dict(data="w8a (LIBSVM), IID", model="logistic regression, lambda = 1/n", clients="N = 1 .. 32",
                      participation="all", **{"local steps": "E = 5, batch 4", "learning rates": "min(eta_0, "
                                              "c / (1 + t)), c tuned per N"}, rounds="until the target",
                      seeds="best of 3", metric="iterations until F - F* <= eps"),
                 dict(data="w8a-like: 20,000 sparse binary 300-feature samples, logistic teacher (w8a is not "
                      "downloadable here)", model="logistic regression (2-class softmax), no L2 term (the "
                      "simulator reports the data loss; the teacher's label noise keeps the optimum finite)",
                      clients="N = " + ", ".join(map(str, ns)), participation="all",
                      **{"local steps": "E = 5, batch 4", "learning rates": "min(2, c / (1 + t)), c in {" +
                         ", ".join(f"{c:g}" for c in cs) + "} per N"}, rounds=f"up to {rounds}",
                      seeds=f"best of {len(seeds)}", metric=f"iterations until F - F* <= {eps}"),
                 bool(ok), seen)


def ema(values, beta=0.9):
    """The exponential moving average paper 002 reports accuracy as: ``m_t = beta m_{t-1} + (1 - beta) v_t``,
    ``m_0 = v_0``."""
    out, m = [], None
    for v in values:
        m = v if m is None else beta * m + (1 - beta) * v
        out.append(m)
    return out


def claim_fedacg(quick: bool) -> Claim:
    """Paper 002: FedACG reaches a target accuracy in fewer rounds than FedAvgM (momentum tuned) and FedAvg."""
    rounds, seeds = (20, (0,)) if quick else (150, (0, 1, 2, 3, 4))
    specs = ("fedacg", "fedavgm:server_momentum=0.4", "fedavgm:server_momentum=0.6", "fedavgm:server_momentum=0.8",
             "fedavg")
    h = run(Config(dataset="digits", clients=50, dirichlet=0.3, model="mlp", participation=0.1, local_steps=20,
                   batch_size=20, lr=0.05, weight_decay=1e-3, algorithms=specs, rounds=rounds, seeds=seeds))
    target = 0.9
    stats = {}
    for a in specs:
        curves = [ema(h.series(a, "test_acc", s)) for s in seeds]
        hits = [next((t for t, v in enumerate(c) if v >= target), None) for c in curves]
        at = min(100, rounds)
        stats[a] = (hits, [c[at] for c in curves], _final(h, a))
    mean_hit = {a: (np.mean(v[0]) if all(x is not None for x in v[0]) else math.inf) for a, v in stats.items()}
    best_m = min((a for a in specs if a.startswith("fedavgm")), key=lambda a: mean_hit[a])
    # rule: FedACG's mean rounds to 90% EMA accuracy below the best FedAvgM's (momentum chosen by the same metric)
    # and below FedAvg's
    ok = mean_hit["fedacg"] < min(mean_hit[best_m], mean_hit["fedavg"])
    seen = "; ".join(f"{a}: rounds to {target:.0%} EMA accuracy {v[0]} (mean {mean_hit[a]:.1f}), EMA accuracy at "
                     f"round {min(100, rounds)} {_mean_std(v[1])}, final train loss {_mean_std(v[2])}"
                     for a, v in stats.items()) + f". Best FedAvgM: {best_m}. Rule: FedACG's mean rounds below the " \
        "best FedAvgM's and FedAvg's."
    return Claim(4, "FedACG reaches a target accuracy in fewer rounds than FedAvgM and FedAvg (paper 002)",
                 dict(data="CIFAR-10/100, Tiny-ImageNet, Dirichlet 0.3", model="ResNet-18",
                      clients="100 (5% a round) or 500 (2%)", participation="5% / 2%",
                      **{"local steps": "50 iterations", "learning rates": "lr 0.1, wd 1e-3; FedAvgM momentum "
                         "{0.4, 0.6, 0.8}; FedACG lambda 0.85, beta 0.01"}, rounds="1000",
                      seeds="3", metric="EMA-0.9 accuracy, rounds to a target"),
                 dict(data="scikit-learn digits, Dirichlet 0.3", model="MLP (64 hidden)",
                      clients="50, 5 a round", participation="10%",
                      **{"local steps": "20, batch 20", "learning rates": "lr 0.05, wd 1e-3; FedAvgM momentum "
                         "{0.4, 0.6, 0.8}; FedACG lambda 0.85, beta 0.01"}, rounds=str(rounds),
                      seeds=str(len(seeds)), metric="rounds to 90% EMA-0.9 test accuracy; EMA accuracy at round "
                      "100; final train loss"),
                 bool(ok), seen)


def claim_fedexp(quick: bool) -> Claim:
    """Paper 000: FedExP reaches a target accuracy in fewer rounds than FedAvg with a tuned server lr."""
    rounds, seeds = (20, (0,)) if quick else (150, (0, 1, 2, 3, 4))
    specs = ("fedexp", "fedavg:server_lr=1", "fedavg:server_lr=3.16", "fedavg:server_lr=10")
    h = run(Config(dataset="digits", clients=50, dirichlet=0.3, model="mlp", participation=0.4, local_steps=20,
                   batch_size=20, lr=0.05, lr_decay=0.998, eps=1e-3, eps_mode="official", eps_decay=0.998 ** 2,
                   algorithms=specs, rounds=rounds, seeds=seeds))
    hits = {}
    for target in (0.9, 0.95):
        for a in specs:
            r = [next((t for t, v in enumerate(h.series(a, "test_acc", s)) if v >= target), None) for s in seeds]
            hits[a, target] = (r, np.mean(r) if all(x is not None for x in r) else math.inf)
    best = {t: min((a for a in specs if a != "fedexp"), key=lambda a: hits[a, t][1]) for t in (0.9, 0.95)}
    # rule: at both targets FedExP's mean rounds are below the best-tuned FedAvg's (server lr chosen per target)
    ok = all(hits["fedexp", t][1] < hits[best[t], t][1] for t in (0.9, 0.95))
    seen = "; ".join(f"rounds to {t:.0%} test accuracy: " + ", ".join(f"{a} {hits[a, t][0]}" for a in specs) +
                     f" (best FedAvg: {best[t]})" for t in (0.9, 0.95)) + \
        "; final test accuracy: " + ", ".join(f"{a} {_mean_std(_final(h, a, 'test_acc'))}" for a in specs) + \
        ". Rule: FedExP's mean rounds below the best FedAvg's at both targets."
    return Claim(5, "FedExP reaches a target accuracy in fewer rounds than a tuned FedAvg (paper 000)",
                 dict(data="EMNIST / CIFAR-10, non-IID", model="CNN / ResNet", clients="20 a round",
                      participation="20 participants", **{"local steps": "tau = 20, batch 50", "learning rates":
                                                           "local lr tuned, decay 0.998 per round; eps tuned "
                                                           "(official code's units); FedAvg server lr tuned"},
                      rounds="500+", seeds="several", metric="test accuracy against rounds"),
                 dict(data="scikit-learn digits, Dirichlet 0.3", model="MLP (64 hidden)", clients="50, 20 a round",
                      participation="40%", **{"local steps": "20, batch 20", "learning rates": "lr 0.05, decay 0.998; "
                                              "eps 1e-3 in the official units with decay 0.998^2; FedAvg server lr "
                                              "{1, 3.16, 10}"}, rounds=str(rounds), seeds=str(len(seeds)),
                      metric="rounds to 90% and 95% test accuracy"),
                 bool(ok), seen)


CLAIMS = {1: claim_sps, 2: claim_decsps, 3: claim_speedup, 4: claim_fedacg, 5: claim_fedexp}


def report(claims: list, quick: bool, total: float) -> str:
    lines = ["# Reproduction of the papers' claims", "",
             f"Written by `python -m fastagg.sim.reproduce{' --quick' if quick else ''}` in {total:.0f} s on a "
             "2-core CPU. Every setting is fixed in `fastagg/sim/reproduce.py`, and each verdict's rule was written "
             "there before the runs; nothing was tuned to make a claim pass. Where a method is tuned (a baseline's "
             "grid), every grid point is reported.", "",
             "The first run of these claims (2 of 5 reproduced) was reviewed against the papers: claim 1's pass was "
             "degenerate (FedSPS's step sat at its cap, so it ran as FedAvg with lr 1 on separable data), claims 3 "
             "and 4 failed on set-ups far from the papers' (no lr decay and no F - F* target; an accuracy ceiling "
             "reached by every method). The set-ups below follow that review; the rules were re-fixed before these "
             "runs, not after.", ""]
    if quick:
        lines += ["**`--quick`: a smoke run (few rounds, one seed); its verdicts are not the claims'.**", ""]
    lines += ["| claim | verdict |", "|---|---|"]
    lines += [f"| {c.number}. {c.title} | {'reproduced' if c.reproduced else 'not reproduced'} |" for c in claims]
    lines += [""]
    for c in claims:
        lines += [f"## {c.number}. {c.title}", "", "| | paper | here |", "|---|---|---|"]
        lines += [f"| {f} | {c.paper.get(f, '')} | {c.ours.get(f, '')} |" for f in FIELDS]
        lines += ["", f"**{'reproduced' if c.reproduced else 'not reproduced'}** ({c.seconds:.0f} s) -- {c.seen}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join("runs", "reproduce"),
                    help="folder for REPRODUCTION.md (default: runs/reproduce; the repository's own report changes "
                    "only when given its folder and --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace a REPRODUCTION.md already in --out")
    ap.add_argument("--quick", action="store_true", help="few rounds and one seed: a smoke run, not the claims")
    ap.add_argument("--claims", default="1,2,3,4,5", help="which claims (default: all)")
    ap.add_argument("--full-speedup", action="store_true", help="claim 3 on the review's full grid (N up to 32, 5 "
                    "values of c, 3 seeds; about 10 minutes here)")
    a = ap.parse_args(argv)
    target = os.path.join(a.out, "REPRODUCTION.md")
    if os.path.lexists(target) and not a.overwrite:  # checked before the runs, not after them
        ap.exit(2, f"{ap.prog}: error: {target} exists; pass --overwrite to replace it or choose another --out\n")
    try:
        require("sklearn", "sim", "the claims' digits data set")
    except MissingDependency as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    t0 = time.perf_counter()
    claims = []
    for k in (int(x) for x in a.claims.split(",")):
        start = time.perf_counter()
        c = claim_speedup(a.quick, a.full_speedup) if k == 3 else CLAIMS[k](a.quick)
        c.seconds = time.perf_counter() - start
        print(f"claim {k}: {'reproduced' if c.reproduced else 'not reproduced'} ({c.seconds:.0f} s): {c.seen}",
              flush=True)
        claims.append(c)
    text = report(claims, a.quick, time.perf_counter() - t0)
    os.makedirs(a.out, exist_ok=True)
    outdir.write_file(a.out, "REPRODUCTION.md", lambda f: f.write(text + "\n"))  # never through a planted link
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
