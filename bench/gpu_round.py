"""GPU throughput: fastagg's Triton paths against torch and a device-to-device copy, same run, same card.

    python bench/gpu_round.py [--clients 16] [--params 100000000]

Part 1: a FedExP round over M x d client updates. Part 2: a batched FedSPS client step at a few [M, d] shapes,
against `X.add_(G)` (the step's unavoidable bytes), the best batched torch, and fastagg's Triton kernel forced to
one program per row (local_config's other choice) to check where splitting rows into chunks pays.

Times with triton.testing.do_bench (CUDA events, L2 flushed between reps); buffers far above L2. Prints the
card's name next to every number; paste the table into bench/RESULTS.md.
"""
from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--params", type=int, default=100_000_000)
    args = ap.parse_args()
    import triton.testing

    import fastagg

    assert torch.cuda.is_available(), "needs a CUDA GPU"
    card = torch.cuda.get_device_name(0)
    m, d = args.clients, args.params
    x = torch.randn(m, d, device="cuda")
    p = torch.full((m,), 1.0 / m, device="cuda")
    mean = torch.empty(d, device="cuda")
    params, eval_out = torch.zeros(d, device="cuda"), torch.empty(d, device="cuda")
    copy_dst = torch.empty_like(x)
    nbytes = x.numel() * 4
    rows = {
        "d2d copy (read+write M*d)": (lambda: copy_dst.copy_(x), 2 * nbytes),
        "plain read x.sum()": (lambda: x.sum(), nbytes),
        "fastagg triton stats": (lambda: fastagg.fedexp_step(x, eps=1e-3, mean_out=mean, on_nonfinite="skip"), nbytes),
        "fastagg triton + params + eval": (lambda: fastagg.fedexp_step(x, eps=1e-3, params=params, mean_out=mean,
                                                                       eval_out=eval_out, on_nonfinite="skip"),
                                           nbytes + 3 * d * 4),
        "torch mv + vector_norm": (lambda: (torch.mv(x.t(), p, out=mean), torch.linalg.vector_norm(x, dim=1)), nbytes),
    }
    print(f"card: {card}; M={m}, d={d:,} fp32 ({nbytes / 1e9:.2f} GB); torch {torch.__version__}, "
          f"triton {triton.__version__}")
    copy_bw = None
    for name, (fn, b) in rows.items():
        ms = triton.testing.do_bench(fn, warmup=5, rep=50)
        bw = b / ms / 1e6
        copy_bw = copy_bw or bw
        print(f"{name:<34}{ms:>9.3f} ms{bw:>9.0f} GB/s{bw / copy_bw:>8.2f} x copy BW")


def client_steps(shapes=((100, 1_000_000), (100, 100_000), (1000, 10_000), (10, 10_000_000)), device="cuda") -> None:
    import triton.testing

    import importlib

    from fastagg import client

    # the package re-exports the launcher under the module's name: fetch the module itself
    triton_local = importlib.import_module("fastagg.backends.triton.local_step")

    card = torch.cuda.get_device_name(0) if device == "cuda" else device
    print(f"\nbatched FedSPS client step, fp32, card: {card}")
    chosen = triton_local.local_config

    def one_program_per_row(m, d):
        return {**chosen(m, d), "CHUNK": None}

    for m, d in shapes:
        x, g = torch.randn(m, d, device=device), 1e-3 * torch.randn(m, d, device=device)
        f = 1.0 + torch.rand(m, device=device, dtype=torch.float64)
        nbytes = 3 * x.numel() * 4

        def sps():
            client.sps_step(params=x, grads=g, losses=f, gamma_b=1e-3, backend="triton")

        def sps_unsplit():
            triton_local.local_config = one_program_per_row
            try:
                sps()
            finally:
                triton_local.local_config = chosen

        def torch_batched():
            sq = torch.linalg.vector_norm(g, dim=1).double().square()
            gamma = torch.clamp(f / (0.5 * sq), max=1e-3)
            x.addcmul_(gamma.to(x.dtype)[:, None], g, value=-1.0)

        rows = {"X.add_(G)": lambda: x.add_(g, alpha=1e-9), "fastagg sps (chosen)": sps,
                "fastagg sps (one program per row)": sps_unsplit, "torch batched sps": torch_batched}
        base = None
        print(f"M={m} d={d:,} (split into chunks: {chosen(m, d)['CHUNK'] is not None})")
        for name, fn in rows.items():
            ms = triton.testing.do_bench(fn, warmup=5, rep=50)
            base = base or ms
            print(f"  {name:<36}{ms:>9.3f} ms{nbytes / ms / 1e6:>9.0f} GB/s{ms / base:>8.2f} x add_")


if __name__ == "__main__":
    main()
    client_steps()
