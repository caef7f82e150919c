"""Compressed clients folded where they lie, against the same work on float32 clients and against one plain read
of the compressed bytes, M = 16 clients, d = 10^7 (FASTAGG_BENCH_D), block 256, CPU backend, the calls interleaved
in a fresh random order every round (medians of 9 rounds).

    python bench/bench_compress.py [--cold]

``--cold``: a buffer of twice the last-level cache written before every call (untimed), so each call reads its
inputs from memory (the 300 MiB L3 this VM reports otherwise keeps part of a 160 MB input between calls).

- ``read int8``: the clients' int8 bytes read once (viewed as float32 and summed: a plain read of the same bytes)
- ``write mean``: the 40 MB float32 mean written once (``zero_``): with ``read int8``, the bytes the int8 round must
  move at least (it reads every code and writes the mean)
- ``fedexp int8`` / ``fedexp fp32``: the functional FedExP round ``fastagg.fedexp_step(clients, eps)`` (one sweep
  over the clients writing the mean, then the rule; no params) on the int8 clients or on the float32 ones
- ``fold int8`` / ``fold fp32``: ``Accumulator.add_many`` of the 16 clients into an empty accumulator (reads the
  clients and the sum once, writes the sum once)
- ``fedexp fp8``: the round on fp8 e4m3 clients (one byte a code read through the e4m3 table)
- ``read top-k`` / ``fedexp top-k`` / ``fold top-k``: top-1% sparse clients (int32 indices, float32 values): their
  bytes read once; the round (zeroes the mean, scatter-adds every client, then ||mean||^2: two d-vector passes);
  the fold (the accumulator's sum copied into its spare, then scatter-added)
"""
from __future__ import annotations

import argparse
import os

import torch

from baselines import cache_evictor, interleaved_medians
import fastagg
from fastagg.compress import quantize_fp8, quantize_int8, sparsify_topk

D = int(float(os.environ.get("FASTAGG_BENCH_D", "1e7")))
M = 16
BLOCK = 256


def main(rounds: int = 9, cold: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    floats = [torch.randn(D, generator=g) for _ in range(M)]
    ints = [quantize_int8(x, BLOCK) for x in floats]
    raw = torch.stack([u.codes for u in ints])  # the same bytes, to read plainly
    raw_f32 = raw.view(-1)[: (raw.numel() // 4) * 4].view(torch.float32)
    fp8s = [quantize_fp8(x, BLOCK) for x in floats]
    sparse = [sparsify_topk(x, 0.01) for x in floats]
    sparse_raw = torch.cat([torch.cat([u.indices.view(torch.float32), u.values]) for u in sparse])
    acc_s = fastagg.Accumulator(like=torch.zeros(D), backend="cpu")
    acc8 = fastagg.Accumulator(like=torch.zeros(D), backend="cpu")
    acc32 = fastagg.Accumulator(like=torch.zeros(D), backend="cpu")
    mean = torch.empty(D)

    def fold(acc, clients):
        acc.reset()
        acc.add_many(clients)

    calls = {"read int8": raw_f32.sum, "write mean": mean.zero_,
             "fedexp int8": lambda: fastagg.fedexp_step(ints, eps=1e-3, backend="cpu", mean_out=mean),
             "fedexp fp32": lambda: fastagg.fedexp_step(floats, eps=1e-3, backend="cpu", mean_out=mean),
             "fold int8": lambda: fold(acc8, ints), "fold fp32": lambda: fold(acc32, floats),
             "fedexp fp8": lambda: fastagg.fedexp_step(fp8s, eps=1e-3, backend="cpu", mean_out=mean),
             "read top-k": sparse_raw.sum,
             "fedexp top-k": lambda: fastagg.fedexp_step(sparse, eps=1e-3, backend="cpu", mean_out=mean),
             "fold top-k": lambda: fold(acc_s, sparse)}
    med = interleaved_medians(calls, rounds, before=cache_evictor() if cold else None)
    int8_bytes = sum(u.nbytes for u in ints)
    print(f"M = {M}, d = {D}, block {BLOCK}, torch {torch.__version__}, {os.cpu_count()} cores, medians of {rounds}, "
          f"{'caches evicted before every call' if cold else 'caches as the previous call left them'}")
    for k, t in med.items():
        print(f"  {k:12s} {t * 1e3:8.2f} ms   {int8_bytes / t / 1e9:6.2f} GB/s of int8 bytes")
    print(f"  fedexp int8 / read int8   {med['fedexp int8'] / med['read int8']:.2f}x   "
          f"(read int8 + write mean) / read int8 {(med['read int8'] + med['write mean']) / med['read int8']:.2f}x, "
          f"fedexp int8 / (read int8 + write mean) {med['fedexp int8'] / (med['read int8'] + med['write mean']):.2f}x")
    print(f"  fedexp fp32 / fedexp int8 {med['fedexp fp32'] / med['fedexp int8']:.2f}x")
    print(f"  fold fp32 / fold int8     {med['fold fp32'] / med['fold int8']:.2f}x")
    print(f"  fedexp fp32 / fedexp fp8  {med['fedexp fp32'] / med['fedexp fp8']:.2f}x")
    sparse_bytes = sum(u.nbytes for u in sparse)
    print(f"  top-k bytes {sparse_bytes / 1e6:.1f} MB: fedexp top-k / read top-k {med['fedexp top-k'] / med['read top-k']:.1f}x, "
          f"fold top-k / read top-k {med['fold top-k'] / med['read top-k']:.1f}x, "
          f"fedexp fp32 / fedexp top-k {med['fedexp fp32'] / med['fedexp top-k']:.1f}x, "
          f"(read top-k + write mean) / read top-k {(med['read top-k'] + med['write mean']) / med['read top-k']:.1f}x")
    return med


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="evict the caches before every call (untimed)")
    main(cold=parser.parse_args().cold)
