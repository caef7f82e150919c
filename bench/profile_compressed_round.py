"""Where a FedExP round on compressed clients spends its time on a GPU (issue 25/26): torch.profiler's table of
one warmed round of M = 16 int8 clients of d = 5e7 (block 256), kernels and host calls, sorted by device time.

    PYTHONPATH=. python3 bench/profile_compressed_round.py [int8|fp8|codebook]    (on the card, from the repo root)"""
from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import fastagg
from fastagg.compress import Codebook8, quantize_fp8, quantize_int8


def main(kind: str = "int8", m: int = 16, d: int = 50_000_000) -> None:
    xs = [torch.randn(d, device="cuda") for _ in range(m)]
    if kind == "fp8":
        us = [quantize_fp8(x, 256) for x in xs]
    else:
        us = [quantize_int8(x, 256) for x in xs]
        if kind == "codebook":
            book = torch.sort(torch.rand(256, device="cuda") * 2 - 1).values
            us = [Codebook8(u.codes.view(torch.uint8), u.scales, 256, code=book) for u in us]
    del xs
    mean = torch.empty(d, device="cuda")
    for _ in range(3):
        fastagg.fedexp_step(us, eps=1e-3, backend="triton", mean_out=mean)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fastagg.fedexp_step(us, eps=1e-3, backend="triton", mean_out=mean)
        torch.cuda.synchronize()
    print(f"{kind}: 5 rounds of {m} clients x {d:.0e}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main(*sys.argv[1:2])
