"""FedExP round throughput on the CPU: M = 16 clients, d = 10^7 float32 (640 MB of updates).

Rows in one group are comparable (same run, same bytes); ``bench/report.py`` turns the JSON into GB/s and ratios.
Size: FASTAGG_BENCH_D (default 10^7). Run: ``make bench`` or
``pytest bench --benchmark-enable --benchmark-only --benchmark-json=bench/out.json``.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import fastagg
from baselines import flower_numpy, interleaved_ratios, torch_chunked, torch_gemv

M = 16
D = int(float(os.environ.get("FASTAGG_BENCH_D", "1e7")))
EPS = 1e-3
LAYERS = 12  # per-layer form for the Flower loop: views of the same bytes


@pytest.fixture(scope="module")
def round_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, D, generator=g)
    n = list(range(1, M + 1))
    p = torch.tensor(n, dtype=torch.float32) / sum(n)
    cuts = np.linspace(0, D, LAYERS + 1).astype(int)
    xn = x.numpy()
    per_layer = [[xn[i, a:b] for a, b in zip(cuts[:-1], cuts[1:])] for i in range(M)]
    return x, n, p, per_layer


@pytest.fixture
def mean_out():
    """A preallocated output for every contender that can take one (a fresh 40 MB buffer costs ~17 ms here)."""
    return torch.empty(D)


def _info(benchmark, nbytes):
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["M"], benchmark.extra_info["d"] = M, D


GROUP = f"fedexp M={M} d={D:.0e} fp32 (CPU)"


@pytest.mark.benchmark(group=GROUP)
def test_read_once(benchmark, round_data):
    """One plain read of the same bytes: X.sum()."""
    x = round_data[0]
    _info(benchmark, x.numel() * 4)
    benchmark(x.sum)


@pytest.mark.benchmark(group=GROUP)
def test_fastagg_cpu(benchmark, round_data, mean_out):
    """fastagg stats pass: mean, every ||d_i||^2, ||mean||^2, eta (reads X once, writes the mean)."""
    x, n = round_data[0], round_data[1]
    _info(benchmark, x.numel() * 4)
    benchmark(lambda: fastagg.fedexp_step(x, eps=EPS, weights=n, backend="cpu", mean_out=mean_out))


@pytest.mark.benchmark(group=GROUP)
def test_fastagg_cpu_fresh_output(benchmark, round_data):
    """The same, letting fastagg allocate the 40 MB mean on every call (page faults included)."""
    x, n = round_data[0], round_data[1]
    _info(benchmark, x.numel() * 4)
    benchmark(lambda: fastagg.fedexp_step(x, eps=EPS, weights=n, backend="cpu"))


@pytest.mark.benchmark(group=GROUP)
def test_fastagg_cpu_list(benchmark, round_data, mean_out):
    """The same from a list of M flat tensors (no [M, d] copy is made)."""
    x, n = round_data[0], round_data[1]
    rows = [r.clone() for r in x]
    _info(benchmark, x.numel() * 4)
    benchmark(lambda: fastagg.fedexp_step(rows, eps=EPS, weights=n, backend="cpu", mean_out=mean_out))


@pytest.mark.benchmark(group=GROUP)
def test_fastagg_cpu_with_params(benchmark, round_data, mean_out):
    """Stats pass + apply pass: params += eta*mean and the evaluation model written. Bytes counted: the
    unavoidable M*d read plus params read+written and eval written (3d), over (M+3)*d*4."""
    x, n = round_data[0], round_data[1]
    params, eval_out = torch.zeros(D), torch.empty(D)
    _info(benchmark, (M + 3) * D * 4)
    benchmark(lambda: fastagg.fedexp_step(x, eps=EPS, weights=n, params=params, backend="cpu", mean_out=mean_out,
                                          eval_out=eval_out))


@pytest.mark.benchmark(group=GROUP)
def test_fastagg_cpu_with_params_default_call(benchmark, round_data):
    """The call users write, ``fedexp_step(x, eps, params=w)``: fastagg allocates the mean and the evaluation model
    (huge-page mappings, fastagg/_buffers.py) on every call."""
    x, n = round_data[0], round_data[1]
    params = torch.zeros(D)
    _info(benchmark, (M + 3) * D * 4)
    benchmark(lambda: fastagg.fedexp_step(x, eps=EPS, weights=n, params=params, backend="cpu"))


@pytest.mark.benchmark(group=GROUP)
def test_torch_gemv(benchmark, round_data, mean_out):
    """Plain torch: p @ X and vector_norm(X, dim=1) (two reads of X)."""
    x, p = round_data[0], round_data[2]
    _info(benchmark, x.numel() * 4)
    benchmark(lambda: torch_gemv(x, p, EPS, out=mean_out))


@pytest.mark.benchmark(group=GROUP)
def test_torch_chunked(benchmark, round_data, mean_out):
    """Plain torch, column-chunked so the second read of a chunk hits the cache."""
    x, p = round_data[0], round_data[2]
    _info(benchmark, x.numel() * 4)
    benchmark(lambda: torch_chunked(x, p, EPS, out=mean_out))


@pytest.mark.benchmark(group=GROUP)
def test_flower_numpy_loop(benchmark, round_data):
    """Flower's per-layer numpy aggregate plus per-layer norms."""
    x, n, _, per_layer = round_data
    _info(benchmark, x.numel() * 4)
    benchmark.pedantic(lambda: flower_numpy(per_layer, n, EPS), rounds=3, iterations=1)


@pytest.mark.benchmark(group=GROUP)
def test_fastagg_accumulator(benchmark, round_data):
    """Streaming: M add() calls (each reads a delta and the running sum, writes the sum) + the final step.
    GB/s counts all three streams, so "x read" here compares with a read of 3x the bytes."""
    x, n = round_data[0], round_data[1]
    acc = fastagg.Accumulator(like=x[0], backend="cpu")
    _info(benchmark, 3 * x.numel() * 4)  # per client: read delta, read sum, write the new sum

    def run():
        acc.reset()
        for row, w in zip(x, n):
            acc.add(row, weight=w)
        return acc.fedexp_step(eps=EPS)

    benchmark.pedantic(run, rounds=3, iterations=1)


@pytest.mark.benchmark(group=GROUP)
def test_interleaved_ratios(benchmark, round_data, mean_out):
    """The README's headline CPU round: fastagg's FedExP stats pass against one plain read of the same bytes
    (X.sum), the best plain torch (GEMV + row norms, and the cache-chunked version) and Flower's per-layer numpy
    loop, called in a fresh random order every round (30 rounds when benchmarking, 2 as a smoke test)."""
    x, n, p, per_layer = round_data
    calls = {"read": x.sum,
             "fastagg": lambda: fastagg.fedexp_step(x, eps=EPS, weights=n, backend="cpu", mean_out=mean_out),
             "torch_gemv": lambda: torch_gemv(x, p, EPS, out=mean_out),
             "torch_chunked": lambda: torch_chunked(x, p, EPS, out=mean_out),
             "flower": lambda: flower_numpy(per_layer, n, EPS)}
    interleaved_ratios(benchmark, calls, {"fastagg / read": ("fastagg", "read"),
                                          "torch_gemv / fastagg": ("torch_gemv", "fastagg"),
                                          "torch_chunked / fastagg": ("torch_chunked", "fastagg"),
                                          "flower / fastagg": ("flower", "fastagg")},
                       rounds=2 if benchmark.disabled else 30)
