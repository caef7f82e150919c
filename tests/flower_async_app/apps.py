"""A ServerApp running fastagg.flower.FedBuff and a ClientApp whose node of partition 0 is slow (tests only)."""
from __future__ import annotations

import time

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fastagg.flower.asynchronous import FedBuff

SLOW_SECONDS = 6.0  # node 0's training time; the others take 0.02 s
RESULT: dict = {}

server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    start = ArrayRecord([np.zeros(1000, dtype=np.float32)])
    fedbuff = FedBuff("fedavgm", optimizer_kwargs={"lr": 1.0, "momentum": 0.5}, buffer_size=2, concurrency=3,
                      min_available_nodes=3)
    RESULT["result"] = fedbuff.start(grid, start, num_steps=5, timeout=120)


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    time.sleep(SLOW_SECONDS if pid == 0 else 0.02)
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    version = int(msg.content["config"]["server-version"])
    new = [a + np.float32(0.01 * (pid + 1)) for a in arrays]
    return Message(RecordDict({"arrays": ArrayRecord(new),
                               "metrics": MetricRecord({"num-examples": 10, "partition": pid, "trained-from": version})}),
                   reply_to=msg)
