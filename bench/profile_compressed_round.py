"""Where a FedExP round on compressed clients spends its time on a GPU (issues 25/26/48): per format, one warmed
round of M = 16 clients of d = 5e7 timed (median of 10, CUDA events) against the card's copy bandwidth on the
round's bytes (compressed bytes read + the mean's float32 write), its host synchronizations (torch's sync debug
mode) and kernel launches (profiler), then torch.profiler's tables of 5 rounds, by device and host time.

    PYTHONPATH=. python3 bench/profile_compressed_round.py [all|int8|fp8|codebook|topk ...]   (on the card)

Formats: int8 and fp8 block 256; codebook: FLARE's BLOCKWISE8 (block 4096, every client its own 256-entry book
tensor, as FLARE decodes them); topk: 1% of the entries, int32 indices.

Host reads and launches of one fedexp_step round before / after issue 48's batched checks (counted off the card:
the GPU's code path driven on CPU tensors through the Triton interpreter, host reads = .tolist / .item / bool / int /
float / D2H copies and syncing ops such as nonzero, launches = torch ops that launch a kernel + Triton launches):

    format      M    before: host reads / launches    after: host reads / launches
    int8     4, 16               4 / 56                          3 / 34
    fp8      4, 16               5 / 62                          3 / 34
    codebook    4               12 / 80                          4 / 43
    codebook   16               36 / 152                         4 / 43
    topk        4               14 / 68                          2 / 39
    topk       16               50 / 152                         2 / 51  (one sparse kernel a client)
    FedAvg.step, int8 16         6 / 112                         5 / 75  (the Accumulator's path; plus, on a
                                                                          GPU, 2 -> 1 host-to-device copies)

After: one scan of every client's scales / values / indices (one launch per kind of part) read once; the fold's
invalid-code verdict read once; the apply's finiteness read once (code books: one more read of the distinct books).
"""
from __future__ import annotations

import sys
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import fastagg
from fastagg.compress import Codebook8, quantize_fp8, quantize_int8, sparsify_topk

KINDS = ("int8", "fp8", "codebook", "topk")


def clients(kind: str, m: int, d: int) -> list:
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for _ in range(m):
        x = torch.randn(d, device="cuda", generator=g)
        if kind == "fp8":
            out.append(quantize_fp8(x, 256))
        elif kind == "topk":
            out.append(sparsify_topk(x, 0.01))
        elif kind == "codebook":
            book = torch.sort(torch.rand(256, device="cuda", generator=g) * 2 - 1).values
            u = quantize_int8(x, 4096)
            out.append(Codebook8(u.codes.view(torch.uint8), u.scales, 4096, code=book))
        else:
            out.append(quantize_int8(x, 256))
        del x
    return out


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(nbytes // 4, device="cuda")
    b = torch.empty_like(a)
    return 2 * nbytes / (_median_ms(lambda: b.copy_(a)) / 1e3)


def _median_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def syncs(fn) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main(kinds, m: int = 16, d: int = 50_000_000) -> None:
    bw = copy_bandwidth()
    print(f"copy: {bw / 1e9:.0f} GB/s (read + write); M = {m}, d = {d:.0e}")
    for kind in kinds:
        us = clients(kind, m, d)
        mean = torch.empty(d, device="cuda")

        def step():
            fastagg.fedexp_step(us, eps=1e-3, backend="triton", mean_out=mean)
        for _ in range(3):
            step()
        ms = _median_ms(step)
        nbytes = sum(u.nbytes for u in us) + 4 * d
        n_sync = syncs(step)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        ev = prof.key_averages()
        launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                         "cudaLaunchKernelExC")) / 5
        print(f"\n== {kind}: {ms:.3f} ms a round, {nbytes / 1e9:.3f} GB -> {nbytes / ms / 1e6:.0f} GB/s = "
              f"{nbytes / ms / 1e6 / (bw / 1e9):.2f} of copy; {n_sync} host syncs, {launches:.0f} launches a round")
        print(ev.table(sort_by="device_time_total", row_limit=14, max_name_column_width=60))
        print(ev.table(sort_by="cpu_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    args = sys.argv[1:] or ["all"]
    main(KINDS if args == ["all"] else args)
