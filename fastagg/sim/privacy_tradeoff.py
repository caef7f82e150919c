"""``python -m fastagg.sim.privacy_tradeoff [--out DIR] [--rounds N] [--seeds 0,1] [--quick]``: accuracy against
the privacy spent, FedAvg and FedAdam on digits under central DP with server-side fixed clipping.

digits split over 50 clients (Dirichlet 1.0), 20 sampled per round without replacement; each noise multiplier z
of ``Z`` is one run of both algorithms (same clipping norm ``CLIP``), and the accountant (dp-accounting, RDP,
sampled without replacement) gives epsilon at delta = 50^-1.1 after the last round. Writes ``DIR/PRIVACY.md``
(final test accuracy, mean +- std over seeds, and epsilon per z), ``DIR/accuracy_vs_epsilon.png`` and every run's
folder. ``--quick``: 8 rounds, one seed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from .experiments import pyplot, save, write_report
from .runner import Config, run

ALGORITHMS = ("fedavg", "fedadam")
Z = (0.0, 0.3, 0.5, 1.0, 2.0)  # 0.0: no noise (clipping only); the non-private baseline is run apart
CLIP = 0.5  # about the median norm of the clients' updates in the first rounds
CLIENTS, PARTICIPATION, DIRICHLET = 50, 0.4, 1.0  # (1438 training samples: 100 clients do not split)


def experiment(out: str, rounds: int, seeds: tuple) -> dict:
    """{label: History}: the non-private runs ("no DP") and one per z."""
    base = dict(dataset="digits", clients=CLIENTS, dirichlet=DIRICHLET, participation=PARTICIPATION, algorithms=ALGORITHMS, rounds=rounds,
                seeds=seeds)
    results = {"no DP": run(Config(**base, out=os.path.join(out, "nodp") if out else None), overwrite=True)}
    for z in Z:
        spec = f"server-fixed:clip={CLIP},z={z}"
        results[f"z = {z:g}"] = run(Config(**base, dp=spec, out=os.path.join(out, f"z{z:g}") if out else None),
                                    overwrite=True)
    return results


def _final(h, algorithm: str, field: str) -> list:
    return [h.series(algorithm, field, s)[-1] for s in h.config.seeds]


def table(results: dict) -> list[str]:
    lines = ["| setting | epsilon | " + " | ".join(f"{a} test accuracy" for a in ALGORITHMS) + " |",
             "|" + "---|" * (len(ALGORITHMS) + 2)]
    for label, h in results.items():
        eps = "inf (no noise)" if label == "z = 0" else "-" if label == "no DP" else \
            f"{statistics.fmean(_final(h, ALGORITHMS[0], 'epsilon')):.3g}"
        cells = []
        for a in ALGORITHMS:
            acc = _final(h, a, "test_acc")
            cells.append(f"{statistics.fmean(acc):.3f} +- {statistics.pstdev(acc) if len(acc) > 1 else 0.0:.3f}")
        lines.append(f"| {label} | {eps} | " + " | ".join(cells) + " |")
    return lines


def plot(results: dict, path: str) -> None:
    plt = pyplot("the privacy trade-off plot")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    noised = {k: h for k, h in results.items() if k.startswith("z = ") and k != "z = 0"}
    for a in ALGORITHMS:
        eps = [statistics.fmean(_final(h, a, "epsilon")) for h in noised.values()]
        acc = [statistics.fmean(_final(h, a, "test_acc")) for h in noised.values()]
        line = ax.plot(eps, acc, "o-", label=a)[0]
        ax.axhline(statistics.fmean(_final(results["no DP"], a, "test_acc")), ls="--", color=line.get_color(),
                   lw=0.8)
    ax.set_xscale("log")
    from matplotlib.ticker import NullFormatter

    ax.xaxis.set_minor_formatter(NullFormatter())  # (the minor labels of a short log axis overlap)
    ax.set_xlabel("epsilon (delta = 50^-1.1)")
    ax.set_ylabel("final test accuracy")
    ax.set_title("digits, server-side clipping + noise (dashed: no DP)")
    save(fig, path, legend_ax=ax)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/privacy", help="folder for the table, plot and runs")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    ap.add_argument("--quick", action="store_true", help="8 rounds, one seed: a smoke run")
    a = ap.parse_args(argv)
    rounds, seeds = (8, (0,)) if a.quick else (a.rounds, tuple(int(s) for s in a.seeds.split(",")))
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    results = experiment(a.out, rounds, seeds)
    lines = ["# Accuracy against privacy on digits (central DP, server-side fixed clipping)", "",
             f"Final test accuracy after {rounds} rounds (mean +- std over seeds {', '.join(map(str, seeds))}); "
             f"{CLIENTS} clients, {int(PARTICIPATION * CLIENTS)} sampled per round; clipping norm {CLIP}; noise std "
             f"z C / {int(PARTICIPATION * CLIENTS)} per coordinate, added to the clipped mean before the server "
             "optimizer; epsilon from dp-accounting (RDP, sampling without replacement) after "
             f"the last round (delta = 50^-1.1). Written by `python -m fastagg.sim.privacy_tradeoff{' --quick' if a.quick else ''}` "
             f"in {time.time() - t0:.0f} s.", ""] + table(results) + [""]
    write_report(a.out, "PRIVACY.md", lines)
    plot(results, os.path.join(a.out, "accuracy_vs_epsilon.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
