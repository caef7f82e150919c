"""A 1-billion-parameter model's round streamed through ``Accumulator``: bf16 client updates (2 GB each) generated
and folded one at a time, in O(model) memory.

    python bench/bench_stream_1b.py [--dim 1000000000] [--clients 16] [--step]

Two processes, one after the other (so each one's peak memory is its own): fastagg's ``acc.add(update, weight)``
per client, and the plain fold of the same bytes, ``torch.add(sum, update, out=sum)`` on an fp32 sum (no norms, no
finite check, no protection of the sum against a bad client). Per client: medians. Memory: the process's peak
resident set (``ru_maxrss``) after streaming every client, against the fp32 model's size (the target counts "at
most 3x the model"). ``--step`` also times a FedAvg step with the params at the end (it needs the params and the
mean: 2 more fp32 models). Client updates are a small random block tiled and scaled per client, so generating
them costs a copy, not a random draw of a billion numbers.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

import torch


def _stream(mode: str, d: int, clients: int, step: bool) -> None:
    base = torch.randn(d // 1000, dtype=torch.float32)
    update = torch.empty(d, dtype=torch.bfloat16)
    if mode == "fastagg":
        import fastagg

        acc = fastagg.Accumulator(like=update)
        fold = lambda i: acc.add(update, weight=float(1 + i))  # noqa: E731
    else:
        total = torch.zeros(d)
        fold = lambda i: torch.add(total, update, out=total)  # noqa: E731
    times = []
    for i in range(clients):
        update.view(1000, -1).copy_(base.mul(0.01 * (1 + i / clients)).expand(1000, -1))
        t0 = time.perf_counter()
        fold(i)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    line = (f"{mode}: {statistics.median(times) * 1e3:.0f} ms per client (median of {clients}; first "
            f"{times[0]:.2f} s); peak resident set {peak:.1f} GB = {peak / (d * 4 / 1e9):.2f} x the fp32 model")
    if step and mode == "fastagg":
        w = torch.zeros(d)
        t0 = time.perf_counter()
        acc.fedavg_step(params=w)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
        line += f"; FedAvg step with the params {time.perf_counter() - t0:.2f} s, peak then {peak:.1f} GB"
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=1_000_000_000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--step", action="store_true")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.mode:
        _stream(a.mode, a.dim, a.clients, a.step)
        return
    print(f"d = {a.dim:.2e}, {a.clients} bf16 clients of {a.dim * 2 / 1e9:.1f} GB; fp32 model {a.dim * 4 / 1e9:.1f} GB",
          flush=True)
    for mode in ("fastagg", "torch"):
        subprocess.run([sys.executable, __file__, "--mode", mode, "--dim", str(a.dim), "--clients", str(a.clients)]
                       + (["--step"] if a.step else []), check=True)


if __name__ == "__main__":
    main()
