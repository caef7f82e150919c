"""fastagg.HostFeeder: the bookkeeping of a double-buffered host-to-device feed, run here on a CPU accumulator (the
fold happens at once) and, on a GPU (tests/test_on_device.py), with pinned staging and a copy stream."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastagg


def _clients(d=1001, m=5):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(d, generator=g, dtype=torch.float64) for _ in range(m)]


def test_a_fed_round_equals_adding_each_client_and_reports_what_was_refused():
    xs = _clients()
    bad = xs[2].clone()
    bad[7] = float("nan")
    acc = fastagg.Accumulator(like=xs[0])
    feeder = fastagg.HostFeeder(acc)
    feeder.add(xs[0], 1.0, client_id="a")
    feeder.add(bad.numpy(), 2.0)                    # numpy, no id: reported by arrival number
    feeder.add(xs[1], 3.0, client_id="b")
    feeder.add(xs[3], 1.0, client_id="a")           # a resend
    buf = feeder.buffer(torch.float64)
    buf.copy_(xs[4])
    feeder.add(buf, 4.0, client_id="c")
    report = feeder.flush()
    assert report.folded == ["a", "b", "c"]
    assert [r[0] for r in report.refused] == [1, "a"]
    assert "NaN" in report.refused[0][1] and "already folded" in report.refused[1][1]
    ref = fastagg.Accumulator(like=xs[0])
    for x, n in ((xs[0], 1.0), (xs[1], 3.0), (xs[4], 4.0)):
        ref.add(x, n)
    assert torch.equal(acc._sum, ref._sum) and acc.total_weight == ref.total_weight == 8.0
    assert feeder.flush().folded == []  # a flush forgets what it reported


@pytest.mark.parametrize("bad, error", [
    (lambda d: torch.zeros(d + 1, dtype=torch.float64), "elements"),
    (lambda d: torch.zeros(d, dtype=torch.float32), "dtype"),
    (lambda d: [0.0] * d, "tensor or a numpy array"),
])
def test_bad_updates_are_refused_at_add_with_nothing_staged(bad, error):
    xs = _clients(m=1)
    acc = fastagg.Accumulator(like=xs[0])
    feeder = fastagg.HostFeeder(acc)
    with pytest.raises((TypeError, ValueError), match=error):
        feeder.add(bad(xs[0].numel()), 1.0)
    assert feeder.flush().folded == [] and acc.num_clients == 0


def test_only_flat_accumulators_are_fed():
    with pytest.raises(ValueError, match="flat"):
        fastagg.HostFeeder(fastagg.Accumulator(like={"w": torch.zeros(3), "b": torch.zeros(2)}))
    with pytest.raises(ValueError, match="flat"):
        fastagg.HostFeeder(fastagg.Accumulator(like=np.zeros(4)))
    with pytest.raises(TypeError, match="Accumulator"):
        fastagg.HostFeeder(torch.zeros(3))


def test_threads_with_a_feeder_each_fill_one_accumulator():
    """Two receiving threads, a feeder each, one shared accumulator: every client is folded once, as if added one by
    one (the accumulator's adds are thread-safe; a feeder belongs to its thread)."""
    import threading

    xs = _clients(m=12)
    acc = fastagg.Accumulator(like=xs[0])
    reports = {}

    def receive(t):
        feeder = fastagg.HostFeeder(acc)
        for i in range(t, 12, 2):
            feeder.add(xs[i], float(i + 1), client_id=i)
        reports[t] = feeder.flush()

    threads = [threading.Thread(target=receive, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert sorted(reports[0].folded + reports[1].folded) == list(range(12))
    assert not reports[0].refused and not reports[1].refused
    ref = sum((i + 1) * x for i, x in enumerate(xs))
    assert torch.allclose(torch.as_tensor(acc.weighted_sum), ref, rtol=1e-13, atol=1e-13)
    assert acc.total_weight == sum(range(1, 13))
