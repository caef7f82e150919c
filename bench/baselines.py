"""What users run today, written as fairly as we can, for the benchmarks to race against.

Each returns (mean, sq_norms, eta) for FedExP with uniform or given weights p (a float64 numpy/torch vector).
"""
from __future__ import annotations

from functools import reduce

import numpy as np
import torch


def fedexp_eta(avg_sq: float, mean_sq: float, eps: float) -> float:
    return max(1.0, avg_sq / (2 * (mean_sq + eps))) if mean_sq + eps > 0 else 1.0


def torch_gemv(x: torch.Tensor, p: torch.Tensor, eps: float, out: torch.Tensor | None = None):
    """Two BLAS-backed passes: mean = p @ X (GEMV), norms = vector_norm over rows."""
    mean = torch.mv(x.t(), p, out=out)
    sq = torch.linalg.vector_norm(x, dim=1).square()
    return mean, sq, fedexp_eta(float(p.double() @ sq.double()), float(mean.double().square().sum()), eps)


def torch_chunked(x: torch.Tensor, p: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                  chunk: int = 1 << 15):
    """One pass through the cache: column chunks small enough that the second read of a chunk hits L2."""
    m, d = x.shape
    mean = torch.empty(d, dtype=x.dtype) if out is None else out
    sq = torch.zeros(m, dtype=torch.float64)
    for c0 in range(0, d, chunk):
        xc = x[:, c0:c0 + chunk]
        torch.mv(xc.t(), p, out=mean[c0:c0 + chunk])
        sq += torch.linalg.vector_norm(xc, dim=1).double().square()
    return mean, sq, fedexp_eta(float(p.double() @ sq), float(mean.double().square().sum()), eps)


def flower_numpy(layers_per_client: list, num_examples: list, eps: float):
    """Flower's ``aggregate`` (per-layer numpy: weight every layer, reduce with np.add, divide) plus the per-layer
    squared norms a FedExP strategy on Flower computes per client."""
    total = sum(num_examples)
    weighted = [[layer * n for layer in layers] for layers, n in zip(layers_per_client, num_examples)]
    mean = [reduce(np.add, layer_updates) / total for layer_updates in zip(*weighted)]
    sq = np.array([sum(float(np.sum(layer ** 2)) for layer in layers) for layers in layers_per_client])
    p = np.asarray(num_examples, dtype=np.float64) / total
    mean_sq = sum(float(np.sum(layer ** 2)) for layer in mean)
    return mean, sq, fedexp_eta(float(p @ sq), mean_sq, eps)


def last_level_cache_bytes(default: int = 256 << 20) -> int:
    """The largest CPU cache Linux reports (sysfs; ``default`` where it reports none)."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = open(path).read().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=default)


def cache_evictor():
    """A zero-argument function that writes a buffer of twice the last-level cache (at most 1 GiB), so that the call
    timed after it reads its inputs from memory: the VM this project measures on reports a 300 MiB L3, in which a
    160 MB input read a moment earlier partly stays and flatters whatever reads it next."""
    buf = torch.empty(min(2 * last_level_cache_bytes(), 1 << 30), dtype=torch.uint8)
    return lambda: buf.fill_(1)


def interleaved_times(calls: dict, rounds: int, seed: int = 0, warmup: int = 0, before=None) -> dict:
    """``calls`` (name -> zero-argument function) timed in a fresh random order every round: name -> the list of
    ``rounds`` times in seconds (after ``warmup`` untimed rounds), so that times of one round compare calls under the
    same load on this shared VM. ``before``: a zero-argument function run untimed before every call (say,
    :func:`cache_evictor`'s)."""
    import random
    import time

    times = {k: [] for k in calls}
    order = list(calls)
    rng = random.Random(seed)
    for r in range(warmup + rounds):
        rng.shuffle(order)
        for k in order:
            if before is not None:
                before()
            t0 = time.perf_counter()
            calls[k]()
            if r >= warmup:
                times[k].append(time.perf_counter() - t0)
    return times


def interleaved_medians(calls: dict, rounds: int, warmup: int = 1, before=None) -> dict:
    """name -> the median time in seconds of :func:`interleaved_times`."""
    import statistics

    return {k: statistics.median(v) for k, v in interleaved_times(calls, rounds, warmup=warmup, before=before).items()}


def interleaved_ratios(benchmark, calls: dict, pairs: dict, rounds: int, seed: int = 0) -> dict:
    """Time ``calls`` (name -> zero-argument function) in a fresh random order every round, ``rounds`` rounds, and
    record in ``benchmark.extra_info`` each contender's median time (``NAME_ms``) and, for every ``pairs`` entry
    ``label: (a, b)``, the median over rounds of time(a) / time(b): ratios within a round are immune to this VM's
    drift between back-to-back groups. ``bench/report.py`` prints every such ratio in its summary table."""
    import statistics

    def run():
        return interleaved_times(calls, rounds, seed)

    times = benchmark.pedantic(run, rounds=1, iterations=1)
    ratios = {label: statistics.median(x / y for x, y in zip(times[a], times[b])) for label, (a, b) in pairs.items()}
    medians = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}
    benchmark.extra_info.update({"ratios": ratios, **medians, "rounds": rounds})
    print(f"\ninterleaved, {rounds} rounds: " + ", ".join(f"{k} {v:.3f}" for k, v in {**medians, **ratios}.items()))
    return ratios
