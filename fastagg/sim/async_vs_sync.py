"""``python -m fastagg.sim.async_vs_sync [--out DIR] [--seeds 0,1] [--quick]``: FedBuff against synchronous FedAvg on
digits with 10% slow clients, on one virtual clock.

20 clients, each training takes Exp(1) time units, and 2 of them (drawn once per seed) take 10x as long.
Synchronous FedAvg samples 10 clients a round and waits for the slowest; FedBuff (``--mode async``) keeps 10
clients training, folds each update as it arrives with the staleness weight (1 + s)^-0.5 and takes a FedAvg step
(lr 1) every 5 updates. Reported: the virtual time each needs to reach a test
accuracy of ``TARGET`` (mean over seeds; from the evaluated versions / rounds), and the accuracy at a fixed
virtual time. Writes ``DIR/ASYNC.md`` and ``DIR/time.png``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from .experiments import pyplot, save, write_report
from .runner import Config, run

CLOCK = "exponential:mean=1,slow=0.1,factor=10"
TARGET = 0.85


def experiment(out: str, versions: int, rounds: int, seeds: tuple) -> dict:
    base = dict(dataset="digits", algorithms=("fedavg",), seeds=seeds, participation=0.5, client_time=CLOCK)
    sync = run(Config(**base, rounds=rounds, out=os.path.join(out, "sync") if out else None), overwrite=True)
    buff = run(Config(**base, rounds=versions, mode="async", concurrency=10, buffer_size=5,
                      staleness="polynomial:0.5", out=os.path.join(out, "fedbuff") if out else None), overwrite=True)
    return {"FedAvg (synchronous)": sync, "FedBuff (K = 5, 10 in flight)": buff}


def _time_to(h, seed: int, target: float) -> float | None:
    for acc, t in zip(h.series("fedavg", "test_acc", seed), h.series("fedavg", "virtual_time", seed)):
        if acc >= target:
            return t
    return None


def table(results: dict, target: float = TARGET) -> list[str]:
    lines = [f"| method | virtual time to {target:.0%} test accuracy | seeds reaching it | final accuracy | "
             "virtual time at the end |", "|---|---|---|---|---|"]
    for label, h in results.items():
        seeds = h.config.seeds
        times = [t for t in (_time_to(h, s, target) for s in seeds) if t is not None]
        finals = [h.series("fedavg", "test_acc", s)[-1] for s in seeds]
        ends = [h.series("fedavg", "virtual_time", s)[-1] for s in seeds]
        reach = f"{statistics.fmean(times):.1f}" if times else "never"
        lines.append(f"| {label} | {reach} | {len(times)}/{len(seeds)} | {statistics.fmean(finals):.3f} | "
                     f"{statistics.fmean(ends):.1f} |")
    return lines


def plot(results: dict, path: str) -> None:
    plt = pyplot("the asynchronous plot")

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, h in results.items():
        s = h.config.seeds[0]
        ax.plot(h.series("fedavg", "virtual_time", s), h.series("fedavg", "test_acc", s), label=label)
    ax.axhline(TARGET, ls="--", lw=0.8, color="gray")
    ax.set_xlabel("virtual time (Exp(1) per training; 10% of the clients 10x slower)")
    ax.set_ylabel("test accuracy")
    ax.set_title("digits: FedBuff against synchronous FedAvg")
    save(fig, path, legend_ax=ax)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/async", help="folder for the table, plot and runs")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--rounds", type=int, default=60, help="synchronous rounds")
    ap.add_argument("--versions", type=int, default=120, help="FedBuff server steps (each takes 5 updates)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: one seed, few rounds")
    a = ap.parse_args(argv)
    seeds = (0,) if a.quick else tuple(int(s) for s in a.seeds.split(","))
    rounds, versions = (6, 12) if a.quick else (a.rounds, a.versions)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    results = experiment(a.out, versions, rounds, seeds)
    lines = ["# FedBuff against synchronous FedAvg on a virtual clock (digits, 10% slow clients)", "",
             f"20 clients; a training takes Exp(1) time units, 10x as long for the 2 slow clients (drawn once per "
             f"seed). Synchronous: 10 clients a round, {rounds} rounds, each as long as its slowest participant. "
             f"FedBuff: 10 clients in flight, a server step every 5 updates (staleness weight (1 + s)^-0.5), "
             f"{versions} steps. Mean over seeds {', '.join(map(str, seeds))}. Written by "
             f"`python -m fastagg.sim.async_vs_sync{' --quick' if a.quick else ''}` in {time.time() - t0:.0f} s.",
             ""] + table(results) + [""]
    write_report(a.out, "ASYNC.md", lines)
    plot(results, os.path.join(a.out, "time.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
