"""A long simulator run with --out costs time linear in its rounds: the checkpoint holds the state (and a count of
metric rows), metrics are appended. Times the same run (digits, FedAvg, a metrics row and a checkpoint every round)
for several round counts, with --out and without, and prints seconds per round for each: flat per-round cost =
linear total.

    python bench/bench_sim_checkpoint.py [--rounds 5000,10000,20000]

Not a pytest benchmark (minutes of wall time); ``test_smoke`` runs it at 20 and 40 rounds in the test suite.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time

from fastagg.sim.runner import Config, run


def time_run(rounds: int, out: str | None) -> float:
    cfg = Config(dataset="digits", algorithms=("fedavg",), rounds=rounds, out=out)
    t0 = time.perf_counter()
    run(cfg)
    return time.perf_counter() - t0


def measure(round_counts) -> list:
    rows = []
    for rounds in round_counts:
        folder = tempfile.mkdtemp()
        try:
            with_out = time_run(rounds, folder)
        finally:
            shutil.rmtree(folder)
        without = time_run(rounds, None)
        rows.append((rounds, with_out, without))
        print(f"{rounds:>7} rounds: with --out {with_out:7.1f} s ({with_out / rounds * 1e3:.2f} ms/round), without "
              f"{without:7.1f} s ({without / rounds * 1e3:.2f} ms/round), ratio {with_out / without:.2f}", flush=True)
    return rows


def test_smoke():
    rows = measure([20, 40])
    assert len(rows) == 2


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", default="5000,10000,20000")
    a = ap.parse_args()
    measure([int(r) for r in a.rounds.split(",")])
