"""fastagg.flower.FedBuff in Flower's in-process Simulation Runtime (Ray): 3 nodes, node 0 training 300x slower
than the others (a controlled delay, not a timing assertion). Replies are folded as they arrive and every step
takes 2 of them, so the fast nodes carry the run: the slow node's first reply comes after the 10 updates the 5
steps need, or is folded as a stale one; nothing waits for it."""
from __future__ import annotations

from pathlib import Path

import flwr  # noqa: F401
import numpy as np
import ray  # noqa: F401

HERE = Path(__file__).resolve().parent


def test_a_fast_node_never_waits_for_a_slow_one(monkeypatch):
    from flwr.simulation import run_simulation

    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    monkeypatch.syspath_prepend(str(HERE))
    from flower_async_app import apps

    run_simulation(server_app=apps.server_app, client_app=apps.client_app, num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 3, "include_dashboard": False}})
    result = apps.RESULT["result"]
    assert result.version == 5 and not result.left_out
    counts = sorted(result.updates_per_node.values())
    assert sum(counts) == 10  # one step per 2 updates, none lost or counted twice
    assert counts[0] <= 1  # the slow node: at most one (stale) update while the others made the rest
    assert counts[1] + counts[2] >= 9
    metrics = result.train_metrics
    assert sorted(metrics) == [1, 2, 3, 4, 5] and all("trained-from" in m for m in metrics.values())
    w = result.arrays.to_numpy_ndarrays()[0]
    assert np.all(w > 0) and np.isfinite(w).all()
