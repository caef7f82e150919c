"""Run the example app in Flower's in-process Simulation Runtime (Ray), no SuperLink needed:

    python examples/flower/simulate.py --strategy fedexp --model cnn --rounds 5 --clients 4

Prints each round's metrics and the result summary (``--out FILE`` writes it as JSON). ``--strategy
flower-fedadam`` runs Flower's own FedAdam for comparison with ``fedadam``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="fedexp")
    p.add_argument("--model", default="cnn", choices=["cnn", "linear"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--out", default="")
    a = p.parse_args()

    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fastagg_example import server_app
    from fastagg_example.client_app import app as client_app

    app = ServerApp()

    @app.main()
    def _main(grid, context):
        # every round waits for all the clients (a round that starts before they connect trains only some, and
        # runs of two strategies would then average different clients)
        server_app.run(grid, {"strategy": a.strategy, "model": a.model, "num-server-rounds": a.rounds,
                              "min-nodes": a.clients, "out-file": a.out})

    t0 = time.time()
    run_simulation(server_app=app, client_app=client_app, num_supernodes=a.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": os.cpu_count() or 1, "include_dashboard": False}})
    s = server_app.LAST_SUMMARY
    if not s.get("train"):
        sys.exit("the run produced no rounds (see the log above)")
    for r in sorted(s["train"], key=int):
        print(f"round {r}: train {json.dumps(s['train'][r])}  eval {json.dumps(s['eval'].get(r, {}))}")
    print(f"{a.strategy}: {a.rounds} rounds, {a.clients} clients in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
