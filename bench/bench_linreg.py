"""The README's main job -- FedExP and FedAvg (server lr 10) on the FedExP paper's linear regression, 200 rounds,
20 clients, 20 full-batch local steps, float64 -- run by ``fastagg.sim`` against a paper-style numpy loop (one
client at a time, one local step at a time, as the FedExP notebook writes it), on the same data.

    python bench/bench_linreg.py [--repeats 3]

Prints each contender's time (interleaved repeats, medians), the ratio, the data set's build time (a fresh
process), and what each run reached: rounds to F <= 1e-4 (last iterate), the loss at rounds 50/100/200. FedAvg
is deterministic and non-chaotic: the two implementations agree to ~1e-12. FedExP with eps = 0 divides two
quantities that both go to 0, so rounding differences grow into different (equally valid) trajectories after a
few dozen rounds; what must agree is how fast each reaches a loss level.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np

ROUNDS, STEPS, LR = 200, 20, 0.1


def numpy_loop(algorithm: str, A: list, b: list) -> list:
    """The notebook's loop: per round, each client copies w and runs 20 gradient steps; then the server step.
    Returns F(w) after every round (round 0 included; F = mean_i ||A_i w - b_i||^2, the last iterate)."""
    d = A[0].shape[1]
    w = np.zeros(d)
    losses = [float(np.mean([np.sum((a @ w - y) ** 2) for a, y in zip(A, b)]))]
    for _ in range(ROUNDS):
        deltas = []
        for a, y in zip(A, b):
            wi = w.copy()
            for _ in range(STEPS):
                wi -= LR * (a.T @ (a @ wi - y))
            deltas.append(wi - w)
        deltas = np.array(deltas)
        mean = deltas.mean(0)
        if algorithm == "fedexp":  # eps = 0, as the paper's regression experiment
            eta = max(1.0, float(np.mean(np.sum(deltas ** 2, 1))) / (2 * float(mean @ mean)))
        else:
            eta = 10.0  # FedAvg with server lr 10 (paper 000, Table 3)
        w = w + eta * mean
        losses.append(float(np.mean([np.sum((a @ w - y) ** 2) for a, y in zip(A, b)])))
    return losses


def fastagg_sim(algorithm: str, data) -> list:
    from fastagg.sim import runner

    cfg = runner.Config(dataset="fedexp-linreg", algorithms=(algorithm,), server_lr=10.0).resolved(data)
    rows = []
    runner.run_one(cfg, data, algorithm, 0, on_row=rows.append)
    return [r["train_loss_last"] for r in rows]


def _rounds_to(losses, target=1e-4):
    return next((t for t, v in enumerate(losses) if v <= target), None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    build = subprocess.run([sys.executable, "-c", "import time, fastagg.sim.data as D; t = time.perf_counter(); "
                            "D.fedexp_linreg(); print(time.perf_counter() - t)"], capture_output=True, text=True,
                           check=True)
    print(f"data set built in {float(build.stdout):.2f} s (fresh process)")
    from fastagg.sim import data as datasets

    data = datasets.fedexp_linreg()
    A = [data.x[i, : int(data.counts[i])].numpy() for i in range(data.num_clients)]
    b = [data.y[i, : int(data.counts[i])].numpy() for i in range(data.num_clients)]
    for algorithm in ("fedexp", "fedavg"):
        times = {"numpy loop": [], "fastagg.sim": []}
        results = {}
        for _ in range(a.repeats):
            for name, fn in (("numpy loop", lambda: numpy_loop(algorithm, A, b)),
                             ("fastagg.sim", lambda: fastagg_sim(algorithm, data))):
                t0 = time.perf_counter()
                results[name] = fn()
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\n{algorithm}, {ROUNDS} rounds x 20 clients x {STEPS} steps:")
        for k, v in times.items():
            r = results[k]
            print(f"  {k:<12} {med[k]:6.2f} s (runs: {', '.join(f'{x:.2f}' for x in v)}); rounds to 1e-4: "
                  f"{_rounds_to(r)}; F at 50/100/200: {r[50]:.3g} / {r[100]:.3g} / {r[200]:.3g}")
        print(f"  fastagg.sim is {med['numpy loop'] / med['fastagg.sim']:.1f}x faster")
        if algorithm == "fedavg":
            diff = max(abs(x - y) / max(abs(y), 1e-300) for x, y in zip(results["fastagg.sim"], results["numpy loop"]))
            print(f"  largest relative difference of the loss curves: {diff:.2e}")
    under_load(data, a.repeats)


def under_load(data, repeats: int) -> None:
    """fastagg.sim's FedExP run alone, then beside one CPU-bound process (a busy loop), then alone again."""
    def timed():
        t0 = time.perf_counter()
        fastagg_sim("fedexp", data)
        return time.perf_counter() - t0

    quiet = [timed() for _ in range(repeats)]
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        loaded = [timed() for _ in range(repeats)]
    finally:
        hog.kill()
        hog.wait()
    after = [timed() for _ in range(repeats)]
    q = statistics.median(quiet + after)
    print(f"\nunder load (FedExP, one CPU-bound process beside it): quiet {q:.2f} s, loaded "
          f"{statistics.median(loaded):.2f} s ({statistics.median(loaded) / q:.2f}x; runs: "
          + ", ".join(f"{x:.2f}" for x in loaded) + ")")


if __name__ == "__main__":
    main()
