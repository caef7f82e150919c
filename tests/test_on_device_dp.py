"""fastagg.privacy's Triton paths on the device they are for, against the float64 reference (issue 48).

The generator computes one Philox4x32-10 call per four coordinates and one Box-Muller pair per two
(fastagg/backends/triton/noise.py): its normals at every start modulo 4 and at lengths that are not a multiple of 4
or of a block, against the reference's float64 transform of the same Philox words and the per-element path; the
stats pass writing sigma times that noise into the mean over segments at offsets of every residue modulo 4 (the
shared path chosen at compile time or per block, the per-element one elsewhere), for fp32 / bf16 / fp64 rows; the
server- and client-side releases (with a non-finite client: the server-side sum launched before the host read is
redone without it) against the reference backend's. Without CUDA the root conftest sets TRITON_INTERPRET=1 and the
same checks run through the interpreter at smaller sizes.
"""
from __future__ import annotations

import pytest
import torch

from fastagg import privacy
from fastagg.backends import reference, resolve
from fastagg.passes import run_stats
from fastagg.rows import client_rows
from fastagg.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("first", [0, 1, 2, 3, 4, 5, 6, 7, (1 << 34) + 3])
def test_noise_at_every_start_on_device(first):
    from fastagg.backends.triton import noise as tnoise

    seed, rnd = 0xFEDC_BA98_7654_3210, (11 << 32) + 2
    for n in ((1, 3, 1021, 4096, 1_000_003) if ON_GPU else (1, 3, 1021, 4099)):
        ref = reference.gaussian(n, seed=seed, round=rnd, first=first).double()
        got = torch.full((n,), float("nan"), device=DEVICE)
        tnoise.gaussian_noise(out=got, seed=seed, round=rnd, first=first)
        err = (got.cpu().double() - ref).abs() / (1 + ref.abs())
        assert float(err.max()) < 1e-5, (first, n, int(err.argmax()))
        per_element = torch.full((n,), float("nan"), device=DEVICE)
        tnoise.gaussian_noise(out=per_element, seed=seed, round=rnd, first=first, _paired=False)
        assert float((per_element - got).abs().max()) <= 1e-6, (first, n)


# segment lengths: one segment (offsets known aligned at compile time), offsets at every residue modulo 4 with
# segments shorter and longer than a block, a layout whose offsets are multiples of 4 but not known to be
LAYOUTS = [(300_001,), (5, 70_001, 3, 2, 150_006, 7), (4, 8, 100_000, 12, 60_000)] if ON_GPU else \
    [(5001,), (5, 1030, 3, 2, 2100, 7), (4, 8, 4096, 12, 1500)]


@pytest.mark.parametrize("lens", LAYOUTS, ids=lambda lens: f"{len(lens)}seg")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_stats_pass_noise_on_device(dtype, lens):
    d, m = sum(lens), 5
    x = _randn(m, d, seed=len(lens), dtype=dtype)
    rows = client_rows([list(r.split(list(lens))) for r in x.to(DEVICE)] if len(lens) > 1 else x.to(DEVICE),
                       name="deltas")
    coefs = torch.tensor([0.3, 0.1, 0.2, 0.25, 0.15], dtype=torch.float64)
    noise = (0.5, 2 ** 64 - 3, (5 << 32) + 1)
    got, sq, bad, msq = run_stats(rows, coefs.to(DEVICE), resolve("triton", torch.device(DEVICE)), noise=noise)
    want, sq_ref, _, _ = run_stats(client_rows(x.double(), name="deltas"), coefs,
                                   resolve("reference", torch.device("cpu")), noise=noise)
    err = (got.cpu().double() - want).abs() / (1 + want.abs())
    assert float(err.max()) < 1e-5, (dtype, lens, int(err.argmax()))
    g = got.cpu().double()
    assert float(msq) == pytest.approx(float(g @ g), rel=1e-6)
    assert_close(sq.cpu(), sq_ref, rtol=1e-5, atol=0, name=f"squared norms {dtype}")
    assert not bad.any()


@pytest.mark.parametrize("side", ["server", "client"])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_releases_on_device(side, nonfinite):
    m, d = 9, (1_000_003 if ON_GPU else 5003)
    x = 0.01 * _randn(m, d, seed=21)
    if nonfinite:
        x[4, d // 2] = float("nan")
    norms = x.double().norm(dim=1)
    finite_norms = norms[torch.isfinite(norms)].sort().values
    c = float(finite_norms[3] + finite_norms[4]) / 2  # between two clients' norms: none sits on the bound
    make = privacy.ServerSideFixedClipping if side == "server" else privacy.ClientSideFixedClipping
    got = privacy.release(x.to(DEVICE), make(1.0, c, m, seed=6), backend="triton")
    want = privacy.release(x.double(), make(1.0, c, m, seed=6), backend="reference")
    assert torch.equal(got.clipped.cpu(), want.clipped) and torch.equal(got.excluded.cpu(), want.excluded)
    assert bool(got.excluded.any()) == nonfinite and bool(got.clipped.any())
    assert_close(got.estimate.cpu().double(), want.estimate, rtol=1e-4, atol=1e-5 * c / m + 1e-6,
                 name=f"{side}-side release")
    assert float(got.mean_sq) == pytest.approx(float(want.mean_sq), rel=1e-5)
