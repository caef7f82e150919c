"""The asynchronous server's cost per update against a bare ``Accumulator.add`` of the same update, d = 10^7 float32
(FASTAGG_BENCH_D), from the main thread (where a submit runs to completion on fastagg's helper thread, so a
signal cannot cut it) and from 1 and 4 request threads: every submit folds into a buffer of K = 1000 (no step in the timed
window), so what is measured is the server's bookkeeping (version, staleness, slot, id) around the same fold.

    python bench/bench_async.py       # medians of 5 timed windows of 16 updates, the two paths interleaved
"""
from __future__ import annotations

import os
import statistics
import threading
import time

import torch

D = int(float(os.environ.get("FASTAGG_BENCH_D", "1e7")))
N = 16  # updates per timed window


def _window(fold, updates, threads: int) -> float:
    """Seconds for ``threads`` threads (0: the main thread) to fold ``updates`` (split evenly) with
    ``fold(i, update)``."""
    if threads == 0:
        t0 = time.perf_counter()
        for i, u in enumerate(updates):
            fold(i, u)
        return time.perf_counter() - t0
    share = [list(range(t, len(updates), threads)) for t in range(threads)]
    start = threading.Barrier(threads + 1)

    def work(ids):
        start.wait()
        for i in ids:
            fold(i, updates[i])

    ts = [threading.Thread(target=work, args=(ids,)) for ids in share]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def main(rounds: int = 5) -> dict:
    import fastagg
    from fastagg import server
    from fastagg.asynchronous import AsyncServer

    g = torch.Generator().manual_seed(0)
    updates = [torch.randn(D, generator=g) for _ in range(N)]
    out = {}
    print(f"d = {D} float32, {N} updates per window, torch {torch.__version__}, {os.cpu_count()} cores, "
          f"medians of {rounds}")
    for threads in (0, 1, 4):
        times = {"Accumulator.add": [], "AsyncServer.submit": []}
        for r in range(rounds + 1):
            acc = fastagg.Accumulator(torch.zeros(D))
            srv = AsyncServer(server.FedAvg(torch.zeros(D)), buffer_size=1000)
            t_add = _window(lambda i, u: acc.add(u), updates, threads)
            t_sub = _window(lambda i, u: srv.submit(u, 0, client_id=(r, i)), updates, threads)
            if r:  # the first window warms up (buffers allocated)
                times["Accumulator.add"].append(t_add / N)
                times["AsyncServer.submit"].append(t_sub / N)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = med["AsyncServer.submit"] / med["Accumulator.add"]
        print(f"  {f'{threads} thread(s)' if threads else 'main thread'}: add {med['Accumulator.add'] * 1e3:6.2f} ms, submit "
              f"{med['AsyncServer.submit'] * 1e3:6.2f} ms per update -> {ratio:.3f}x")
        out[threads] = (med, ratio)
    return out


if __name__ == "__main__":
    main()
