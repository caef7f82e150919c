"""A peer on the same work: Flower's own simulation (``flwr.simulation.run_simulation``, Ray backend) against
``python -m fastagg.sim``, time per training round.

    python bench/bench_flower_sim.py [--rounds 6] [--clients 1000] [--models cnn,softmax]

The workload is pfl-research's CIFAR-10 benchmark shrunk to fit a 2-core CPU:
- data: ``cifar-synthetic`` (CIFAR-10-shaped 32x32x3 synthetic images, 50 per client as CIFAR-10's 50,000 over
  1000 clients), the same split for both (Flower's clients build it with the same function and seed);
- clients: 1000, 50 sampled per round (pfl-research's setting), FedAvg weighted by examples;
- local training: 5 steps of batch 10 (one local epoch of 50 images), SGD lr 0.05 (pfl's);
- model, shrunk: fastagg.sim's ``cnn`` on 3-channel input (conv 3x3 with 8 channels, ReLU, max-pool 2, linear;
  20,490 parameters) instead of pfl's CNN (conv 32, conv 64, dense 128; 1.63 M parameters), whose 250 local steps
  a round take seconds on two cores in any framework and would measure the convolutions, not the simulators.
- evaluation is not part of the compared round: fastagg.sim reports each round's training time in metrics.csv
  (``seconds``: local steps and server step) apart from the evaluation (``eval_seconds``; here only at round 0
  and the last, ``--eval-every``); Flower runs with no evaluation (``fraction_evaluate=0``, no evaluate_fn). Its
  round time is the time between consecutive ``aggregate_train`` calls (sampling, 50 ClientApp runs through
  Ray, aggregation). Rounds 2.. are the medians (round 1 includes Ray's and the clients' start-up).
A second model, ``softmax`` (one linear layer on the same images; Flower's clients train ``nn.Linear``), shows
the regime where the per-client overhead of a simulator, not the convolutions, sets the time.
Each contender runs in its own process, one after the other; the machine's load is printed. Flower's apps are in
``bench/flower_sim_app.py``.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def load() -> str:
    return open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"


def fastagg_per_round(clients: int, rounds: int, model: str) -> list:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "fastagg.sim", "--dataset", "cifar-synthetic", "--clients", str(clients),
                        "--model", model, "--algorithm", "fedavg", "--rounds", str(rounds), "--out", out,
                        "--overwrite"], check=True, capture_output=True, cwd=ROOT)
        rows = list(csv.DictReader(open(os.path.join(out, "metrics.csv"))))
        cfg = json.load(open(os.path.join(out, "config.json")))
    workload = (round(cfg["participation"] * clients), cfg["local_steps"], cfg["batch_size"], cfg["lr"])
    assert workload == (50, 5, 10, 0.05), workload
    return [float(r["seconds"]) for r in rows if r["round"] != "0"], [float(r["eval_seconds"]) for r in rows]


def flower_round_seconds(clients: int, rounds: int, model: str) -> list:
    # the apps live in an importable module so that Ray's workers import them (and keep the data set they build)
    # instead of receiving pickled copies of the functions
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "bench"), os.environ.get("PYTHONPATH", "")])}
    env.update(FLOWER_SIM_CLIENTS=str(clients), FLOWER_SIM_MODEL=model)
    res = subprocess.run([sys.executable, "-c", f"import flower_sim_app; flower_sim_app.main({rounds})"],
                         capture_output=True, text=True, env=env, timeout=1800)
    line = next((x for x in res.stdout.splitlines() if x.startswith("ROUND_SECONDS ")), None)
    if line is None:
        raise RuntimeError(f"Flower's simulation gave no round times:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return json.loads(line.split(" ", 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--models", default="cnn,softmax", help="cnn (the workload) and softmax (one linear layer: "
                    "where per-client overhead, not convolutions, sets the time)")
    a = ap.parse_args()
    import flwr
    import torch

    print(f"torch {torch.__version__}, flwr {flwr.__version__}, {os.cpu_count()} cores; load before: {load()}")
    for model in a.models.split(","):
        train, evals = fastagg_per_round(a.clients, a.rounds, model)
        print(f"[{model}] fastagg.sim training s/round: {', '.join(f'{t:.3f}' for t in train)}; evaluation s: "
              f"{', '.join(f'{t:.2f}' for t in evals)} (load {load()})", flush=True)
        flower = flower_round_seconds(a.clients, a.rounds, model)
        print(f"[{model}] Flower simulation s/round: {', '.join(f'{t:.3f}' for t in flower)} (load {load()})")
        ours, theirs = statistics.median(train[1:]), statistics.median(flower[1:])
        print(f"[{model}] medians of rounds 2..{a.rounds}: fastagg.sim {ours * 1e3:.1f} ms, Flower {theirs * 1e3:.1f} "
              f"ms: fastagg.sim {theirs / ours:.1f}x less time per round", flush=True)


if __name__ == "__main__":
    main()
