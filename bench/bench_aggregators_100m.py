"""fastagg against NVIDIA FLARE's and Flower's own weighted aggregation: 100 million float32 parameters (8 layers,
a dict of numpy arrays, as both frameworks hold a model), 16 clients sending full models, weights = example counts.

    .venv-nvflare/bin/python bench/bench_aggregators_100m.py --side flare     # make test-nvflare builds that env
    .venv/bin/python bench/bench_aggregators_100m.py --side flower

FLARE side -- results arrive one at a time and are folded as they arrive (FLARE's FedAvg workflow); 3 rounds per
process (the first round's time, and the median of the later ones: a server's steady state):
  flare helper      ``WeightedAggregationHelper.add(params, weight, site, round)`` per client, then ``get_result()``
                    (the aggregation FLARE's own FedAvg runs);
  fastagg           ``fastagg.nvflare.FastaggAggregator(rule="fedavg")``: ``accept_model`` per client (each update
                    ``params - global`` formed in the kernel, its norm and finite check on the way), then
                    ``aggregate_model()`` (the step, the new model returned as numpy arrays).
Flower side -- the strategy is handed every reply at once (Flower holds them all):
  flower            ``flwr.server.strategy.aggregate.aggregate_inplace(results)`` over ``FitRes`` whose parameters
                    are Flower's serialized arrays (``ndarrays_to_parameters``);
  fastagg           ``fastagg.fedavg_step`` over the same replies' bytes, read in place (numpy views of each
                    array's payload, no copy): the weighted average model.
Each method runs in a fresh process, framework and fastagg alternating, ``--reps`` times for the time of the
aggregation calls alone (client arrays are made before each call and not timed; glibc as it comes), then once more
each for the peak resident set during them above the resident set just before (glibc told to return freed blocks
at once, so the resident set follows live memory; the kernel's peak counter reset at the start), next to the
model's size. FLARE side: the window starts before the round's first result, so fastagg's copy of the model and
its sums are counted. The client arrays (one
arriving client on the FLARE side, all 16 replies on the Flower side) exist before the window and are not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

M, D, LAYERS, ROUNDS = 16, 100_000_000, 8, 3


def _layer_sizes(d: int) -> list:
    base = d // LAYERS
    return [base] * (LAYERS - 1) + [d - base * (LAYERS - 1)]


def _model(d: int, scale: float, block: np.ndarray) -> dict:
    """A model of ``d`` float32 params: a random block tiled and scaled (a copy, not a random draw of d numbers)."""
    out = {}
    for i, n in enumerate(_layer_sizes(d)):
        a = np.empty(n, dtype=np.float32)
        reps = -(-n // block.size)
        np.multiply(np.tile(block, reps)[:n], np.float32(scale * (1 + i / LAYERS)), out=a)
        out[f"layer{i}.weight"] = a
    return out


def _flare(method: str, d: int, rounds: int = ROUNDS) -> dict:
    """``rounds`` rounds in one server process, as FLARE's FedAvg runs them: a new helper each round (FLARE builds
    one per round), one aggregator for the run (fastagg). Per round: time; over the run: peak memory."""
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper

    from fastagg._memcheck import PeakAbove
    from fastagg.nvflare import FastaggAggregator

    block = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    glob = _model(d, 1.0, block)
    weights = [float(10 + 5 * i) for i in range(M)]
    times, peak, base_rss, agg = [], 0, None, None
    for rnd in range(rounds):
        elapsed = 0.0
        for i in range(M):
            params = _model(d, 1.0 + 0.01 * (i + 1), block)  # the arriving result (deserialized by FLARE)
            with PeakAbove() as p:
                t0 = time.perf_counter()
                if i == 0:  # the round starts: the model sent (fastagg keeps the base and its params)
                    if method == "fastagg":
                        agg = agg or FastaggAggregator(rule="fedavg")
                        agg.reset_stats()
                        agg.set_model(FLModel(params_type=ParamsType.FULL, params=glob, current_round=rnd))
                    else:
                        helper = WeightedAggregationHelper()
                if method == "fastagg":
                    agg.accept_model(FLModel(params_type=ParamsType.FULL, params=params, current_round=rnd,
                                             meta={"client_name": f"site-{i}", "NUM_STEPS_CURRENT_ROUND": weights[i]}))
                else:
                    helper.add(data=params, weight=weights[i], contributor_name=f"site-{i}", contribution_round=rnd)
                elapsed += time.perf_counter() - t0
            if base_rss is None:
                base_rss = p.before  # the resident set with the global model and one arriving client
            peak = max(peak, p.before + p.bytes - base_rss)  # what the aggregation holds, at its highest
            del params
        with PeakAbove() as p:
            t0 = time.perf_counter()
            out = agg.aggregate_model().params if method == "fastagg" else helper.get_result()
            elapsed += time.perf_counter() - t0
        peak = max(peak, p.before + p.bytes - base_rss)
        times.append(elapsed)
        glob = out  # the next round's model
    check = float(np.asarray(out["layer0.weight"][:1000], dtype=np.float64).sum())
    return {"time_s": times[0], "later_s": statistics.median(times[1:]) if rounds > 1 else None, "peak_bytes": peak,
            "check": check}


def _flower(method: str, d: int) -> dict:
    import io

    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.server.strategy.aggregate import aggregate_inplace

    import fastagg
    from fastagg._memcheck import PeakAbove

    block = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    weights = [10 + 5 * i for i in range(M)]
    names = [f"layer{i}.weight" for i in range(LAYERS)]
    results = []
    for i in range(M):
        arrays = _model(d, 1.0 + 0.01 * (i + 1), block)
        params = ndarrays_to_parameters([arrays[k] for k in names])
        del arrays
        results.append((None, FitRes(Status(Code.OK, ""), params, weights[i], {})))
    with PeakAbove() as p:
        t0 = time.perf_counter()
        if method == "flower":
            out = aggregate_inplace(results)
        else:
            clients = []
            for _, fit in results:  # each serialized array's payload, viewed in place
                layers = []
                for b in fit.parameters.tensors:
                    f = io.BytesIO(b)
                    version = np.lib.format.read_magic(f)
                    shape, _, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                       else np.lib.format.read_array_header_2_0(f))
                    layers.append(np.frombuffer(b, dtype=dtype, count=int(np.prod(shape)), offset=f.tell()))
                clients.append(layers)
            res = fastagg.fedavg_step(clients, weights=weights)
            out = res.mean
        elapsed = time.perf_counter() - t0
    check = float(np.asarray(out[0][:1000], dtype=np.float64).sum())
    return {"time_s": elapsed, "peak_bytes": p.bytes, "check": check}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=["flare", "flower"], required=True)
    ap.add_argument("--dim", type=int, default=D)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.method:
        fn = _flare if a.side == "flare" else _flower
        print(json.dumps(fn(a.method, a.dim)))
        return
    theirs = "flare helper" if a.side == "flare" else "flower"
    # time: glibc as it comes (freed blocks reused, as in a server); memory: glibc told to unmap freed blocks at
    # once, so the resident set follows live memory (slower: every temporary is faulted in afresh)
    tracked = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": "0"}
    seen = {theirs: [], "fastagg": []}
    peaks = {theirs: [], "fastagg": []}
    for rep in range(a.reps + 1):
        for method in (theirs, "fastagg"):
            env = {**os.environ, **(tracked if rep == a.reps else {})}
            out = subprocess.run([sys.executable, __file__, "--side", a.side, "--dim", str(a.dim), "--method",
                                  method], env=env, capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            (peaks if rep == a.reps else seen)[method].append(res)
    model_gb = a.dim * 4 / 1e9
    print(f"{a.side} side: {M} clients x {a.dim:.0e} float32 params ({model_gb:.2f} GB model); time: {a.reps} "
          f"fresh processes per method, alternating; memory: one more each")
    for method, runs in seen.items():
        times = [r["time_s"] for r in runs]
        later = [r["later_s"] for r in runs if r.get("later_s") is not None]
        peak = peaks[method][0]["peak_bytes"] / 1e9
        print(f"  {method:13s} {statistics.median(times):7.2f} s (runs: {', '.join(f'{t:.2f}' for t in times)})"
              + (f", rounds 2-{ROUNDS}: {', '.join(f'{t:.2f}' for t in later)} s" if later else "")
              + f"; peak above the inputs {peak:.2f} GB = {peak / model_gb:.2f} x the model")
    ratio = [t["time_s"] / f["time_s"] for t, f in zip(seen[theirs], seen["fastagg"])]
    if a.side == "flare":
        later = [t["later_s"] / f["later_s"] for t, f in zip(seen[theirs], seen["fastagg"])]
        print(f"  {theirs} / fastagg time in rounds 2-{ROUNDS} (a server's steady state), per pair: "
              f"{', '.join(f'{r:.1f}x' for r in later)}")
    checks = {m: runs[0]["check"] for m, runs in seen.items()}
    print(f"  {theirs} / fastagg time, per pair: {', '.join(f'{r:.1f}x' for r in ratio)}; same first 1000 values "
          f"(sums): {checks}")


if __name__ == "__main__":
    main()
