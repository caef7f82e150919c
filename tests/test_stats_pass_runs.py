"""The C++ stats pass's traversal (csrc/round_stats.cpp): runs of up to 4 blocks of a segment swept a row group at a
time, 8 rows a sweep on blocks of 1024+ columns and 4 on shorter ones, a separate loop for the first fold without
mean_init. None of it may change what the pass computes: the mean is the same bits whatever split the rows arrive
in, the results are the same bits for any thread count, and they agree with a float64 oracle, the float64 re-sums of
tiny and overflowing blocks and the non-finite flags included, in runs of several blocks and for client counts
that use every sweep width (8, 4 and single rows)."""
from __future__ import annotations

import pytest
import torch

from fastagg.backends import cpu
from fastagg.rows import client_rows, param_rows, with_base

# (no skip when the compiled module is missing: it is part of every install, and a build that lost it must fail here)

BLOCK = 8192
# a run of 4 full blocks and one more (2 runs), a segment of exactly 4 blocks, the 8-row threshold on both sides, a
# tiny segment, 5 blocks and a column
LENS = [8 * BLOCK + 5, 4 * BLOCK, 1023, 1024, 17, 5 * BLOCK + 1]


def stats(rows, weights, *, mean_init=None, aux=None, aux_coef=0.0, noise=None, dtype=torch.float32):
    m = rows.num_clients
    out = {"mean": torch.empty(rows.numel, dtype=dtype), "sq": torch.empty(m, dtype=torch.float64),
           "bad": torch.empty(m, dtype=torch.bool), "msq": torch.empty((), dtype=torch.float64)}
    kw = {} if noise is None else {"noise": noise}
    cpu.round_stats(rows=rows, weights=weights, mean_init=mean_init, aux=aux, aux_coef=aux_coef, mean_out=out["mean"],
                    sq_norms_out=out["sq"], nonfinite_out=out["bad"], mean_sq_out=out["msq"], **kw)
    return out


def segmented(x: torch.Tensor, lens: list, base: torch.Tensor | None = None):
    """Rows of x as per-layer clients cut at lens (each layer its own contiguous tensor), with base attached."""
    cuts = [list(t.clone() for t in row.split(lens)) for row in x]
    rows = client_rows(cuts, name="deltas")
    if base is not None:
        rows = with_base(rows, param_rows([t.clone() for t in base.split(lens)]))
    return rows


def weights_for(m: int) -> torch.Tensor:
    w = torch.tensor([100.0 + 7 * i for i in range(m)], dtype=torch.float64)
    return w / w.sum()


def with_threads(threads: int, fn):
    """fn() with a team of `threads` on any size of work (the per-thread unit made 1 byte), then the unit back."""
    before, unit = torch.get_num_threads(), cpu._C.bytes_per_thread()
    torch.set_num_threads(threads)
    cpu._C.set_bytes_per_thread(1)
    try:
        return fn()
    finally:
        cpu._C.set_bytes_per_thread(unit)
        torch.set_num_threads(before)


@pytest.mark.parametrize("m", [1, 3, 8, 12, 16, 19])
@pytest.mark.parametrize("has_base", [False, True])
def test_mean_is_the_same_bits_whatever_the_split(m, has_base):
    """One 40,000-column segment (8-row sweeps over runs of blocks) against 400 segments of 100 (4-row sweeps, one
    block a run): each column's mean is the same float32 operations in the same order either way."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 40_000, generator=g)
    base = torch.randn(40_000, generator=g) if has_base else None
    w = weights_for(m)
    one = stats(segmented(x, [40_000], base), w)
    many = stats(segmented(x, [100] * 400, base), w)
    assert torch.equal(one["mean"], many["mean"])
    torch.testing.assert_close(one["sq"], many["sq"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("m", [16, 13])
def test_bit_identical_for_one_and_two_threads(dtype, m):
    g = torch.Generator().manual_seed(3)
    d = sum(LENS)
    x = torch.randn(m, d, generator=g).to(dtype)
    base = torch.randn(d, generator=g).to(dtype)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    init = torch.randn(d, generator=g).to(cdt)
    aux = torch.randn(d, generator=g).to(cdt)
    rows = segmented(x, LENS, base)
    w = weights_for(m)
    cases = [dict(), dict(mean_init=init), dict(mean_init=init, aux=aux, aux_coef=0.5)]
    if dtype != torch.float64:
        cases.append(dict(noise=(0.01, 7, 3)))
    for kw in cases:
        one = with_threads(1, lambda: stats(rows, w, dtype=cdt, **kw))
        two = with_threads(2, lambda: stats(rows, w, dtype=cdt, **kw))
        for k in one:
            assert torch.equal(one[k], two[k]), (k, kw)


@pytest.mark.parametrize("m", [1, 5, 8, 16, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_agrees_with_a_float64_oracle(m, dtype):
    g = torch.Generator().manual_seed(m)
    d = sum(LENS)
    x = torch.randn(m, d, generator=g, dtype=torch.float64)
    base = torch.randn(d, generator=g, dtype=torch.float64)
    init = torch.randn(d, generator=g, dtype=torch.float64)
    aux = torch.randn(d, generator=g, dtype=torch.float64)
    w = weights_for(m)
    xd, bd = x.to(dtype).double(), base.to(dtype).double()
    delta = xd - bd
    for kw in (dict(), dict(mean_init=init), dict(aux=aux, aux_coef=-0.25)):
        got = stats(segmented(x.to(dtype), LENS, base.to(dtype)), w, dtype=dtype,
                    **{k: (v.to(dtype) if torch.is_tensor(v) else v) for k, v in kw.items()})
        mean = (w[:, None] * delta).sum(0)
        if "mean_init" in kw:
            mean = mean + kw["mean_init"].to(dtype).double()
        u = mean + kw["aux_coef"] * kw["aux"].to(dtype).double() if "aux" in kw else mean
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["mean"].double(), mean, **tol)
        torch.testing.assert_close(got["sq"], (delta * delta).sum(1), rtol=tol["rtol"], atol=0)
        torch.testing.assert_close(got["msq"], (u * u).sum(), rtol=tol["rtol"], atol=0)
        assert not got["bad"].any()


@pytest.mark.parametrize("m", [16, 6])
def test_float64_resums_and_flags_inside_runs(m):
    """Rows whose float32 block sums underflow (tiny values) or overflow (values near 1e20) in the middle of a run of
    blocks are summed again in float64; a NaN or an Inf in a later block of a run is flagged for its row only."""
    g = torch.Generator().manual_seed(5)
    lens = [6 * BLOCK + 77, 3000]
    d = sum(lens)
    x = torch.randn(m, d, generator=g)
    x[1] *= 1e-24                                          # every square underflows float32
    x[2, BLOCK:3 * BLOCK] *= 1e-22                         # blocks 2-3 of the first run only
    x[3, 2 * BLOCK + 5: 2 * BLOCK + 900] = 3e19            # squares overflow float32, not float64
    x[4, 5 * BLOCK + 11] = float("nan")                    # the second run of the first segment
    x[m - 1, d - 1] = float("inf")                         # the last column of the last segment
    base = torch.zeros(d)
    got = stats(segmented(x, lens, base), weights_for(m))
    ref = (x.double() ** 2).sum(1)
    fine = [i for i in range(m) if i not in (4, m - 1)]
    torch.testing.assert_close(got["sq"][fine], ref[fine], rtol=1e-5, atol=0)
    assert got["sq"][1] > 0
    assert got["bad"].tolist() == [i in (4, m - 1) for i in range(m)]
