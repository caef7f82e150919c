"""The batched FedSPS client step under Nsight Compute (issue 26): does the grouped schedule's second read of a
row's gradient hit L2? Run on a card as

    ncu --metrics lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        -k regex:"_grouped_kernel|_chunk_" python3 bench/ncu_client_step.py

It launches each schedule twice (the first compiles) at M = 1000, d = 1e5 fp32: 400 MB of x and of g. A step
that reads g once from memory reads 800 MB from DRAM and writes 400 MB; `chunks` reads g twice (1.2 GB)."""
from __future__ import annotations

import importlib
import sys

import torch

from fastagg import client


def main(m: int = 1000, d: int = 100_000) -> None:
    local = importlib.import_module("fastagg.backends.triton.local_step")
    chosen = local.local_config
    x = torch.randn(m, d, device="cuda")
    g = 1e-3 * torch.randn(m, d, device="cuda")
    f = 1.0 + torch.rand(m, device="cuda", dtype=torch.float64)
    for schedule, rows in (("grouped", max(1, (8 << 20) // (4 * d))), ("grouped", max(1, (4 << 20) // (4 * d))),
                           ("chunks", None)):
        local.local_config = lambda M, n, s=schedule, r=rows: dict(schedule=s, BLOCK=4096, CHUNK=16384,
                                                                   GROUP_ROWS=r, num_warps=8)
        for _ in range(2):
            client.sps_step(params=x, grads=g, losses=f, gamma_b=1e-3)
        torch.cuda.synchronize()
        print(f"ran {schedule} group_rows={rows}", flush=True)
    local.local_config = chosen


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
