"""Flower 1.42's QFedAvg against fastagg.flower's on the same reply Messages, and fastagg.server.QFedAvg against
its FedAvg step. M = 16 (FASTAGG_BENCH_M), d = 10^7 float32 in 4 layers (FASTAGG_BENCH_D).

    python bench/bench_qfedavg.py      # medians of 3 aggregate_train calls, alternated round by round

fastagg's q-FedAvg is one read of the replies (the stats pass weighs them by F_i^q and gives each ||d_i||^2);
Flower's forms L (w - w_i) per reply and layer, its norm, scales it and sums, in numpy.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

M = int(os.environ.get("FASTAGG_BENCH_M", "16"))
D = int(float(os.environ.get("FASTAGG_BENCH_D", "1e7")))


def main(rounds: int = 3) -> dict:
    import bench_flower as bf
    import torch
    from flwr.app import ConfigRecord, Message
    from flwr.serverapp import strategy as fl

    from fastagg import flower as fa

    bf.configure(M, D)
    arrays = bf._initial()
    kw = dict(client_learning_rate=0.1, q=0.2, min_available_nodes=1)
    pairs = {"flower QFedAvg": fl.QFedAvg(**kw), "fastagg QFedAvg": fa.QFedAvg(**kw),
             "fastagg FedAvg": fa.FedAvg(min_available_nodes=1)}
    times = {k: [] for k in pairs}
    for rnd in range(1, rounds + 1):
        for name, strat in pairs.items():
            msgs = sorted(strat.configure_train(rnd, arrays, ConfigRecord(), bf._grid()),
                          key=lambda m: m.metadata.dst_node_id)
            replies = bf._replies(pairs["fastagg FedAvg"], rnd, arrays)
            for i, r in enumerate(replies):
                r.content.metric_records["metrics"]["train_loss"] = 0.5 + 0.1 * i
            replies = [Message(content=r.content, reply_to=f) for r, f in zip(replies, msgs)]
            t0 = time.perf_counter()
            strat.aggregate_train(rnd, replies)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"M = {M}, d = {D} float32 replies ({4 * M * D / 1e9:.2f} GB), torch {torch.__version__}, "
          f"{os.cpu_count()} cores, medians of {rounds} aggregate_train calls")
    for k, v in med.items():
        print(f"  {k:<18} {v * 1e3:8.1f} ms")
    print(f"  -> fastagg's QFedAvg {med['flower QFedAvg'] / med['fastagg QFedAvg']:.1f}x faster than Flower's, "
          f"{med['fastagg QFedAvg'] / med['fastagg FedAvg']:.2f}x fastagg's FedAvg")
    return med


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
