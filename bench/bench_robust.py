"""fastagg.robust's rules on the CPU backend next to one plain read of the same bytes, and their peak extra memory.

    python bench/bench_robust.py                       # M = 16, d = 1e7 and M = 100, d = 1e6 (float32)
    FASTAGG_BENCH_SHAPES=16x1e7 python bench/bench_robust.py

Time: medians of 5 rounds, every rule and the plain read alternated within a round (one process), for the clients
as one [M, d] matrix and as M separately allocated rows. Plain read: ``r.sum()`` over every row (torch, all
cores). Memory: the process's peak resident set during one call (VmHWM, reset through /proc/self/clear_refs)
minus its resident set before the call; the estimate itself is d float32 (d x 4 bytes) of it, and an [M, d] copy
would add M x d x 4 more.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from fastagg import robust

RULES = {
    "Median": robust.Median(), "TrimmedMean(0.2)": robust.TrimmedMean(0.2), "MeaMed(f=2)": robust.MeaMed(2),
    "Krum(f=2)": robust.Krum(2), "MultiKrum(f=2)": robust.MultiKrum(2), "GeometricMedian": robust.GeometricMedian(),
    "NormBound(1)": robust.NormBound(1.0), "Bulyan(f=2)": robust.Bulyan(2),
}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_extra_bytes(fn) -> int:
    """Peak resident bytes above the resident set before ``fn()`` (Linux: clear_refs 5 resets VmHWM)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def bench(m: int, d: int, rounds: int = 5) -> None:
    g = torch.Generator().manual_seed(0)
    matrix = torch.randn(m, d, generator=g)
    rows = [torch.randn(d, generator=g) for _ in range(m)]  # separate allocations, as replies arrive
    print(f"\nM = {m}, d = {d:.0e} float32 ({4 * m * d / 1e9:.2f} GB), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for form, data in (("matrix", matrix), ("rows", rows)):
        read = list(data)
        times = {"plain read": []} | {k: [] for k in RULES}
        for _ in range(rounds):
            t0 = time.perf_counter()
            for r in read:
                r.sum()
            times["plain read"].append(time.perf_counter() - t0)
            for name, rule in RULES.items():
                if name.startswith("Bulyan") and m < 4 * 2 + 3:
                    continue
                t0 = time.perf_counter()
                robust.aggregate(data, rule, backend="cpu")
                times[name].append(time.perf_counter() - t0)
        read_s = statistics.median(times["plain read"])
        print(f"  {form}: plain read {read_s * 1e3:7.1f} ms ({4 * m * d / read_s / 1e9:5.1f} GB/s)")
        for name, rule in RULES.items():
            if not times[name]:
                continue
            t = statistics.median(times[name])
            extra = peak_extra_bytes(lambda: robust.aggregate(data, rule, backend="cpu"))
            print(f"    {name:<17} {t * 1e3:8.1f} ms  {t / read_s:5.2f}x a plain read   peak extra "
                  f"{extra / 1e6:7.1f} MB (estimate {4 * d / 1e6:.0f} MB; an [M, d] copy: {4 * m * d / 1e6:.0f} MB)")


def main() -> None:
    shapes = os.environ.get("FASTAGG_BENCH_SHAPES", "16x1e7,100x1e6")
    for shape in shapes.split(","):
        m, d = shape.split("x")
        bench(int(m), int(float(d)))


if __name__ == "__main__":
    main()
