"""The simulator end to end against a per-client torch loop, per data set and model, quiet and beside one
CPU-bound process.

    python bench/bench_sim_e2e.py [--rounds 20]

For each setting, ``fastagg.sim``'s ``run_one`` (FedAvg, the data set's paper defaults for clients per round, local
steps, batch size and lr; metrics every round, as the CLI records them) against what per-client simulators do: for
every sampled client an ``nn.Module`` with autograd and ``torch.optim.SGD`` over the same number of steps and
batch size, then the examples-weighted average (the training loss, and test metrics where the data set has a test
set, measured every round as well). Times per round are medians; "loaded" repeats the fastagg run with a
busy-loop process beside it. Where few clients train per round (digits: 5) the evaluation of the global model,
the same work in both, bounds the speed-up.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from fastagg.sim import data as datasets, runner

SETTINGS = [  # (data set, model, overrides)
    ("fedexp-linreg", "linear", {}),
    ("synthetic", "softmax", {}),
    ("digits", "mlp", {}),
    ("digits", "cnn", {}),
]


def _module(model_name: str, data) -> torch.nn.Module:
    f, c = data.num_features, max(data.num_classes, 1)
    if model_name == "linear":
        return torch.nn.Linear(f, 1, bias=False)
    if model_name == "softmax":
        return torch.nn.Linear(f, c)
    if model_name == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(f, 64), torch.nn.ReLU(), torch.nn.Linear(64, c))
    side = int(round(f ** 0.5))
    return torch.nn.Sequential(torch.nn.Unflatten(1, (1, side, side)), torch.nn.Conv2d(1, 8, 3, padding=1),
                               torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                               torch.nn.Linear(8 * (side // 2) ** 2, c))


def per_client_loop(cfg, data, rounds: int) -> float:
    """Seconds per round of the per-client torch loop (same participation, steps, batch size, lr)."""
    dtype = getattr(torch, cfg.dtype)
    data = data.to("cpu", dtype)
    global_model = _module(cfg.model, data).to(dtype)
    n = data.num_clients
    m = max(1, int(round(cfg.participation * n)))
    gen = torch.Generator().manual_seed(0)
    least_squares = data.task == "least_squares"
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ids = torch.sort(torch.randperm(n, generator=gen)[:m]).values
        states, weights = [], []
        for i in ids.tolist():
            local = _module(cfg.model, data).to(dtype)
            local.load_state_dict(global_model.state_dict())
            opt = torch.optim.SGD(local.parameters(), lr=cfg.lr)
            count = int(data.counts[i])
            for _ in range(cfg.local_steps):
                if cfg.batch_size:
                    idx = torch.randint(0, count, (cfg.batch_size,), generator=gen)
                else:
                    idx = torch.arange(count)
                xb, yb = data.x[i, idx], data.y[i, idx]
                opt.zero_grad()
                out = local(xb)
                loss = 0.5 * (out[:, 0] - yb).square().sum() if least_squares else \
                    torch.nn.functional.cross_entropy(out, yb)
                loss.backward()
                opt.step()
            states.append(local.state_dict())
            weights.append(float(count))
        total = sum(weights)
        avg = {k: sum(w / total * s[k] for w, s in zip(weights, states)) for k in states[0]}
        global_model.load_state_dict(avg)
        with torch.no_grad():  # the training loss (and test metrics) every round, as the simulator records them
            x_all, y_all = data.samples()
            out = global_model(x_all)
            _ = (out[:, 0] - y_all).square().sum() if least_squares else torch.nn.functional.cross_entropy(out, y_all)
            if data.test_x is not None:
                out = global_model(data.test_x)
                _ = torch.nn.functional.cross_entropy(out, data.test_y), (out.argmax(1) == data.test_y).float().mean()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def fastagg_round(cfg, data, rounds: int) -> float:
    times = []
    last = [time.perf_counter()]

    def progress(*_):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    last[0] = time.perf_counter()
    runner.run_one(cfg, data, "fedavg", 0, progress=progress)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=20)
    a = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per round (medians of {a.rounds})")
    print(f"{'data set / model':<24}{'clients/round':>14}{'fastagg':>10}{'loaded':>10}{'torch loop':>12}"
          f"{'speed-up':>10}{'loaded/quiet':>14}")
    for name, model_name, over in SETTINGS:
        data = datasets.load(name)
        cfg = runner.Config(dataset=name, model=model_name, algorithms=("fedavg",), rounds=a.rounds, **over)
        cfg = cfg.resolved(data)
        quiet = fastagg_round(cfg, data, a.rounds)
        loop = per_client_loop(cfg, data, max(3, a.rounds // 4))
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.3)
            loaded = fastagg_round(cfg, data, a.rounds)
        finally:
            hog.kill()
            hog.wait()
        m = max(1, int(round(cfg.participation * data.num_clients)))
        print(f"{name + ' / ' + model_name:<24}{m:>14}{quiet * 1e3:>10.2f}{loaded * 1e3:>10.2f}{loop * 1e3:>12.1f}"
              f"{loop / quiet:>9.0f}x{loaded / quiet:>13.2f}x")


if __name__ == "__main__":
    main()
