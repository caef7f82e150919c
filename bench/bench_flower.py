"""One FedAdam round through Flower 1.42's message-API strategy and through fastagg.flower's, from the same reply
Messages: M = 16 clients, d = 10^7 float32 in 4 layers (FASTAGG_BENCH_D to change d).

    python bench/bench_flower.py            # time (interleaved, medians) and peak extra memory, one run

Time: ``configure_train`` + ``aggregate_train`` of each strategy, alternated round after round in one process, next
to a plain read of the same reply bytes (``sum`` of each reply's arrays, viewed in place). Memory: each strategy in
a fresh process (glibc told to map large blocks and return them when freed, so the resident set follows live
memory); after a warm-up round (so optimizer state exists, as in every later round), the peak resident set during
``aggregate_train`` above the resident set just before it (Linux: ``/proc/self/clear_refs`` resets the peak).
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

M = 16
D = int(float(os.environ.get("FASTAGG_BENCH_D", "1e7")))
SIZES = [D // 2, D // 4, D // 8, D - D // 2 - D // 4 - D // 8]


def configure(m: int, d: int) -> None:
    """M replies of d float32 in 4 layers (halves, quarters, eighths and the rest), and Messages outside a run,
    Flower's logging at warnings: what the Flower benchmarks share."""
    import logging

    global M, D, SIZES
    M, D = m, d
    SIZES = [d // 2, d // 4, d // 8, d - d // 2 - d // 4 - d // 8]
    _setup()
    logging.getLogger("flwr").setLevel(logging.WARNING)


def _setup():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # Messages outside a run (flwr 1.42)


def _grid():
    class Grid:
        def get_node_ids(self):
            return list(range(1, M + 1))
    return Grid()


def _initial():
    from flwr.app import Array, ArrayRecord

    rng = np.random.default_rng(0)
    return ArrayRecord({f"layer{k}": Array(rng.standard_normal(n).astype(np.float32)) for k, n in enumerate(SIZES)})


def _replies(strategy, rnd, arrays):
    """M replies to ``strategy``'s train messages: the model sent plus a client-specific update."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    msgs = sorted(strategy.configure_train(rnd, arrays, ConfigRecord(), _grid()), key=lambda m: m.metadata.dst_node_id)
    base = {k: a.numpy() for k, a in arrays.items()}
    out = []
    for m in msgs:
        rng = np.random.default_rng(m.metadata.dst_node_id)
        rec = ArrayRecord({k: Array((v + 0.01 * rng.standard_normal(v.shape, dtype=np.float32)).astype(v.dtype))
                           for k, v in base.items()})
        out.append(Message(content=RecordDict({"arrays": rec, "metrics": MetricRecord({"num-examples": 10 + m.metadata.dst_node_id})}), reply_to=m))
    return out


def _make(which):
    if which == "flower":
        from flwr.serverapp.strategy import FedAdam
        return FedAdam(min_available_nodes=1)
    from fastagg.flower import FedAdam
    return FedAdam(min_available_nodes=1)


def memory(which: str) -> dict:
    """Peak extra resident memory of one aggregate_train (after a warm-up round), in a fresh process."""
    import logging
    _setup()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from flwr.app import ConfigRecord

    from fastagg._memcheck import PeakAbove
    s = _make(which)
    arrays = _initial()
    replies = _replies(s, 1, arrays)
    arrays, _ = s.aggregate_train(1, replies)  # warm-up: state allocated
    replies = _replies(s, 2, arrays)
    s.configure_train(2, arrays, ConfigRecord(), _grid())
    gc.collect()  # garbage of earlier rounds (Messages hold reference cycles) would be freed during the call
    with PeakAbove() as peak:
        s.aggregate_train(2, replies)
    return {"which": which, "extra_peak_mb": peak.bytes / 2**20, "model_mb": 4 * D / 2**20}


def timing(rounds: int = 7) -> dict:
    import logging

    import torch
    _setup()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from flwr.app import ConfigRecord
    from fastagg.flower import array_view

    strategies = {w: _make(w) for w in ("flower", "fastagg")}
    arrays = {w: _initial() for w in strategies}
    replies = _replies(strategies["fastagg"], 1, arrays["fastagg"])  # the same Messages for both
    views = [[torch.from_numpy(array_view(a)) for a in r.content["arrays"].values()] for r in replies]
    times = {"flower": [], "fastagg": [], "plain read": []}
    for rnd in range(1, rounds + 1):
        for w, s in strategies.items():
            t0 = time.perf_counter()
            s.configure_train(rnd, arrays[w], ConfigRecord(), _grid())
            out, _ = s.aggregate_train(rnd, replies)
            times[w].append(time.perf_counter() - t0)
            arrays[w] = out
        t0 = time.perf_counter()
        for r in views:
            for t in r:
                t.sum()
        times["plain read"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}  # round 1 allocates state: left out
    return {"median_s": med, "all_s": times}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--memory":
        print(json.dumps(memory(sys.argv[2])))
        return
    import platform

    import torch
    print(f"M = {M}, d = {D} float32 ({4 * M * D / 1e9:.2f} GB of replies), torch {torch.__version__}, "
          f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    t = timing()
    read_gb = 4 * M * D / 1e9
    for k, v in t["median_s"].items():
        print(f"{k:<12} {v * 1e3:9.1f} ms   {read_gb / v:6.1f} GB/s of replies   (rounds: "
              + ", ".join(f"{x * 1e3:.0f}" for x in t["all_s"][k]) + ")")
    ratio = t["median_s"]["flower"] / t["median_s"]["fastagg"]
    print(f"fastagg is {ratio:.1f}x faster than Flower; {t['median_s']['fastagg'] / t['median_s']['plain read']:.2f}x "
          "a plain read of the replies")
    mem = {}
    for w in ("flower", "fastagg"):
        # large blocks through mmap, returned to the OS when freed: the resident set then follows live memory (the
        # default dynamic threshold keeps freed 40 MB blocks resident and hides later peaks)
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="0")
        out = subprocess.run([sys.executable, __file__, "--memory", w], capture_output=True, text=True, check=True,
                             env=env)
        mem[w] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{w:<12} peak extra memory during aggregate_train: {mem[w]['extra_peak_mb']:7.1f} MB "
              f"(model: {mem[w]['model_mb']:.1f} MB)")
    print(f"fastagg's peak extra memory is 1/{mem['flower']['extra_peak_mb'] / max(mem['fastagg']['extra_peak_mb'], 1e-9):.1f}"
          f" of Flower's (target: 1/M = 1/{M})")


if __name__ == "__main__":
    main()
