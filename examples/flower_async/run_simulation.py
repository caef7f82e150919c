"""FedBuff on Flower: an asynchronous ServerApp (fastagg.flower.FedBuff) and ClientApps of very different speeds,
in Flower's simulation runtime on this machine.

    python examples/flower_async/run_simulation.py [--nodes 6] [--steps 20] [--buffer-size 3] [--slow 0.5]

Each node holds a least-squares problem (A_i, b_i) and runs a few gradient steps from the model it receives; node
0 is slow (it sleeps ``--slow`` seconds a training, the others 0.02 s). Replies are folded as they arrive, the
server takes a FedAvgM step every ``--buffer-size`` of them, and the node that replied gets the newest model at once:
the fast nodes never wait for the slow one. Prints every step's version with the updates per node and the loss.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from fastagg.flower.asynchronous import FedBuff

DIM = 50
ARGS = argparse.Namespace(nodes=6, steps=20, buffer_size=3, slow=0.5)


def problem(node: int):
    rng = np.random.default_rng(node)
    a = rng.standard_normal((40, DIM)).astype(np.float32)
    truth = np.ones(DIM, dtype=np.float32) + 0.3 * rng.standard_normal(DIM).astype(np.float32)  # non-IID optima
    return a, a @ truth


def global_loss(w: np.ndarray) -> float:
    return float(np.mean([np.mean((a @ w - b) ** 2) for a, b in map(problem, range(ARGS.nodes))]))


server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    fedbuff = FedBuff("fedavgm", optimizer_kwargs={"lr": 1.0, "momentum": 0.5}, buffer_size=ARGS.buffer_size,
                      min_available_nodes=ARGS.nodes)
    start = time.monotonic()
    result = fedbuff.start(grid, ArrayRecord([np.zeros(DIM, dtype=np.float32)]), num_steps=ARGS.steps, timeout=600)
    w = result.arrays.to_numpy_ndarrays()[0]
    print(f"{result.version} steps in {time.monotonic() - start:.1f} s; updates per node: "
          f"{dict(sorted(result.updates_per_node.items()))}; staleness of the updates folded: "
          f"max {max(result.staleness)}, mean {np.mean(result.staleness):.2f}; loss {global_loss(w):.4f} "
          f"(from {global_loss(np.zeros(DIM, dtype=np.float32)):.4f})")


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    time.sleep(ARGS.slow if pid == 0 else 0.02)
    a, b = problem(pid)
    w = msg.content["arrays"].to_numpy_ndarrays()[0].copy()
    for _ in range(5):
        w -= 0.01 * (2 / len(b)) * a.T @ (a @ w - b)
    return Message(RecordDict({"arrays": ArrayRecord([w]), "metrics": MetricRecord(
        {"num-examples": len(b), "train-loss": float(np.mean((a @ w - b) ** 2))})}), reply_to=msg)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--buffer-size", type=int, default=3)
    ap.add_argument("--slow", type=float, default=0.5)
    ARGS.__dict__.update(vars(ap.parse_args()))
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=ARGS.nodes,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": ARGS.nodes, "include_dashboard": False}})
