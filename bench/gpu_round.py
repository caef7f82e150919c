"""GPU round throughput: fastagg's Triton path against torch and a device-to-device copy, same run, same card.

    python bench/gpu_round.py [--clients 16] [--params 100000000]

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


if __name__ == "__main__":
    main()
