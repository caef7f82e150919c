"""The coordinate-select pass's sorting network (fastagg/backends/triton/robust.py) on the device it is for,
against the float64 reference (issue 48).

Each thread sorts whole columns with a min / max bitonic network whose client count and window are compile-time
constants, so every M, rule and dtype is its own compiled kernel: client counts around the network's powers of two
up to MAX_SELECT_CLIENTS, float32 / bf16 / float64 rows and full models against a base, the median, a trimmed mean
and MeaMed's window against the reference backend on float64 copies; half-integer values with ties at every trim
boundary, signed zeros and +-inf bit for bit; NaN clients marked and left out by ``robust.aggregate``; the configs
the benchmark measures (``_config``) equal to the default. Without CUDA the root conftest sets TRITON_INTERPRET=1
and the same checks run through the interpreter at smaller sizes.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from fastagg import robust
from fastagg.rows import attach_base, client_rows
from fastagg.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
trobust = importlib.import_module("fastagg.backends.triton.robust")

RULES = [robust.Median(), robust.TrimmedMean(0.2), robust.MeaMed(3)]
SHAPES = [(16, 200_003), (100, 50_001), (256, 10_007)] if ON_GPU else [(16, 40), (33, 21)]


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _select(rows, sel, backend, **kw):
    out = torch.empty(rows.numel, dtype=torch.float64, device=rows.device)
    sq = torch.empty(rows.num_clients, dtype=torch.float64, device=rows.device)
    bad = torch.zeros(rows.num_clients, dtype=torch.bool, device=rows.device)
    if kw:
        trobust.coord_select(rows=rows, rule=sel[0], first=sel[1], count=sel[2], out=out, sq_norms_out=sq,
                             nonfinite_out=bad, **kw)
    else:
        sq, bad = robust._select_coords(rows, sel, backend, out)
    return out.cpu(), sq.cpu(), bad.cpu()


@pytest.mark.parametrize("m,d", SHAPES, ids=[f"M{m}" for m, _ in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64] if ON_GPU else [torch.float32],
                         ids=str)
def test_select_network_against_the_reference_on_device(dtype, m, d):
    """Every rule at M = 16 (one column block of two columns a thread), 100 (padded to 128: the padding's
    comparators dropped) and 256 (MAX_SELECT_CLIENTS), per-layer segments, a base for float32 rows (a float64
    tile); the estimate, squared norms and marks against the reference backend on float64 copies."""
    x = 0.1 * _randn(m, d, seed=m, dtype=dtype)
    base = _randn(d, seed=1, dtype=dtype)
    cut = [d // 3, d - d // 3]
    for with_base in ((False, True) if dtype == torch.float32 else (False,)):
        data = x + base if with_base else x
        rows = client_rows([list(r.to(DEVICE).split(cut)) for r in data], name="deltas")
        ref_rows = client_rows(data if with_base else data.double(), name="deltas")
        if with_base:
            rows, _ = attach_base(rows, list(base.to(DEVICE).split(cut)))
            ref_rows, _ = attach_base(ref_rows, base)
        for rule in RULES:
            sel = rule.positions(m)
            got, sq, bad = _select(rows, sel, "triton")
            want, sq_ref, _ = _select(ref_rows, sel, "reference")
            assert_close(got, want, rtol=1e-12, atol=1e-12, name=f"{rule} base={with_base}")
            assert_close(sq, sq_ref, rtol=1e-12, atol=0, name=f"{rule} squared norms")
            assert not bad.any()


@pytest.mark.parametrize("m", [17, 100])
def test_select_network_ties_zeros_infinities_bit_for_bit_on_device(m):
    """Half-integer values on nine levels (duplicates at every trim boundary), signed zeros, +-inf (and both in one
    column: a NaN mean, as the reference's): float64 means of halves are exact, so equal bit for bit."""
    d = 100_003 if ON_GPU else 37
    g = torch.Generator().manual_seed(m)
    x = torch.randint(-4, 5, (m, d), generator=g).double() * 0.5
    x[0, :4] = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    x[m - 1, 4] = float("inf")
    x[m // 2, 5] = float("-inf")
    x[0, 6], x[m - 1, 6] = float("inf"), float("-inf")
    rows = client_rows(x.float().to(DEVICE), name="deltas")
    ref_rows = client_rows(x, name="deltas")
    k = m // 5
    for sel in [("window", (m - 1) // 2, 1), ("window", m // 2 - 1, 2), ("window", k, m - 2 * k), ("window", 0, m),
                ("nearest", 0, m - m // 8), ("nearest", 0, 1)]:
        got, _, bad = _select(rows, sel, "triton")
        want, _, _ = _select(ref_rows, sel, "reference")
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=str(sel))
        assert bad.tolist() == [i in (0, m // 2, m - 1) for i in range(m)]


def test_select_network_nan_clients_on_device():
    """NaN (sorting as +inf in the network) and Inf clients: marked as the reference marks them, and a robust
    aggregate leaves them out and equals the reference's over the others."""
    m, d = 100, (30_001 if ON_GPU else 29)
    x = _randn(m, d, seed=5)
    x[3, 7] = x[50, 0] = float("nan")
    x[99, d - 1] = float("-inf")
    for rule in RULES:
        got = robust.aggregate(x.to(DEVICE), rule, backend="triton")
        want = robust.aggregate(x.double(), rule, backend="reference")
        assert got.excluded.cpu().nonzero().flatten().tolist() == [3, 50, 99]
        assert_close(got.estimate.cpu().double(), want.estimate, rtol=1e-6, atol=1e-7, name=str(rule))


@pytest.mark.parametrize("m,configs", [(16, [dict(BLOCK_D=512), dict(TL_SORT=True)]),
                                       (100, [dict(BLOCK_D=256, num_warps=8), dict(TL_SORT=True, BLOCK_D=32)])])
def test_select_benchmark_configs_equal_the_default_on_device(m, configs):
    """The configs bench/gpu_bench.py measures beside the default (other tiles, the previous tl.sort pass) give
    the default's estimate and norms."""
    d = 70_001 if ON_GPU else 40
    rows = client_rows(_randn(m, d, seed=9).to(DEVICE), name="deltas")
    for rule in (robust.Median(), robust.MeaMed(m // 8)):
        sel = rule.positions(m)
        want, sq, bad = _select(rows, sel, "triton")
        for cfg in configs:
            got, sq2, bad2 = _select(rows, sel, "triton", _config=cfg)
            assert torch.equal(got, want), f"{rule} {cfg}"
            assert_close(sq2, sq, rtol=1e-13, atol=0, name=f"{rule} {cfg} squared norms")
            assert torch.equal(bad2, bad)
