"""The stats pass's streamed one-row fold (csrc/round_stats.cpp fold1_stream): a pass of 64 MiB or more whose last
fold is one float32 row (Accumulator.add at M = 1, a held batch of M = 4k + 1), mean_init given, writes the mean with
streaming stores and sums ||mean||^2 from the registers. Its results must be the bits of the plain path: the mean,
each row's squared norm and ||mean||^2.

The plain path is what a small pass runs, so each segment (one block: <= 8192 columns) is passed alone as the
reference; the whole pass sums the blocks in float64 in block order, from 0, which is the order the per-segment
results are added in here. Segment lengths are ragged (tails of 1..7 columns after the 8-column groups) and their
offsets misaligned (blocks whose mean is not 32-byte aligned take the plain loop inside the streamed pass).
"""
from __future__ import annotations

import pytest
import torch

from fastagg.backends import cpu

dl = cpu._dl


def _pass(rows, base, lens, wts, init, m):
    d = sum(lens)
    mean = torch.full((d,), float("nan"))
    sq = torch.empty(m, dtype=torch.float64)
    bad = torch.empty(m, dtype=torch.bool)
    msq = torch.empty((), dtype=torch.float64)
    cpu.compiled().round_stats([[dl(t) for t in seg] for seg in rows], None if base is None else [dl(t) for t in base],
                               list(lens), dl(wts), dl(init), None, 0.0, dl(mean), dl(sq), dl(bad), dl(msq), 0.0, 0, 0)
    return mean, sq, msq, bad


def _case(m, with_base, seed):
    g = torch.Generator().manual_seed(seed)
    lens = [8192 - (k % 11) * 37 - (k % 8) for k in range(760)]  # ~6.1M columns: 72+ MB with mean_init
    lens[3] = 5  # a segment shorter than one 8-column group
    rows = [[torch.randn(n, generator=g) for _ in range(m)] for n in lens]
    rows[7][0][3] = 1e-21  # tiny and large values: the block re-sums are the plain path's, per block
    base = [torch.randn(n, generator=g) for n in lens] if with_base else None
    init = torch.randn(sum(lens), generator=g)
    wts = torch.rand(m, generator=g, dtype=torch.float64) + 0.5
    return rows, base, lens, wts, init


def _reference(rows, base, lens, wts, init, m):
    means, sq, msq = [], torch.zeros(m, dtype=torch.float64), 0.0
    off = 0
    for s, n in enumerate(lens):
        mean_s, sq_s, msq_s, _ = _pass([rows[s]], None if base is None else [base[s]], [n], wts, init[off:off + n], m)
        means.append(mean_s)
        sq += sq_s
        msq += msq_s.item()
        off += n
    return torch.cat(means), sq, msq


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("with_base", [True, False])
def test_streamed_fold_is_the_plain_fold_bit_for_bit(m, with_base):
    rows, base, lens, wts, init = _case(m, with_base, seed=m)
    assert (m + with_base + 2) * sum(lens) * 4 >= 64 << 20  # the pass is streamed
    mean, sq, msq, bad = _pass(rows, base, lens, wts, init, m)
    ref_mean, ref_sq, ref_msq = _reference(rows, base, lens, wts, init, m)
    assert torch.equal(mean.view(torch.int32), ref_mean.view(torch.int32))
    assert torch.equal(sq, ref_sq)
    assert msq.item() == ref_msq
    assert not bad.any()
    # and against float64
    x = torch.stack([torch.cat([rows[s][i] for s in range(len(lens))]) for i in range(m)]).double()
    if base is not None:
        x -= torch.cat(base).double()
    want = init.double() + (wts[:, None] * x).sum(0)
    torch.testing.assert_close(mean.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sq, (x * x).sum(1), rtol=1e-5, atol=0)


def test_streamed_fold_same_bits_for_one_and_two_threads():
    rows, base, lens, wts, init = _case(1, True, seed=7)
    before, unit = torch.get_num_threads(), cpu.compiled().bytes_per_thread()
    out = {}
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            cpu.compiled().set_bytes_per_thread(1 if t > 1 else unit)
            out[t] = _pass(rows, base, lens, wts, init, 1)
    finally:
        cpu.compiled().set_bytes_per_thread(unit)
        torch.set_num_threads(before)
    for a, b in zip(out[1], out[2]):
        assert torch.equal(a, b)


def test_streamed_fold_flags_a_nonfinite_row():
    rows, base, lens, wts, init = _case(1, True, seed=3)
    rows[200][0][17] = float("inf")
    _, sq, _, bad = _pass(rows, base, lens, wts, init, 1)
    assert bad.tolist() == [True]
