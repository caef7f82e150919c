"""``python -m fastagg.demo``: aggregate one synthetic FedExP round on every backend that can run here and print
the statistics and the time per backend (the README's "run" command until the simulator lands)."""
from __future__ import annotations

import argparse
import time

import torch

import fastagg
from fastagg.backends import available


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--params", type=int, default=4_000_000, help="d, the model size")
    ap.add_argument("--eps", type=float, default=1e-3)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    print(fastagg.env_report(), "\n")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    m, d = args.clients, args.params
    # clients share a drift direction plus their own noise, like heterogeneous local updates
    drift = torch.randn(d, generator=g, device=device)
    deltas = 0.3 * drift + torch.randn(m, d, generator=g, device=device)
    weights = torch.arange(1, m + 1, dtype=torch.float64).tolist()
    gbytes = deltas.numel() * deltas.element_size() / 1e9
    print(f"round: M={m} clients, d={d:,} float32 parameters ({gbytes:.2f} GB of updates), eps={args.eps}, "
          f"weights 1..{m}\n")
    print(f"{'backend':<12}{'eta':>10}{'||mean||^2':>14}{'mean ||d_i||^2':>16}{'time/round':>14}{'GB/s':>9}")
    for backend in available(device):
        if backend == "triton" and device == "cpu":
            print(f"{backend:<12}skipped: the Triton interpreter is a correctness tool (minutes at this size)")
            continue
        params = torch.zeros(d, device=device)
        fastagg.fedexp_step(deltas, eps=args.eps, weights=weights, params=params, backend=backend)  # warm-up
        times = []
        for _ in range(args.repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = fastagg.fedexp_step(deltas, eps=args.eps, weights=weights, params=params, backend=backend)
            float(res.eta)
            times.append(time.perf_counter() - t0)
        t = sorted(times)[len(times) // 2]
        print(f"{backend:<12}{float(res.eta):>10.4f}{float(res.mean_sq_norm):>14.1f}{float(res.avg_sq_norm):>16.1f}"
              f"{t * 1e3:>11.1f} ms{gbytes / t:>9.1f}")
    print("\nSame round, streamed one client at a time (O(d) server memory):")
    acc = fastagg.Accumulator(like=deltas[0])
    t0 = time.perf_counter()
    for delta, n in zip(deltas, weights):
        acc.add(delta, weight=n)
    res = acc.fedexp_step(eps=args.eps)
    print(f"{'accumulator':<12}{float(res.eta):>10.4f}{float(res.mean_sq_norm):>14.1f}{float(res.avg_sq_norm):>16.1f}"
          f"{(time.perf_counter() - t0) * 1e3:>11.1f} ms")


if __name__ == "__main__":
    main()
