"""Batched client local steps on the CPU.

Bandwidth-bound shape: M = 100 clients x d = 10^5 float32. fastagg's FedSPS step (two sweeps per row: norm, then
update, with most of the gradient row still cached for the second) against a plain ``X.add_(G)`` (read G, read X,
write X: the same unavoidable bytes) and the best batched plain-torch SPS we could write. Quote
``test_interleaved_ratios``: its ratios come from calls interleaved in one loop.
Dispatch-bound shape: M = 1000 x d = 10^3 (a simulator with small models): against a per-client Python loop of
plain torch calls. Shapes: FASTAGG_BENCH_CLIENT_SCALE (default 1) divides M for CI smoke runs.
"""
from __future__ import annotations

import os

import pytest
import torch

from baselines import interleaved_ratios
from fastagg import client

SCALE = int(os.environ.get("FASTAGG_BENCH_CLIENT_SCALE", "1"))
SHAPES = {"bandwidth": (100 // SCALE, 100_000), "dispatch": (1000 // SCALE, 1_000)}


def torch_batched_sps(x, g, f, c=0.5, gamma_b=1.0):
    """The best batched plain-torch FedSPS we found: ``vector_norm`` over rows (2.1 ms here, against 25 ms for
    ``(g*g).sum(1)`` and 7.5 ms for einsum), a few [M] ops, and an in-place ``addcmul_`` (2.5 ms, against 25 ms
    for ``x.sub_(gamma[:, None] * g)``, which allocates an [M, d] temporary)."""
    sq = torch.linalg.vector_norm(g, dim=1).double().square()
    gamma = torch.clamp(f / (c * sq), max=gamma_b)
    gamma = torch.where(torch.isfinite(gamma) & (sq > 1e-30) & (f > 0), gamma, torch.zeros_like(gamma))
    x.addcmul_(gamma.to(x.dtype)[:, None], g, value=-1.0)
    return gamma


def torch_loop_sps(x, g, f, c=0.5, gamma_b=1.0):
    """What a per-client simulator does: a Python loop of plain torch calls."""
    out = []
    for i in range(x.shape[0]):
        gi = g[i]
        sq = float(gi.dot(gi))
        fi = float(f[i])
        gamma = min(fi / (c * sq), gamma_b) if sq > 1e-30 and fi > 0 else 0.0
        x[i].add_(gi, alpha=-gamma)
        out.append(gamma)
    return out


def _data(shape):
    m, d = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, d, generator=gen)
    g = 1e-3 * torch.randn(m, d, generator=gen)  # small steps: many timed rounds keep x bounded
    f = (1.0 + torch.rand(m, generator=gen)).double()
    return x, g, f


def _group(benchmark, shape):
    m, d = SHAPES[shape]
    benchmark.group = f"client step {shape}: M={m} d={d} fp32 (CPU)"
    benchmark.extra_info["bytes"] = 3 * m * d * 4


@pytest.mark.parametrize("shape", list(SHAPES))
def test_read_add(benchmark, shape):
    """Plain X.add_(G): the unavoidable traffic of any local step."""
    x, g, _ = _data(shape)
    _group(benchmark, shape)
    benchmark(lambda: x.add_(g, alpha=1e-9))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fastagg_sps(benchmark, shape):
    x, g, f = _data(shape)
    _group(benchmark, shape)
    benchmark(lambda: client.sps_step(params=x, grads=g, losses=f, c=0.5, gamma_b=1e-3, backend="cpu"))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fastagg_sgd_momentum(benchmark, shape):
    """Plain SGD with momentum: also reads and writes the buffers (5 streams)."""
    x, g, _ = _data(shape)
    m = x.shape[0]
    state = client.ClientState(m, x.shape[1])
    ids = torch.arange(m)
    _group(benchmark, shape)
    benchmark(lambda: client.local_step(params=x, grads=g, lr=1e-3, momentum=0.9, state=state, client_ids=ids,
                                        backend="cpu"))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_torch_batched_sps(benchmark, shape):
    x, g, f = _data(shape)
    _group(benchmark, shape)
    benchmark(lambda: torch_batched_sps(x, g, f, gamma_b=1e-3))


@pytest.mark.parametrize("shape", ["dispatch"])
def test_torch_loop_sps(benchmark, shape):
    x, g, f = _data(shape)
    _group(benchmark, shape)
    benchmark.pedantic(lambda: torch_loop_sps(x, g, f, gamma_b=1e-3), rounds=5, iterations=1)


def test_interleaved_ratios(benchmark):
    """The bandwidth shape's three contenders called in a fresh random order every round: ratios within a round
    are immune to this VM's drift between pytest-benchmark's back-to-back groups (we have seen a plain X.add_ move
    by 30% from one group to the next). 300 rounds when benchmarking, 3 as a smoke test."""
    x, g, f = _data("bandwidth")
    _group(benchmark, "bandwidth")
    calls = {
        "add": lambda: x.add_(g, alpha=1e-9),
        "fastagg": lambda: client.sps_step(params=x, grads=g, losses=f, c=0.5, gamma_b=1e-3, backend="cpu"),
        "torch": lambda: torch_batched_sps(x, g, f, gamma_b=1e-3),
    }
    interleaved_ratios(benchmark, calls, {"fastagg / add": ("fastagg", "add"), "torch / fastagg": ("torch", "fastagg")},
                       rounds=3 if benchmark.disabled else 300)


def test_interleaved_ratios_dispatch(benchmark):
    """1000 small clients (d = 10^3): one fused call against a per-client Python loop of torch calls (what a
    per-client simulator does), interleaved; 50 rounds when benchmarking, 2 as a smoke test."""
    x, g, f = _data("dispatch")
    _group(benchmark, "dispatch")
    calls = {"fastagg": lambda: client.sps_step(params=x, grads=g, losses=f, c=0.5, gamma_b=1e-3, backend="cpu"),
             "loop": lambda: torch_loop_sps(x, g, f, gamma_b=1e-3)}
    interleaved_ratios(benchmark, calls, {"loop / fastagg": ("loop", "fastagg")}, rounds=2 if benchmark.disabled else 50)
