"""The simulator's virtual clock and asynchronous mode (fastagg/sim/asynchronous.py): the clock's draws, a
synchronous round lasting as long as its slowest participant, FedBuff runs that are reproducible, that fold stale
updates and that do not wait for slow clients, and bad settings refused before any work."""
from __future__ import annotations

import math

import pytest
import torch

from fastagg import asynchronous
from fastagg.sim import Config, run
from fastagg.sim import asynchronous as sim_async

BASE = dict(dataset="digits", algorithms=("fedavg",), participation=0.5, batch_size=16)
CLOCK = "exponential:mean=1,slow=0.1,factor=10"


def test_the_clock_draws_slow_clients_once_and_is_its_own_generator():
    spec = sim_async.parse_clock(CLOCK)
    a, b = sim_async.VirtualClock(spec, 20, seed=0), sim_async.VirtualClock(spec, 20, seed=0)
    assert torch.equal(a.factor, b.factor) and int((a.factor == 10).sum()) == 2
    ids = torch.arange(20)
    d = torch.stack([a.durations(ids) for _ in range(2000)])
    slow = a.factor == 10
    assert d[:, ~slow].mean().item() == pytest.approx(1.0, rel=0.05)
    assert d[:, slow].mean().item() == pytest.approx(10.0, rel=0.1)
    ln = sim_async.VirtualClock(sim_async.parse_clock("lognormal:mu=0,sigma=0.5"), 5, seed=1)
    x = torch.stack([ln.durations(torch.arange(5)) for _ in range(4000)]).log()
    assert x.mean().item() == pytest.approx(0.0, abs=0.03) and x.std().item() == pytest.approx(0.5, rel=0.05)


def test_a_synchronous_round_lasts_as_long_as_its_slowest_participant():
    plain = run(Config(**BASE, rounds=4))
    timed = run(Config(**BASE, rounds=4, client_time=CLOCK))
    # the clock has a generator of its own: the run itself (sampling, minibatches) is unchanged
    assert [r["train_loss"] for r in plain.rows] == [r["train_loss"] for r in timed.rows]
    times = [r["virtual_time"] for r in timed.rows]
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:]))


def test_fedbuff_is_reproducible_folds_stale_updates_and_does_not_wait(monkeypatch):
    seen = []
    real = asynchronous.AsyncServer.submit

    def spy(self, delta, version, **kw):
        r = real(self, delta, version, **kw)
        seen.append(r.staleness)
        return r

    monkeypatch.setattr(asynchronous.AsyncServer, "submit", spy)
    cfg = dict(BASE, rounds=12, mode="async", client_time=CLOCK, concurrency=10, buffer_size=5)
    a = run(Config(**cfg))
    n_submits = len(seen)
    b = run(Config(**cfg))
    assert [r["train_loss"] for r in a.rows] == [r["train_loss"] for r in b.rows]
    assert [r["round"] for r in a.rows] == list(range(13)) and n_submits == 12 * 5
    assert max(seen) >= 1  # updates from earlier versions were folded
    assert all(math.isfinite(r["train_loss"]) for r in a.rows)
    sync = run(Config(**BASE, rounds=6, client_time=CLOCK))  # the same 60 client updates, synchronously
    assert a.rows[-1]["virtual_time"] < sync.rows[-1]["virtual_time"] / 2  # the fast clients never wait


@pytest.mark.parametrize("kw,match", [
    (dict(mode="later"), "mode"), (dict(mode="async", algorithms=("scaffold",)), "state"),
    (dict(mode="async", dp="server-fixed:clip=1,z=1"), "dp"), (dict(mode="async", buffer_size=0), "buffer_size"),
    (dict(mode="async", staleness="cubic"), "staleness"), (dict(client_time="gamma:k=2"), "client-time"),
    (dict(client_time="exponential:mean=0"), "mean"), (dict(client_time="exponential:slow=2"), "slow"),
])
def test_bad_settings_fail_before_any_work(kw, match):
    with pytest.raises(ValueError, match=match):
        run(Config(**{**BASE, "rounds": 2, **kw}))


def test_the_async_experiment_writes_its_table_and_plot(tmp_path):
    from fastagg.sim import async_vs_sync

    assert async_vs_sync.main(["--out", str(tmp_path), "--quick"]) == 0
    text = (tmp_path / "ASYNC.md").read_text()
    assert "FedBuff" in text and "FedAvg (synchronous)" in text
    assert (tmp_path / "time.png").stat().st_size > 1000
