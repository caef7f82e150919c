"""The ways the stats pass and the client step keep loads in flight (launch.STATS_PIPELINE / LOCAL_PIPELINE), on
the device they are for: each variant gives the bits of the default and agrees with the float64 reference.

On a machine with a CUDA GPU the compiled kernels run (bench/device_check.sh); without one, conftest sets
TRITON_INTERPRET=1 and the same checks run through the interpreter at smaller sizes, with tiles forced small so
that the client loop (stats) and the block loop (client step) take several turns with a ragged end.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import fastagg
from fastagg import client
from fastagg.testing import assert_close, tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"

stats_mod = importlib.import_module("fastagg.backends.triton.round_stats")
local_mod = importlib.import_module("fastagg.backends.triton.local_step")

# (PREFETCH, RAW, STAGES): the default first
STATS_VARIANTS = [(1, False, None), (1, True, None), (2, True, None), (2, False, None), (0, False, 3),
                  (0, False, 4), (0, True, 4), (1, True, 3)]
# (input dtype, tile (BLOCK_M, BLOCK_D, warps), variants): on the GPU, the chosen bf16 and fp32 tiles and the other
# tiles with the variants bench/gpu_bench.py times (each a compile on the card); the interpreter's small tiles loop
# over clients, every variant
DEFAULT = STATS_VARIANTS[:1]
STATS_CASES = [(torch.bfloat16, (1, 8192, 4), STATS_VARIANTS[:3] + [(0, False, 3), (0, False, 4)]),
               (torch.bfloat16, (1, 8192, 8), DEFAULT + [(0, False, 3), (2, True, None)]),
               (torch.bfloat16, (1, 4096, 4), DEFAULT + [(0, False, 4)]),
               (torch.float32, (2, 2048, 4), DEFAULT + [(2, False, None), (0, False, 3)])] if ON_GPU else \
    [(dt, tile, STATS_VARIANTS) for dt in (torch.bfloat16, torch.float32) for tile in ((1, 1024, 4), (2, 1024, 4))]
# M clients (ragged against the tile: the loop's last turns load nothing), d with a ragged last block
STATS_SHAPES = [(16, 300_007), (33, 70_001)] if ON_GPU else [(5, 2_500), (2, 1_100)]


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _round(x, weights, form, models_base=None):
    rows = x
    if form == "per-layer":
        d = x.shape[1]
        rows = [[r[: d // 3], r[d // 3:]] for r in x.unbind(0)]
    if models_base is not None:
        return fastagg.fedexp_step(models=rows, eps=1e-3, weights=weights, params=models_base, on_nonfinite="skip",
                                   backend="triton")
    return fastagg.fedexp_step(rows, eps=1e-3, weights=weights, on_nonfinite="skip", backend="triton")


@pytest.mark.parametrize("m,d", STATS_SHAPES, ids=[f"M{m}-d{d}" for m, d in STATS_SHAPES])
@pytest.mark.parametrize("dtype,tile,variants", STATS_CASES,
                         ids=[f"{str(t)[6:]}-{bm}x{bd}w{w}" for t, (bm, bd, w), _ in STATS_CASES])
def test_stats_pipeline_variants(dtype, tile, variants, m, d, monkeypatch):
    """Every variant, over a matrix, per-layer rows (segments: the masked, unaligned path) and full models (the
    base subtracted), with a client holding an Inf: the bits of the default variant, and the float64 reference's
    round."""
    bm, bd, warps = tile
    x = (0.1 * _randn(m, d, seed=11, dtype=dtype)).to(DEVICE)
    x[m // 2, d - 3] = float("inf")  # in the last, ragged block
    weights = list(range(1, m + 1))
    base = _randn(d, seed=12, dtype=dtype).to(DEVICE)
    models = (x + base).to(dtype)
    ref = fastagg.fedexp_step(x.double().cpu(), eps=1e-3, weights=weights, on_nonfinite="skip", backend="reference")
    ok = torch.ones(m, dtype=torch.bool)
    ok[m // 2] = False
    for form in ("matrix", "per-layer", "models"):
        results = []
        for prefetch, raw, stages in variants:
            monkeypatch.setattr(stats_mod, "stats_config", lambda M, n, es=4, p=prefetch, r=raw, s=stages: dict(
                BLOCK_M=bm, BLOCK_D=bd, num_warps=warps, PREFETCH=p, RAW=r, STAGES=s))
            res = _round(models if form == "models" else x, weights, form, base if form == "models" else None)
            results.append(((prefetch, raw, stages), res))
        (_, first) = results[0]
        assert first.nonfinite.cpu().tolist() == (~ok).tolist(), form
        if form != "models":  # models: the mean of x + base - base, rounded in the input dtype first
            assert_close(first.sq_norms.cpu()[ok], ref.sq_norms[ok], rtol=tolerance(dtype, "norm")[0],
                         atol=tolerance(dtype, "norm")[1], name=f"{form} sq_norms")
        for variant, res in results[1:]:
            for f in ("mean_flat", "sq_norms", "nonfinite", "mean_sq_norm"):
                a, b = getattr(res, f), getattr(first, f)
                assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a[~a.isnan()],
                                                                                         b[~b.isnan()]), \
                    (form, variant, f)
    # the same round without the Inf client: the mean against the reference
    prefetch, raw, stages = variants[-1]
    monkeypatch.setattr(stats_mod, "stats_config", lambda M, n, es=4: dict(BLOCK_M=bm, BLOCK_D=bd, num_warps=warps,
                                                                           PREFETCH=prefetch, RAW=raw, STAGES=stages))
    x[m // 2, d - 3] = 0.0
    got = _round(x, weights, "matrix")
    want = fastagg.fedexp_step(x.double().cpu(), eps=1e-3, weights=weights, backend="reference")
    rtol, atol = tolerance(dtype, "mean")
    assert_close(got.mean_flat.cpu(), want.mean_flat, rtol=rtol, atol=atol * max(1.0, (m / 16) ** 0.5), name="mean")
    assert_close(got.sq_norms.cpu(), want.sq_norms, rtol=tolerance(dtype, "norm")[0],
                 atol=tolerance(dtype, "norm")[1], name="sq_norms")


# (PREFETCH, STAGES): the default first
LOCAL_VARIANTS = [(0, None), (1, None), (0, 2), (0, 3), (1, 3)]


@pytest.mark.parametrize("schedule", ["grouped", "chunks", "row"])
def test_client_step_pipeline_variants(schedule, monkeypatch):
    """Each variant of both sweeps, in each schedule, with a ragged last block, FedSPS with a prox anchor and
    clipping, and heavy-ball momentum: the params, steps and momentum of the default variant bit for bit, and
    the float64 reference's."""
    m, d = (37, 100_003) if ON_GPU else (5, 20_001)
    block = 4096 if ON_GPU else 2048
    if schedule == "row":
        d = 2 * block - 5 if ON_GPU else 3 * block + 7
    x0, g = _randn(m, d, seed=80).to(DEVICE), (0.1 * _randn(m, d, seed=81)).to(DEVICE)
    anchor = _randn(d, seed=82).to(DEVICE)
    losses = (1.0 + torch.rand(m, generator=torch.Generator().manual_seed(83), dtype=torch.float64))
    losses[1] = 0.0  # no step: nothing of that row written

    def run(backend, device, dt, variant=None):
        if variant is not None:
            monkeypatch.setattr(local_mod, "local_config", lambda M, n, p=variant[0], s=variant[1]: dict(
                schedule=schedule, BLOCK=block, CHUNK=None if schedule == "row" else 4 * block, GROUP_ROWS=2,
                num_warps=8 if ON_GPU else 4, PREFETCH=p, STAGES=s))
        x = x0.to(device, dt, copy=True)
        gg = g.to(device, dt)
        state = client.ClientState(m, d, dtype=dt, device=device)
        steps = [client.sps_step(params=x, grads=gg, losses=losses.to(device), c=0.5, gamma_b=0.3,
                                 prox=(anchor.to(device, dt), 0.01), clip_norm=30.0, backend=backend),
                 client.local_step(params=x, grads=gg, lr=0.05, momentum=0.9, state=state,
                                   client_ids=torch.arange(m), weight_decay=1e-3, backend=backend)]
        return x.cpu(), [s.cpu() for s in steps], state.vector("momentum").cpu()

    out = [run("triton", DEVICE, torch.float32, v) for v in LOCAL_VARIANTS]
    ref_x, ref_steps, ref_buf = run("reference", "cpu", torch.float64)
    x_first, steps_first, buf_first = out[0]
    for v, (x, steps, buf) in zip(LOCAL_VARIANTS[1:], out[1:]):
        assert torch.equal(x, x_first) and torch.equal(buf, buf_first), v
        assert all(torch.equal(a, b) for a, b in zip(steps, steps_first)), v
    assert steps_first[0][1] == 0.0
    for a, b in zip(steps_first, ref_steps):
        assert_close(a, b, rtol=1e-4, atol=1e-7, name="steps")
    assert_close(x_first, ref_x, rtol=2e-4, atol=2e-5, name="params")
    assert_close(buf_first, ref_buf, rtol=1e-4, atol=1e-5, name="momentum")
