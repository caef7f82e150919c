"""Flower 1.42's robust strategies against fastagg.flower's on the same reply Messages: FedMedian, FedTrimmedAvg,
Krum, MultiKrum, Bulyan; M = 16 clients (FASTAGG_BENCH_M), d = 2 x 10^6 float32 in 4 layers (FASTAGG_BENCH_D).

    python bench/bench_flower_robust.py      # time (interleaved, medians of 5 rounds) next to a plain read

Time: ``configure_train`` + ``aggregate_train`` of each strategy, alternated round after round in one process, and a
plain read of the same reply bytes. fastagg's side: the fused coordinate-select pass (FedMedian, FedTrimmedAvg,
Bulyan's last step) and the Gram pass (the Krum family, Bulyan's selection), the estimate in the fused
weighted-sum pass (csrc/robust.cpp). bench/bench_robust.py times the rules themselves.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_flower as bf  # noqa: E402  (the reply Messages and grid of the FedAdam benchmark)

bf.M = int(os.environ.get("FASTAGG_BENCH_M", "16"))
bf.D = int(float(os.environ.get("FASTAGG_BENCH_D", "2e6")))
bf.SIZES = [bf.D // 2, bf.D // 4, bf.D // 8, bf.D - bf.D // 2 - bf.D // 4 - bf.D // 8]
F = 2  # num_malicious_nodes (Bulyan needs M >= 4f + 3)


def _pairs():
    from flwr.serverapp import strategy as fl

    from fastagg import flower as fa

    kw = dict(min_available_nodes=1)
    return {
        "FedMedian": (fl.FedMedian(**kw), fa.FedMedian(**kw)),
        "FedTrimmedAvg": (fl.FedTrimmedAvg(beta=0.2, **kw), fa.FedTrimmedAvg(beta=0.2, **kw)),
        "Krum": (fl.Krum(num_malicious_nodes=F, **kw), fa.Krum(num_malicious_nodes=F, **kw)),
        "MultiKrum": (fl.MultiKrum(num_malicious_nodes=F, num_nodes_to_select=bf.M - F, **kw),
                      fa.MultiKrum(num_malicious_nodes=F, num_nodes_to_select=bf.M - F, **kw)),
        "Bulyan": (fl.Bulyan(num_malicious_nodes=F, **kw), fa.Bulyan(num_malicious_nodes=F, **kw)),
    }


def main(rounds: int = 5) -> None:
    import logging

    import torch
    bf._setup()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from flwr.app import ConfigRecord, Message

    from fastagg.flower import array_view

    print(f"M = {bf.M}, d = {bf.D} float32 ({4 * bf.M * bf.D / 1e9:.2f} GB of replies), torch {torch.__version__}, "
          f"{os.cpu_count()} cores")
    arrays = bf._initial()
    for name, (theirs, ours) in _pairs().items():
        times = {"flower": [], "fastagg": [], "plain read": []}
        for rnd in range(1, rounds + 1):
            replies = bf._replies(ours, rnd, arrays)  # fresh Messages: Flower's median pops arrays out of them
            views = [[torch.from_numpy(array_view(a)) for a in r.content["arrays"].values()] for r in replies]
            t0 = time.perf_counter()
            for r in views:
                for t in r:
                    t.sum()
            times["plain read"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ours.aggregate_train(rnd, replies)
            times["fastagg"].append(time.perf_counter() - t0)
            fl_msgs = sorted(theirs.configure_train(rnd, arrays, ConfigRecord(), bf._grid()),
                             key=lambda m: m.metadata.dst_node_id)
            again = bf._replies(ours, rnd, arrays)
            t0 = time.perf_counter()
            theirs.aggregate_train(rnd, [Message(content=r.content, reply_to=f) for r, f in zip(again, fl_msgs)])
            times["flower"].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{name:<14} flower {med['flower'] * 1e3:8.1f} ms   fastagg {med['fastagg'] * 1e3:8.1f} ms   "
              f"plain read {med['plain read'] * 1e3:6.1f} ms   -> fastagg {med['flower'] / med['fastagg']:5.1f}x "
              f"faster, {med['fastagg'] / med['plain read']:5.1f}x a plain read")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
