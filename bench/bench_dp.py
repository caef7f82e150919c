"""Differential privacy's cost: fastagg's fused DP steps against its plain FedAvg step, and Flower 1.42's
``DifferentialPrivacyServerSideFixedClipping(FedAvg)`` against fastagg.flower's on the same reply Messages.
M = 16 clients (FASTAGG_BENCH_M), d = 10^7 float32 (FASTAGG_BENCH_D).

    python bench/bench_dp.py          # medians of 5 rounds, every variant interleaved round by round
    python bench/bench_dp.py --accountant   # the accountant's per-round cost alone

Core (one [M, d] matrix, ``fastagg.server.FedAvg``): a plain read of the M x d bytes, the FedAvg step, the step with
``aggregate=ServerSideFixedClipping`` (two reads of the updates, the noise written by the second) and with
``ClientSideFixedClipping`` (one read, the noise written with the mean), and the noise alone: fastagg's generator
(``gaussian_noise``) next to numpy's ``np.random.normal`` in float64 cast to float32 (what Flower adds).
Flower: ``aggregate_train`` of each wrapper around each library's FedAvg, alternated round by round.
Accountant (``--accountant``, or with everything): the per-round cost of ``PrivacyAccountant.step(); .epsilon()``
over 500 rounds (the simulator's ``--dp`` does both every round) against what it cost before the accounting was
incremental (dp-accounting's ``compose(event)`` then ``get_epsilon`` every round: the event's RDP recomputed each
time; timed over 10 rounds, its cost is flat in the round), for each sampling mode at the simulator's defaults
(100 clients, 20 a round, z = 1).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

M = int(os.environ.get("FASTAGG_BENCH_M", "16"))
D = int(float(os.environ.get("FASTAGG_BENCH_D", "1e7")))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def core(rounds: int = 5) -> dict:
    from fastagg import privacy, server

    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, D, generator=g) * 1e-3
    params = torch.zeros(D)
    c = float(x[0].double().norm()) * 0.8  # about half the clients clipped
    plain = server.FedAvg(params, backend="cpu")
    ssf = server.FedAvg(params, backend="cpu", aggregate=privacy.ServerSideFixedClipping(1.0, c, M, seed=1))
    csf = server.FedAvg(params, backend="cpu", aggregate=privacy.ClientSideFixedClipping(1.0, 10 * c, M, seed=1))
    cases = {
        "plain read": lambda: x.sum(),
        "FedAvg step": lambda: plain.step(x),
        "server-side DP + FedAvg": lambda: ssf.step(x),
        "client-side DP + FedAvg": lambda: csf.step(x),
        "noise alone (fastagg)": lambda: privacy.gaussian_noise(D, seed=1, round=0, backend="cpu"),
        "noise alone (numpy, Flower's)": lambda: np.random.normal(0, 1.0, D).astype(np.float32),
    }
    for fn in cases.values():  # warm-up
        fn()
    times = {k: [] for k in cases}
    for _ in range(rounds):
        for k, fn in cases.items():
            times[k].append(_timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["FedAvg step"]
    print(f"core: M = {M}, d = {D} float32 ({4 * M * D / 1e9:.2f} GB of updates), torch {torch.__version__}, "
          f"{os.cpu_count()} cores, medians of {rounds}")
    for k, v in med.items():
        extra = f"  {v / base:5.2f}x the FedAvg step" if "DP" in k else ""
        if k.startswith("noise"):
            extra = f"  {v / D * 1e9:5.1f} ns an element"
        print(f"  {k:<30} {v * 1e3:8.1f} ms{extra}")
    return med


def flower(rounds: int = 3) -> dict:
    import bench_flower as bf
    from flwr.app import ConfigRecord, Message
    from flwr.serverapp import strategy as fl

    from fastagg import flower as fa

    bf.configure(M, D)
    arrays = bf._initial()
    kw = dict(min_available_nodes=1)
    c = 1.0
    theirs = fl.DifferentialPrivacyServerSideFixedClipping(fl.FedAvg(**kw), 1.0, c, M)
    ours = fa.DifferentialPrivacyServerSideFixedClipping(fa.FedAvg(**kw), 1.0, c, M, seed=1)
    plain = fa.FedAvg(**kw)
    fl_plain = fl.FedAvg(**kw)
    times = {"flower DP(FedAvg)": [], "flower FedAvg": [], "fastagg DP(FedAvg)": [], "fastagg FedAvg": []}
    for rnd in range(1, rounds + 1):
        for name, strat in (("fastagg DP(FedAvg)", ours), ("fastagg FedAvg", plain), ("flower DP(FedAvg)", theirs),
                            ("flower FedAvg", fl_plain)):
            msgs = sorted(strat.configure_train(rnd, arrays, ConfigRecord(), bf._grid()),
                          key=lambda m: m.metadata.dst_node_id)
            replies = bf._replies(plain, rnd, arrays)
            replies = [Message(content=r.content, reply_to=f) for r, f in zip(replies, msgs)]
            times[name].append(_timed(lambda: strat.aggregate_train(rnd, replies)))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"flower: M = {M}, d = {D} float32 replies, medians of {rounds} aggregate_train calls")
    for k, v in med.items():
        print(f"  {k:<22} {v * 1e3:8.1f} ms")
    print(f"  -> fastagg's wrapper {med['flower DP(FedAvg)'] / med['fastagg DP(FedAvg)']:.1f}x faster than Flower's")
    return med


def accountant(rounds: int = 500, old_rounds: int = 10) -> dict:
    import logging

    import dp_accounting as dpa

    from fastagg import privacy

    logging.getLogger("absl").setLevel(logging.ERROR)
    out = {}
    print(f"accountant: per-round step + epsilon, {rounds} rounds (before: dp-accounting recomposing, {old_rounds})")
    for mode in ("poisson", "without-replacement"):
        acc = privacy.PrivacyAccountant(1.0, sampling=mode, population_size=100, num_sampled=20)
        t0 = time.perf_counter()
        for _ in range(rounds):
            acc.step()
            acc.epsilon()
        new = (time.perf_counter() - t0) / rounds
        old_acc = acc._new()  # the former PrivacyAccountant.step / epsilon: compose the event again every round
        t0 = time.perf_counter()
        for _ in range(old_rounds):
            old_acc.compose(acc._event(), 1)
            old_acc.get_epsilon(acc.delta)
        old = (time.perf_counter() - t0) / old_rounds
        assert isinstance(old_acc, dpa.rdp.RdpAccountant)
        out[mode] = (old, new)
        print(f"  {mode:<20} before {old * 1e3:8.1f} ms a round, now {new * 1e3:8.3f} ms a round "
              f"(the first round computes the event once: {rounds} rounds in {new * rounds:.2f} s)")
    return out


if __name__ == "__main__":
    np.seterr(all="ignore")
    if "--accountant" in sys.argv:
        accountant()
        sys.exit(0)
    core()
    if "--no-flower" not in sys.argv:
        flower()
    accountant()
