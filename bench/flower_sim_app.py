"""Flower's side of bench/bench_flower_sim.py: a ClientApp that trains fastagg.sim's small CNN with torch on its
node's partition of the same cifar-synthetic split, and Flower's FedAvg timed per round, run by
``flwr.simulation.run_simulation`` (Ray backend). Imported by name (bench/ on the path, FLOWER_SIM_CLIENTS set) so
that Ray's workers import it too and keep the data set they build:
``python -c "import flower_sim_app; flower_sim_app.main(ROUNDS)"`` prints ``ROUND_SECONDS [...]``."""
from __future__ import annotations

import json
import os
import time

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

STEPS, BATCH, LR, SAMPLED = 5, 10, 0.05, 50
CLIENTS = int(os.environ.get("FLOWER_SIM_CLIENTS", "1000"))
MODEL = os.environ.get("FLOWER_SIM_MODEL", "cnn")  # fastagg.sim's "cnn", or "softmax" (one linear layer)
_DATA: dict = {}


def data() -> dict:
    """The cifar-synthetic split and the model maker, built once per process (same function and seed as
    fastagg.sim's)."""
    if not _DATA:
        from fastagg.sim import data as datasets, models

        torch.set_num_threads(1)
        d = datasets.cifar_synthetic(num_clients=CLIENTS)
        if MODEL == "cnn":
            _DATA.update(d=d, make=lambda: models.make("cnn", d).module)
        else:
            _DATA.update(d=d, make=lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3072, 10)))
    return _DATA


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    d = data()
    k = int(context.node_config["partition-id"])
    net = d["make"]()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = d["d"].x[k], d["d"].y[k]
    for _ in range(STEPS):
        idx = torch.randint(0, len(y), (BATCH,))
        sgd.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x[idx].view(-1, 3, 32, 32)), y[idx]).backward()
        sgd.step()
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()),
                               "metrics": MetricRecord({"num-examples": len(y)})}), reply_to=msg)


STAMPS: list = []


class TimedFedAvg(FedAvg):
    """Flower's FedAvg, stamping the time after each round's aggregation."""

    def aggregate_train(self, server_round, replies):
        out = super().aggregate_train(server_round, replies)
        STAMPS.append(time.perf_counter())
        return out


def main(rounds: int) -> None:
    from flwr.simulation import run_simulation

    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        strategy = TimedFedAvg(fraction_train=SAMPLED / CLIENTS, fraction_evaluate=0.0, min_train_nodes=SAMPLED,
                               min_available_nodes=CLIENTS)
        STAMPS.append(time.perf_counter())
        strategy.start(grid=grid, initial_arrays=ArrayRecord(data()["make"]().state_dict()), num_rounds=rounds)
        print("ROUND_SECONDS " + json.dumps([b - a for a, b in zip(STAMPS, STAMPS[1:])]), flush=True)

    run_simulation(server_app=server, client_app=client, num_supernodes=CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": os.cpu_count(), "include_dashboard": False}})
