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


def test_isa_choice_follows_the_cpu_and_can_be_forced():
    out = subprocess.run([sys.executable, "-c", "from fastagg.backends import cpu; print(cpu._C.__name__)"],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, cpu.ISA_ENV: "default"})
    assert out.stdout.strip() == "fastagg._C"
    expected = "fastagg._C_avx2" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "fastagg._C"
    assert cpu._C.__name__ == expected or os.environ.get(cpu.ISA_ENV, "").lower() == "default"
