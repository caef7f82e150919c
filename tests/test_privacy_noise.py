"""fastagg's counter-based Gaussian noise (fastagg.privacy.noise, csrc/noise.cpp, the Triton and reference
backends): Philox4x32-10 against Random123's known answers, the same words on every backend, the float32
Box-Muller of each backend against the reference's float64 transform, independence of the thread count and the
layout, and the distribution (mean, variance, Kolmogorov-Smirnov and Anderson-Darling on 10^7 samples, no
correlation between neighbouring coordinates or between rounds)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from fastagg.backends import reference
from fastagg.privacy import gaussian_noise
from fastagg.testing import cpu_backends, outputs_with_threads

# Random123's kat_vectors for philox4x32_10: (counter, key) -> output
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox_known_answers_cpu_and_reference(counter, key, want):
    from fastagg.backends import cpu

    assert tuple(cpu.philox4x32_10(counter, key)) == want
    got = reference.philox4x32_10(counter, key)
    assert tuple(int(w) for w in got) == want


def _words_to_normals(words):
    """The exact Box-Muller of Philox words (the definition in float64)."""
    out = []
    for a, b in ((words[0], words[1]), (words[2], words[3])):
        u1 = np.float32(a) * np.float32(2.0 ** -32) + np.float32(2.0 ** -33)
        u2 = np.float32(b) * np.float32(2.0 ** -32)
        r = math.sqrt(-2.0 * math.log(float(u1)))
        out += [r * math.cos(2 * math.pi * float(u2)), r * math.sin(2 * math.pi * float(u2))]
    return out


@pytest.mark.parametrize("backend", cpu_backends())
def test_noise_is_the_definition_at_any_offset(backend):
    from fastagg.backends import cpu

    seed, rnd = 0x1234_5678_9ABC_DEF0, (7 << 32) + 5  # both 32-bit halves of seed and round in play
    n = 4096 if backend == "triton" else 100_003
    for first in (0, 1, 3, 6, (1 << 34) + 2):  # unaligned starts; a block index past 2^32
        z = gaussian_noise(n, seed=seed, round=rnd, first=first, backend=backend)
        assert z.dtype == torch.float32 and z.shape == (n,)
        for j in (0, 1, 2, n // 2, n - 1):
            coord = first + j
            blk = coord // 4
            words = cpu.philox4x32_10((blk & 0xFFFFFFFF, blk >> 32, rnd & 0xFFFFFFFF, rnd >> 32),
                                      (seed & 0xFFFFFFFF, seed >> 32))
            want = _words_to_normals(words)[coord % 4]
            assert abs(float(z[j]) - want) < 1e-5 * (1 + abs(want)), (backend, first, j)


@pytest.mark.parametrize("backend", cpu_backends())
def test_every_backend_matches_the_reference_transform(backend):
    n = 8192 if backend == "triton" else 1_000_000
    ref = gaussian_noise(n, seed=99, round=3, first=11, backend="reference")
    got = gaussian_noise(n, seed=99, round=3, first=11, backend=backend)
    err = (got.double() - ref.double()).abs() / (1 + ref.double().abs())
    assert float(err.max()) < 1e-5
    assert float(ref.abs().max()) <= 6.77  # the transform's largest value (u1 >= 2^-33)


def test_cpu_noise_is_bit_identical_for_any_thread_count(tmp_path):
    script = ("import torch, sys\n"
              "from fastagg.privacy import gaussian_noise\n"
              "torch.save(gaussian_noise(3_000_017, seed=5, round=2, first=9, backend='cpu'), sys.argv[1])\n")
    outs = [outputs_with_threads(script, t, tmp_path / f"t{t}.pt") for t in (1, 2)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("backend", cpu_backends())
def test_noise_does_not_depend_on_the_split(backend):
    n = 4000 if backend == "triton" else 50_000
    whole = gaussian_noise(n, seed=3, round=1, backend=backend)
    cuts = [0, 1, 7, n // 2 + 3, n]
    parts = [gaussian_noise(b - a, seed=3, round=1, first=a, backend=backend) for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(parts), whole)


@pytest.mark.parametrize("backend", ["cpu"])
def test_distribution_of_ten_million_samples(backend):
    n = 10_000_000
    z = gaussian_noise(n, seed=20261127, round=0, backend=backend).double().numpy()
    se = 1 / math.sqrt(n)
    assert abs(z.mean()) < 5 * se
    assert abs(z.var() - 1) < 5 * math.sqrt(2 / n)
    assert abs(stats.skew(z)) < 5 * math.sqrt(6 / n)
    assert abs(stats.kurtosis(z)) < 5 * math.sqrt(24 / n)
    ks = stats.kstest(z, "norm")
    assert ks.pvalue > 1e-3, ks
    try:  # (scipy >= 1.17 asks for the p-value method; older ones have the critical-value tables only)
        ad = stats.anderson(z[:1_000_000], "norm", method="interpolate")
        assert ad.pvalue > 0.01, ad
    except TypeError:
        ad = stats.anderson(z[:1_000_000], "norm")
        assert ad.statistic < ad.critical_values[-1], ad  # below the 1% critical value
    # neighbours: lag 1, 2, 3 and 4 (lanes of one Philox block, and the next block)
    for lag in (1, 2, 3, 4):
        r = np.corrcoef(z[:-lag], z[lag:])[0, 1]
        assert abs(r) < 5 * se, (lag, r)
    # rounds: the same coordinates in the next round, and with the next seed
    z1 = gaussian_noise(n, seed=20261127, round=1, backend=backend).double().numpy()
    z2 = gaussian_noise(n, seed=20261128, round=0, backend=backend).double().numpy()
    assert abs(np.corrcoef(z, z1)[0, 1]) < 5 * se
    assert abs(np.corrcoef(z, z2)[0, 1]) < 5 * se
    # the tails: P(|z| > 4) = 6.3e-5 -> ~633 of 10^7
    tail = int((np.abs(z) > 4).sum())
    assert abs(tail - n * 2 * stats.norm.sf(4)) < 5 * math.sqrt(n * 2 * stats.norm.sf(4))


@pytest.mark.parametrize("backend", cpu_backends())
def test_noise_distribution_small_on_every_backend(backend):
    """2^16 samples of each backend here (Triton through the interpreter: the 10^7-sample test is the C++ one)."""
    z = gaussian_noise(1 << 16, seed=1, round=0, backend=backend).double().numpy()
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert abs(z.mean()) < 5 / 256 and abs(z.var() - 1) < 5 * math.sqrt(2 / (1 << 16))


@pytest.mark.parametrize("bad,match", [
    (dict(seed=-1), "seed"), (dict(seed=1 << 64), "seed"), (dict(seed=1.5), "seed"), (dict(seed=True), "seed"),
    (dict(seed=1, round=-1), "round"), (dict(seed=1, round=1 << 63), "round"), (dict(seed=1, first=-2), "first"),
])
def test_hostile_generator_arguments(bad, match):
    kw = {"round": 0, **bad}
    with pytest.raises(ValueError, match=match):
        gaussian_noise(10, **kw)


def test_cpu_binding_refuses_what_it_cannot_write():
    from fastagg.backends import cpu

    C = cpu.compiled()
    with pytest.raises(TypeError, match="float32"):
        C.gaussian_noise(torch.zeros(8, dtype=torch.float64).__dlpack__(), 1, 0, 0)
    with pytest.raises(ValueError, match="first"):
        C.gaussian_noise(torch.zeros(8).__dlpack__(), 1, 0, -1)
    with pytest.raises(ValueError):
        C.gaussian_noise(torch.zeros(8, 2)[:, 0].__dlpack__(), 1, 0, 0)  # strided: not one flat buffer
    with pytest.raises(ValueError, match="noise_sigma"):
        x = torch.randn(2, 8)
        C.round_stats(x.__dlpack__(), None, [8], torch.full((2,), 0.5, dtype=torch.float64).__dlpack__(), None, None,
                      0.0, torch.zeros(8).__dlpack__(), torch.zeros(2, dtype=torch.float64).__dlpack__(),
                      torch.zeros(2, dtype=torch.uint8).__dlpack__(), torch.zeros(1, dtype=torch.float64).__dlpack__(),
                      float("nan"), 0, 0)


@pytest.mark.parametrize("seed", [0, 2 ** 32 - 1, 2 ** 63, 2 ** 64 - 1])
@pytest.mark.parametrize("rnd", [0, 2 ** 32 + 3, 2 ** 63 - 1])
def test_extreme_seeds_and_rounds_agree_on_every_backend(seed, rnd):
    ref = gaussian_noise(999, seed=seed, round=rnd, first=2, backend="reference")
    for backend in cpu_backends():
        got = gaussian_noise(999, seed=seed, round=rnd, first=2, backend=backend)
        assert float((got - ref).abs().max()) < 1e-5, backend


def _triton_interpreted() -> bool:
    return "triton" in cpu_backends()


@pytest.mark.skipif(not _triton_interpreted(), reason="the Triton backend runs here only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("first", [0, 1, 2, 3, 4, 5, 6, 7, (1 << 34) + 1, (1 << 34) + 6])
def test_triton_shared_philox_noise_is_the_reference_at_every_offset(first):
    """The Triton generator computes one Philox call per four coordinates and one Box-Muller pair per two, the
    lanes interleaved back (noise.py): every start modulo 4, lengths not a multiple of 4 or of the block, a block
    index past 2^32. It must give the reference's normals, and exactly the per-element path's bits."""
    from fastagg.backends.triton import noise as tnoise

    seed, rnd = 0x1234_5678_9ABC_DEF0, (7 << 32) + 5
    for n in (1, 3, 6, 1021, 1024, 2051):
        ref = gaussian_noise(n, seed=seed, round=rnd, first=first, backend="reference")
        got = torch.full((n,), float("nan"))
        tnoise.gaussian_noise(out=got, seed=seed, round=rnd, first=first)
        err = (got.double() - ref.double()).abs() / (1 + ref.double().abs())
        assert float(err.max()) < 1e-5, (first, n, int(err.argmax()))
        per_element = torch.full((n,), float("nan"))
        tnoise.gaussian_noise(out=per_element, seed=seed, round=rnd, first=first, _paired=False)
        assert torch.equal(got, per_element), (first, n)


@pytest.mark.skipif(not _triton_interpreted(), reason="the Triton backend runs here only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("lens", [(5000,), (8, 4096, 12, 1500), (5, 1030, 3, 2100, 7), (1, 2, 4099)])
def test_triton_stats_pass_noise_at_every_segment_offset(lens):
    """The stats pass adds sigma times the noise of coordinate ``off + col`` as each block of the mean is written:
    blocks start at segment offsets of every residue modulo 4 (the shared path where the start is a multiple of
    4, known at compile time for one segment or chosen at run time, the per-element path elsewhere), segments
    shorter than a block and ending mid-block."""
    from fastagg.backends import resolve
    from fastagg.passes import run_stats
    from fastagg.rows import client_rows

    d, m = sum(lens), 3
    x = torch.randn(m, d, generator=torch.Generator().manual_seed(sum(lens)))
    rows = client_rows([list(r.split(list(lens))) for r in x] if len(lens) > 1 else x, name="deltas")
    coefs = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    sigma, seed, rnd = 0.75, 2 ** 64 - 5, (3 << 32) + 9
    got, sq, _, msq = run_stats(rows, coefs, resolve("triton", x.device), noise=(sigma, seed, rnd))
    want = (coefs[:, None] * x.double()).sum(0) + sigma * reference.gaussian(d, seed=seed, round=rnd).double()
    err = (got.double() - want).abs()
    assert float(err.max()) < 1e-5, int(err.argmax())
    assert float(msq) == pytest.approx(float(got.double() @ got.double()), rel=1e-6)
    torch.testing.assert_close(sq, x.double().pow(2).sum(1), rtol=1e-6, atol=0)
