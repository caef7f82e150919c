"""Small fused CPU calls on a loaded machine: the default thread team against ``OMP_NUM_THREADS=1``.

A CPU-bound Python loop runs in a subprocess beside two worker processes (one started with ``OMP_NUM_THREADS=1``,
one with the default team). The parent asks them, in turn, to time a batch of each call, so both see the same load
at about the same moment, and prints per call the median time of each and their ratio (default / one thread: 1.0
means the team costs nothing on the loaded machine; the issue measured ~20x before the teams were sized to the work).
Then the same without the busy process, and the idle CPU time of a worker after its calls (a spinning OpenMP pool
burns it after the last parallel region; a passive one does not).

Calls: the client step of M = 1000 x d = 10^3 (``fastagg.client.local_step``), a FedExP round of 16 x 10^4
(``fastagg.fedexp_step``), an ``Accumulator.add`` of 10^4, and a large FedExP round of 16 x 10^7 (``--large``;
it must not get slower with the policy: compare its default time across commits).

Usage: ``python bench/bench_threads.py [--rounds 15] [--large]``. Print only; nothing asserted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

WORKER = r"""
import sys, time, resource, torch, fastagg
from fastagg import client
torch.manual_seed(0)
x = torch.randn(1000, 1000); g = 1e-3 * torch.randn(1000, 1000)
d16 = torch.randn(16, 10_000); w16 = torch.zeros(10_000)
acc_delta = torch.randn(10_000); acc = fastagg.Accumulator(like=acc_delta)
big = None
def client_step(): client.local_step(params=x, grads=g, lr=1e-3)
def fedexp_small(): fastagg.fedexp_step(d16, eps=1e-3, params=w16)
def acc_add(): acc.add(acc_delta)
def fedexp_large():
    global big
    if big is None: big = (torch.randn(16, 10_000_000), torch.zeros(10_000_000))
    fastagg.fedexp_step(big[0], eps=1e-3, params=big[1])
calls = {"client_step": client_step, "fedexp_16x1e4": fedexp_small, "acc_add_1e4": acc_add,
         "fedexp_16x1e7": fedexp_large}
for f in (client_step, fedexp_small, acc_add): f()
print("ready", flush=True)
for line in sys.stdin:
    name, n = line.split()
    if name == "idle":  # CPU seconds this process burns while its main thread sleeps 200 ms after a small call
        client_step(); fedexp_small()
        c0 = time.process_time(); time.sleep(0.2); print(time.process_time() - c0, flush=True); continue
    f = calls[name]; f()
    t0 = time.perf_counter()
    for _ in range(int(n)): f()
    print((time.perf_counter() - t0) / int(n), flush=True)
"""

BUSY = "while True: pass"


def start_worker(one_thread: bool) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    p = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=env)
    assert p.stdout.readline().strip() == "ready"
    return p


def ask(p: subprocess.Popen, name: str, n: int) -> float:
    p.stdin.write(f"{name} {n}\n")
    p.stdin.flush()
    return float(p.stdout.readline())


def measure(workers: dict, calls: dict, rounds: int) -> dict:
    times = {(c, w): [] for c in calls for w in workers}
    for r in range(rounds):
        for c, n in calls.items():
            order = list(workers) if r % 2 == 0 else list(workers)[::-1]  # alternate who goes first
            for w in order:
                times[(c, w)].append(ask(workers[w], c, n))
    return {k: statistics.median(v) for k, v in times.items()}


def report(title: str, med: dict, calls: dict) -> None:
    print(f"\n{title}")
    print(f"{'call':>16} {'default team':>14} {'OMP_NUM_THREADS=1':>18} {'ratio':>7}")
    for c in calls:
        a, b = med[(c, "default")], med[(c, "one")]
        print(f"{c:>16} {a * 1e3:11.3f} ms {b * 1e3:15.3f} ms {a / b:7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--large", action="store_true", help="also time the 16 x 10^7 FedExP round")
    args = ap.parse_args()
    calls = {"client_step": 20, "fedexp_16x1e4": 100, "acc_add_1e4": 200}
    workers = {"default": start_worker(False), "one": start_worker(True)}
    try:
        busy = subprocess.Popen([sys.executable, "-c", BUSY])
        try:
            time.sleep(0.5)
            report(f"loaded: one CPU-bound process beside the workers ({os.cpu_count()} CPUs), median of "
                   f"{args.rounds} interleaved batches", measure(workers, calls, args.rounds), calls)
        finally:
            busy.kill()
            busy.wait()
        time.sleep(0.2)
        if args.large:
            calls["fedexp_16x1e7"] = 2
        report("unloaded", measure(workers, calls, args.rounds), calls)
        idle = {w: statistics.median([ask(p, "idle", 0) for _ in range(5)]) for w, p in workers.items()}
        print(f"\nCPU time burnt during a 200 ms sleep after a small call: default team {idle['default'] * 1e3:.1f} ms,"
              f" OMP_NUM_THREADS=1 {idle['one'] * 1e3:.1f} ms")
    finally:
        for p in workers.values():
            p.stdin.close()
            p.wait()


if __name__ == "__main__":
    main()
