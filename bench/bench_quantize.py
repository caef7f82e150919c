"""Client-side quantizers over a batch of rows, the fused C++ kernels (csrc/quantized.h) against the torch-op
definitions they equal bit for bit: M = 16 rows of d = 10^6 float32 (FASTAGG_BENCH_D), block 256, the calls
interleaved in a fresh random order every round (medians of 7).

    python bench/bench_quantize.py

- ``int8`` / ``int8 stochastic``: ``quantize_int8_rows`` (round half to even / Philox-keyed stochastic rounding)
- ``fp8``: ``quantize_fp8_rows`` (scale absmax / 448, float32 then e4m3, round to nearest even)
GB/s are of the rows read (M * d * 4 bytes).
"""
from __future__ import annotations

import os

import torch

from baselines import interleaved_medians

from fastagg.compress import fp8, int8

D = int(float(os.environ.get("FASTAGG_BENCH_D", "1e6")))
M = 16
BLOCK = 256


def main(rounds: int = 7) -> dict:
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(0))
    ids = list(range(M))
    calls = {
        "int8 fused": lambda: int8.quantize_int8_rows(x, BLOCK),
        "int8 torch": lambda: int8._torch_rows(x, BLOCK, False, 0, 0, ids),
        "int8 stochastic fused": lambda: int8.quantize_int8_rows(x, BLOCK, stochastic=True, seed=1, round=2),
        "int8 stochastic torch": lambda: int8._torch_rows(x, BLOCK, True, 1, 2, ids),
        "fp8 fused": lambda: fp8.quantize_fp8_rows(x, BLOCK),
        "fp8 torch": lambda: fp8._torch_rows(x, BLOCK),
    }
    med = interleaved_medians(calls, rounds)
    print(f"M = {M}, d = {D}, block {BLOCK}, torch {torch.__version__}, {os.cpu_count()} cores, medians of {rounds}")
    for k, t in med.items():
        print(f"  {k:22s} {t * 1e3:8.2f} ms   {M * D * 4 / t / 1e9:6.2f} GB/s of rows")
    for name in ("int8", "int8 stochastic", "fp8"):
        print(f"  {name}: torch / fused {med[name + ' torch'] / med[name + ' fused']:.1f}x")
    return med


if __name__ == "__main__":
    main()
