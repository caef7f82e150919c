"""``python -m fastagg.sim.compression_tradeoff [--out DIR] [--rounds N] [--seeds 0,1] [--quick]``: accuracy against
the bytes the clients upload, FedAvg and FedExP on digits, for every compression fastagg folds where it lies.

digits split over 50 clients (Dirichlet 1.0), 20 sampled per round, the data set's paper settings otherwise; each
compression of ``SPECS`` is one run of both algorithms (the same seeds, so the same clients and mini-batches):
fp32 (the baseline), bf16, int8 blockwise (block 256), fp8 e4m3 (block 256), QSGD (s = 16, buckets of 256), top-k
and random-k at 5% with error feedback. Writes ``DIR/COMPRESSION.md`` (final test accuracy, mean +- std over seeds,
and the bytes uploaded per round against fp32's), ``DIR/accuracy_vs_bytes.png`` (test accuracy against the bytes
uploaded so far) and every run's folder. ``--quick``: 6 rounds, one seed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from .experiments import pyplot, save, write_report
from .runner import Config, run

ALGORITHMS = ("fedavg", "fedexp")
SPECS = {"fp32": "none", "bf16": "bf16", "int8": "int8:block=256", "fp8": "fp8:block=256",
         "QSGD s=16": "qsgd:s=16,bucket=256", "top-k 5% + EF": "topk:0.05", "rand-k 5% + EF": "randk:0.05"}
CLIENTS, PARTICIPATION, DIRICHLET = 50, 0.4, 1.0


def experiment(out: str, rounds: int, seeds: tuple) -> dict:
    """{label: History}, one run (both algorithms) per compression."""
    base = dict(dataset="digits", clients=CLIENTS, dirichlet=DIRICHLET, participation=PARTICIPATION,
                algorithms=ALGORITHMS, rounds=rounds, seeds=seeds)
    return {label: run(Config(**base, compress=spec, out=os.path.join(out, spec.split(":")[0]) if out else None),
                       overwrite=True) for label, spec in SPECS.items()}


def _final(h, algorithm: str, field: str) -> list:
    return [float(h.series(algorithm, field, s)[-1]) for s in h.config.seeds]


def table(results: dict) -> list[str]:
    base = statistics.fmean(_final(results["fp32"], ALGORITHMS[0], "bytes_sent"))
    lines = ["| upload | bytes / round | vs fp32 | " + " | ".join(f"{a} test accuracy" for a in ALGORITHMS) +
             " | " + " | ".join(f"{a} train loss" for a in ALGORITHMS) + " |", "|" + "---|" * (3 + 2 * len(ALGORITHMS))]
    for label, h in results.items():
        sent = statistics.fmean(_final(h, ALGORITHMS[0], "bytes_sent"))
        rounds = h.series(ALGORITHMS[0], "round", h.config.seeds[0])[-1]
        cells = [f"{sent / rounds / 1e3:.1f} kB", f"{base / sent:.2f}x smaller" if label != "fp32" else "1"]
        for field, fmt in (("test_acc", ".3f"), ("train_loss", ".4f")):
            for a in ALGORITHMS:
                v = _final(h, a, field)
                cells.append(f"{statistics.fmean(v):{fmt}} +- {statistics.pstdev(v) if len(v) > 1 else 0.0:{fmt}}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def plot(results: dict, path: str) -> None:
    plt = pyplot("the compression trade-off plot")

    fig, axes = plt.subplots(1, len(ALGORITHMS), figsize=(9, 3.6), sharey=True)
    for ax, a in zip(axes, ALGORITHMS):
        for label, h in results.items():
            s = h.config.seeds[0]
            ax.plot([b / 1e6 for b in h.series(a, "bytes_sent", s)], h.series(a, "test_acc", s), label=label)
        ax.set_xscale("symlog", linthresh=0.1)
        ax.set_xlabel("MB uploaded by the clients so far")
        ax.set_title(f"digits, {a}")
    axes[0].set_ylabel("test accuracy")
    save(fig, path, legend_ax=axes[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/compression", help="folder for the table, plot and runs")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    ap.add_argument("--quick", action="store_true", help="6 rounds, one seed: a smoke run")
    a = ap.parse_args(argv)
    rounds, seeds = (6, (0,)) if a.quick else (a.rounds, tuple(int(s) for s in a.seeds.split(",")))
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    results = experiment(a.out, rounds, seeds)
    lines = ["# Accuracy against the bytes uploaded on digits (compressed client updates)", "",
             f"Final test accuracy and training loss after {rounds} rounds (mean +- std over seeds "
             f"{', '.join(map(str, seeds))}); {CLIENTS} clients, {int(PARTICIPATION * CLIENTS)} sampled per round, "
             "the data set's paper settings otherwise. Each client compresses its update (fastagg.client."
             "compress_updates: stochastic rounding and random-k keyed by seed, round and client; error feedback "
             "residuals in ClientState for the sparse kinds) and the server folds what was sent where it lies. "
             "Bytes: codes, scales, indices and values as sent. Written by "
             f"`python -m fastagg.sim.compression_tradeoff{' --quick' if a.quick else ''}` in {time.time() - t0:.0f} s.",
             ""] + table(results) + [""]
    write_report(a.out, "COMPRESSION.md", lines)
    plot(results, os.path.join(a.out, "accuracy_vs_bytes.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
