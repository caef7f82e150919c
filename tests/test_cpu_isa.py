"""The two builds of the compiled CPU kernels (portable ``_C`` and ``_C_avx2``) compute the same numbers, and the
portable one can be forced with FASTAGG_CPU_ISA=default."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

import fastagg
from fastagg import client
from fastagg.backends import cpu
from fastagg.testing import assert_close, assert_round_close

X86 = platform.machine().lower() in ("x86_64", "amd64")


def _run_everything():
    g = torch.Generator().manual_seed(0)
    deltas = torch.randn(7, 30_001, generator=g)
    res = fastagg.fedexp_step(deltas, eps=1e-3, backend="cpu")
    x = torch.randn(5, 20_000, generator=g)
    gamma = client.sps_step(params=x, grads=torch.randn(5, 20_000, generator=g),
                            losses=torch.rand(5, generator=g, dtype=torch.float64) + 1, backend="cpu")
    return res, x, gamma


@pytest.mark.skipif(not X86, reason="the AVX2 build exists on x86-64 only")
def test_portable_and_avx2_builds_agree(monkeypatch):
    both = []
    for name in ("_C", "_C_avx2"):
        monkeypatch.setattr(cpu, "_C", cpu.load(name))
        both.append(_run_everything())
    (r0, x0, g0), (r1, x1, g1) = both
    assert_round_close(r1, r0, torch.float32)  # FMA contraction changes the last bits, not more
    assert_close(x1, x0, rtol=1e-6, atol=1e-7, name="params after sps")
    assert_close(g1, g0, rtol=1e-6, atol=0, name="gamma")


@pytest.mark.skipif(not X86, reason="the AVX2 build exists on x86-64 only")
@pytest.mark.parametrize("m", [5, 16, 33])
def test_portable_and_avx2_builds_select_the_same_coordinates(monkeypatch, m):
    """The robust rules' sorting networks (one vector register of lanes: 128-bit SSE2 min/max on the portable build,
    256-bit AVX on the other; m = 33 takes the run-time network) select the same values: the coordinate median,
    trimmed mean and MeaMed (the values nearest the median) of both builds are equal bit for bit, float32 and float64."""
    from fastagg import robust

    out = []
    for name in ("_C", "_C_avx2"):
        monkeypatch.setattr(cpu, "_C", cpu.load(name))
        g = torch.Generator().manual_seed(m)
        got = []
        for dtype in (torch.float32, torch.float64):
            x = torch.randn(m, 4099, generator=g, dtype=dtype).round(decimals=1)  # ties and equal values
            for rule in (robust.Median(), robust.TrimmedMean(beta=0.2), robust.MeaMed(num_malicious=1)):
                got.append(robust.aggregate(x, rule, backend="cpu").estimate)
        out.append(got)
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_isa_choice_follows_the_cpu_and_can_be_forced():
    out = subprocess.run([sys.executable, "-c", "from fastagg.backends import cpu; print(cpu._C.__name__)"],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, cpu.ISA_ENV: "default"})
    assert out.stdout.strip() == "fastagg._C"
    expected = "fastagg._C_avx2" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "fastagg._C"
    assert cpu._C.__name__ == expected or os.environ.get(cpu.ISA_ENV, "").lower() == "default"


@pytest.mark.skipif(not X86, reason="the AVX2 build exists on x86-64 only")
@pytest.mark.parametrize("block", [64, 192, 100])
def test_portable_and_avx2_builds_agree_on_compressed_clients(monkeypatch, block):
    """The portable loops (multi-block int8 tiles, the e4m3 and code-book sweeps, the sparse fold, the fused int8
    and fp8 quantizers) against the AVX2 ones: the same codes bit for bit, norms to the last bit, sums to float32
    rounding."""
    from fastagg.compress import fp8, int8, sparsify_topk
    from fastagg.compress.codebook import Codebook8

    g = torch.Generator().manual_seed(block)
    d = 70_000 + 37
    x = torch.randn(6, d, generator=g) * torch.logspace(-3, 2, d)
    out = []
    for name in ("_C", "_C_avx2"):
        monkeypatch.setattr(cpu, "_C", cpu.load(name))
        i8 = int8.quantize_int8_rows(x, block)
        i8s = int8.quantize_int8_rows(x, block, stochastic=True, seed=3, round=1)
        f8 = fp8.quantize_fp8_rows(x, block)
        book = torch.linspace(-1, 1, 256)
        cb = [Codebook8(u.codes.view(torch.uint8), u.scales, block, book) for u in i8]
        sp = [sparsify_topk(r, 0.05) for r in x]
        res = []
        for clients in (i8, f8, cb, sp):
            acc = fastagg.Accumulator(like=torch.zeros(d), backend="cpu")
            acc.add_many(clients, [1.0 + j for j in range(6)])
            res.append((acc.weighted_sum.clone(), acc.sq_norms.clone()))
        # the code-book fold without the clients' squares (client_norms=False): the same sum, bit for bit
        bare = fastagg.Accumulator(like=torch.zeros(d), backend="cpu", client_norms=False)
        bare.add_many(cb, [1.0 + j for j in range(6)])
        assert torch.equal(bare.weighted_sum, res[2][0]), name
        out.append(([u.codes for u in i8 + i8s], [u.codes.view(torch.uint8) for u in f8],
                     [u.scales for u in i8 + f8], res))
    (c0, f0, s0, r0), (c1, f1, s1, r1) = out
    assert all(torch.equal(a, b) for a, b in zip(c0, c1)) and all(torch.equal(a, b) for a, b in zip(f0, f1))
    assert all(torch.equal(a, b) for a, b in zip(s0, s1))
    for k, ((sum0, sq0), (sum1, sq1)) in enumerate(zip(r0, r1)):
        assert_close(sum1, sum0, rtol=1e-6, atol=1e-6 * float(sum0.abs().max()), name=f"sum {k}")
        assert_close(sq1, sq0, rtol=1e-14, atol=0, name=f"norms {k}")  # (FMA contraction: the last bit)
