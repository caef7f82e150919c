"""Streaming folds at d = 10^7 float32, 16 clients, in one run: ``Accumulator.add`` one client at a time against
``add_many`` of 4 and 16 clients per sweep, 4 threads of a pool adding at once (adds that wait for another are
folded together with it), and ``torch.add(sum, delta, out=)`` per client (the plain fold of the same bytes, no norms or checks). Medians of
5 repetitions, interleaved.

    python bench/bench_stream.py
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import fastagg
from fastagg.testing import SweepCounter

M, D = 16, 10_000_000


def main() -> None:
    x = torch.randn(M, D) * 0.01
    torch.add(torch.zeros(D), x[0]).sum()  # torch's first call out of the timing
    rows = list(x.unbind())
    weights = [float(i + 1) for i in range(M)]
    total = torch.zeros(D)

    def plain():
        for r in rows:
            torch.add(total, r, out=total)

    def one_by_one():
        acc = fastagg.Accumulator(like=rows[0])  # a server's, reused round after round (reset() in the round)

        def run():
            acc.reset()
            for r, w in zip(rows, weights):
                acc.add(r, w)
        return run

    def many(k):
        acc = fastagg.Accumulator(like=rows[0])

        def run():
            acc.reset()
            for i in range(0, M, k):
                acc.add_many(rows[i:i + k], weights[i:i + k])
        return run

    pool = ThreadPoolExecutor(4)  # a server's request threads (gRPC's pool): started once, as a server does

    sweeps = []  # the 4-thread accumulator's sweep counter: how many clients each fold took

    def threads():
        acc = fastagg.Accumulator(like=rows[0])  # a server's, reused round after round
        sweeps.append(SweepCounter(acc))

        def run():
            acc.reset()
            for f in [pool.submit(acc.add, r, w) for r, w in zip(rows, weights)]:
                f.result()
            acc.sq_norms  # what a step would read
        return run

    contenders = {"torch.add per client": plain, "add() per client": one_by_one(), "add_many, 4 per sweep": many(4),
                  "add_many, 16 per sweep": many(16), "4 threads add() at once": threads()}
    times = {k: [] for k in contenders}
    for _ in range(5):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["torch.add per client"])
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:<24} {med * 1e3 / M:6.2f} ms per client  ({med / base:.2f}x torch.add)")
    one, four = statistics.median(times["add() per client"]), statistics.median(times["4 threads add() at once"])
    print(f"4 threads' throughput: {one / four:.2f}x one thread's ({5 * M / sweeps[0].sweeps:.1f} clients per sweep)")


if __name__ == "__main__":
    main()
