"""fp8 e4m3, QSGD and top-k / random-k sparse clients (fastagg.compress): the quantizers' stated bounds, every fold
against the float64 oracle that dequantizes first (each format alone and mixed in one list, on every backend),
every entry point (functional round, Accumulator, server optimizers, robust rules), and bad input refused naming
the client with nothing changed."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fastagg
from fastagg import server
from fastagg.compress import (Fp8Blockwise, Int8Blockwise, SparseUpdate, dequantize, quantize_fp8, quantize_int8,
                              quantize_qsgd, quantize_qsgd_rows, sparsify_randk, sparsify_rows, sparsify_topk)
from fastagg.compress.fold import fold
from fastagg.robust import Median
from fastagg.testing import assert_close, cpu_backends, tolerance

BACKENDS = cpu_backends()
D = 3001
NORM_RTOL = tolerance(torch.float32, "norm")[0]  # norms of float32 sums: each block's squares summed in float32


def _xs(m, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(d, generator=g) * (1 + i) for i in range(m)]


def _mixed(d=D, seed=0):
    xs = _xs(6, d, seed)
    return [quantize_int8(xs[0], 64), quantize_fp8(xs[1], 100), quantize_qsgd(xs[2], 16, client=2),
            sparsify_topk(xs[3], 0.05), sparsify_randk(xs[4], 0.02, client=4), quantize_fp8(xs[5], 256)]


def _state(acc):
    return (acc.weighted_sum.clone(), float(acc.weighted_sq_norm_sum), acc.total_weight, acc.num_clients,
            list(acc.client_ids))


# -- the quantizers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [1, 32, 256, D])
def test_fp8_error_bound_and_nan_codes_never_written(block):
    x = torch.randn(D, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * \
        torch.logspace(-2, 2, D, dtype=torch.float64)
    u = quantize_fp8(x, block)
    assert u.codes.dtype == torch.float8_e4m3fn and u.nbytes == D + 4 * u.scales.numel()
    assert not u.holds_invalid_code()
    s = u.scales.double().repeat_interleave(block)[:D]
    err = (dequantize(u) - x).abs()
    normal = (x / s).abs() >= 2.0 ** -6
    assert bool((err[normal] <= 2.0 ** -4 * x[normal].abs() * (1 + 1e-6)).all())  # 3 mantissa bits
    assert bool((err[~normal] <= 2.0 ** -10 * s[~normal] * (1 + 1e-6)).all())
    assert float((dequantize(u) / s).abs().max()) <= 448.0


def test_qsgd_levels_unbiased_keyed_and_within_the_papers_variance():
    x = torch.randn(500, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    u = quantize_qsgd(x, 4, seed=3, round=1, client=7)
    assert isinstance(u, Int8Blockwise) and u.block == 500 and int(u.codes.abs().max()) <= 4
    assert torch.equal(u.codes, quantize_qsgd(x, 4, seed=3, round=1, client=7).codes)
    assert not torch.equal(u.codes, quantize_qsgd(x, 4, seed=3, round=1, client=8).codes)
    draws = torch.stack([dequantize(v) for v in quantize_qsgd_rows(x[None].expand(2000, -1), 4, seed=5)])
    assert float((draws.mean(0) - x).abs().max()) < 5 * float(draws.std(0).max()) / 2000 ** 0.5
    variance = float(((draws - x) ** 2).sum(1).mean())
    assert variance <= min(500 / 16, 500 ** 0.5 / 4) * float(x @ x)  # Lemma 3.1
    with pytest.raises(ValueError, match="\\[1, 127\\]"):
        quantize_qsgd(x, 128)


def test_qsgd_is_unbiased_where_levels_reach_s_within_hoeffdings_bound():
    """E[x~_j] = x_j for every element, those whose level may reach s included (a level clamped to s - 1 biases
    them by s_b P(l_j = s)). Each draw of x~_j takes one of two values s_b apart, so by Hoeffding the mean of N
    independent draws is within t = s_b sqrt(ln(2 d / delta) / (2 N)) of x_j for all d elements at once with
    probability >= 1 - delta; delta = 1e-9 (the draws are keyed, so the outcome is fixed: a correct quantizer
    passes for all but a 1e-9 share of seeds)."""
    s, bucket, n, delta = 3, 8, 4000, 1e-9
    # per bucket: one dominant element whose level lies in (s - 1, s) (|x_j| / s_b = s |x_j| / ||x_b||), the
    # others at assorted fractional levels, signs mixed
    b = torch.tensor([3.0, 0.5, -0.3, 0.2, -0.11, 0.07, 0.9, -0.45], dtype=torch.float64)
    x = torch.cat([b, -b.flip(0) * 2.5, b * 1e-3, torch.tensor([0.0, 1.0, -1.0, 0.0, 2.0, 0.0, 0.0, 0.0],
                                                                   dtype=torch.float64)])
    d = x.numel()
    levels = x.abs().view(-1, bucket) * s / x.view(-1, bucket).norm(dim=1, keepdim=True)
    assert bool(((levels > s - 1) & (levels < s)).any(1).all())  # every bucket has a level that may reach s
    us = quantize_qsgd_rows(x[None].expand(n, -1), s, bucket=bucket, seed=11, round=2)
    draws = torch.stack([dequantize(u) for u in us])
    step = us[0].scales.to(torch.float64).repeat_interleave(bucket)  # s_b: the same in every draw
    assert all(torch.equal(u.scales, us[0].scales) for u in us[:10])
    t = step * math.sqrt(math.log(2 * d / delta) / (2 * n))
    err = (draws.mean(0) - x).abs()
    assert bool((err <= t).all()), (err / t).max()
    # the bound is tight enough to see a clamp to s - 1: the dominant elements' bias exceeds it many times
    assert float((step * (levels.flatten() - (s - 1)).clamp(min=0)).max()) > 10 * float(t.max())


def test_qsgd_buckets_scale_each_by_its_own_norm():
    x = torch.cat([torch.full((10,), 1e-3), torch.full((10,), 1e3)])
    u = quantize_qsgd(x, 8, bucket=10)
    assert u.scales.numel() == 2 and float(u.scales[0]) < 1e-2 < 1e2 < float(u.scales[1])


def test_topk_keeps_the_largest_randk_is_keyed_and_unbiased_scaling():
    x = torch.tensor([0.5, -3.0, 0.1, 2.0, -2.0, 0.0])
    t = sparsify_topk(x, k=3)
    assert t.indices.tolist() == [1, 3, 4] and t.values.tolist() == [-3.0, 2.0, -2.0]
    assert t.indices.dtype == torch.int32 and t.nbytes == 3 * 8
    a = sparsify_randk(x, k=2, seed=1, round=2, client=3)
    assert torch.equal(a.indices, sparsify_randk(x, k=2, seed=1, round=2, client=3).indices)
    assert bool((a.indices[1:] > a.indices[:-1]).all()) and torch.equal(a.values, x[a.indices.long()])
    b = sparsify_randk(x, k=2, seed=1, round=2, client=3, unbiased=True)
    assert torch.allclose(b.values, x[b.indices.long()] * 3)
    y = torch.randn(40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mean = sum(sparsify_randk(y, k=10, unbiased=True, client=c).dequantize() for c in range(3000)) / 3000
    assert float((mean - y).abs().max()) < 0.25 * float(y.abs().max())
    with pytest.raises(TypeError, match="one of fraction"):
        sparsify_topk(x)
    with pytest.raises(ValueError, match="fraction"):
        sparsify_topk(x, 1.5)


# -- the folds against the oracle -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("init", [False, True])
def test_every_format_alone_and_mixed_folds_like_the_dequantized_oracle(backend, dtype, init):
    from fastagg.backends import resolve

    be = resolve(backend, torch.device("cpu"))
    us = _mixed()
    coef = torch.tensor([0.1, 0.3, 0.2, 0.15, 0.05, 0.2], dtype=torch.float64)
    start = torch.randn(D, dtype=dtype) if init else None
    groups = [[j] for j in range(len(us))] + [list(range(len(us)))]
    for g in groups:
        sub = [us[j] for j in g]
        out = torch.empty(D, dtype=dtype)
        sq, msq = fold(sub, [f"u{j}" for j in g], coef[g], be, init=start, out=out)
        want = sum(coef[j] * dequantize(us[j]) for j in g) + (start.double() if init else 0)
        tol = torch.finfo(dtype).eps * (len(g) + 2) * float(want.abs().max())
        assert_close(out, want, rtol=0, atol=tol, name=f"sum of {g}")
        assert_close(sq, torch.stack([dequantize(us[j]).square().sum() for j in g]), rtol=1e-12, atol=0, name="sq")
        assert_close(msq, out.double().square().sum(), rtol=1e-12, atol=0, name="mean sq")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fedexp_and_server_optimizers_step_on_mixed_lists_as_on_the_dequantized_updates(backend):
    us = _mixed()
    dense = [dequantize(u) for u in us]
    w = torch.randn(D)
    ref = w.double().clone()
    got = fastagg.fedexp_step(us, eps=1e-3, params=w, backend=backend)
    want = fastagg.fedexp_step(dense, eps=1e-3, params=ref, backend="reference")
    assert_close(got.eta, want.eta, rtol=1e-5, atol=0, name="eta")
    assert_close(w, ref, rtol=1e-5, atol=1e-5, name="params")
    a, b = torch.zeros(D), torch.zeros(D, dtype=torch.float64)
    oa, ob = server.FedAdam([a], lr=0.1, backend=backend), server.FedAdam([b], lr=0.1, backend="reference")
    for _ in range(2):
        oa.step(us, weights=[1, 2, 3, 4, 5, 6])
        ob.step([x.clone() for x in dense], weights=[1, 2, 3, 4, 5, 6])
    assert_close(a, b, rtol=1e-4, atol=1e-6, name="FedAdam params")


def test_a_robust_rule_reads_compressed_clients_dequantized():
    us = _mixed()
    a, b = torch.zeros(D), torch.zeros(D)
    server.FedAvg([a], aggregate=Median()).step(us)
    server.FedAvg([b], aggregate=Median()).step(torch.stack([dequantize(u, torch.float32) for u in us]))
    assert torch.equal(a, b)
    bad = list(us)
    bad[0] = Int8Blockwise(us[0].codes.clone().fill_(-128), us[0].scales, 64)
    a, b = torch.zeros(D), torch.zeros(D)  # an invalid code: left out by the rule (an attack), not the round refused
    assert server.FedAvg([a], aggregate=Median()).step(bad).robust.excluded.tolist() == [True] + [False] * (len(us) - 1)
    server.FedAvg([b], aggregate=Median()).step(torch.stack([dequantize(u, torch.float32) for u in us[1:]]))
    assert torch.equal(a, b)


def test_a_round_may_mix_float_and_compressed_clients_in_an_accumulator():
    xs = _xs(3)
    us = _mixed()
    acc = fastagg.Accumulator(like=torch.zeros(D))
    acc.add_many(us[:3], [1.0, 2.0, 3.0])
    acc.add(xs[0], weight=4.0)
    acc.add_many(us[3:], [1.0, 1.0, 1.0])
    want = dequantize(us[0]) + 2 * dequantize(us[1]) + 3 * dequantize(us[2]) + 4 * xs[0].double() + \
        sum(dequantize(u) for u in us[3:])
    assert_close(acc.weighted_sum, want, rtol=0, atol=1e-5 * float(want.abs().max()), name="sum")
    assert acc.num_clients == 7


def _with_floats(d=D, seed=0):
    """The mixed formats with float clients among them: float32, bfloat16 and float64 (three float groups, so one
    float pass starts from a sum other passes wrote)."""
    xs = _xs(3, d, seed + 1)
    us = _mixed(d, seed)
    return [xs[0], us[0], us[1], xs[1].bfloat16(), us[2], us[3], xs[2].double(), us[4], us[5]]


def _dense(u) -> torch.Tensor:
    return u.double() if isinstance(u, torch.Tensor) else dequantize(u)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("init", ["none", "other", "out"])
def test_float_clients_fold_beside_compressed_ones_like_the_oracle(backend, dtype, init):
    """A mixed round in one list: float tensors (any float dtype, converted on load) beside int8, fp8, QSGD and
    sparse clients, folded by the stats pass of float rows and the formats' sweeps into one sum, per-client norms
    and ||sum||^2 as the float64 oracle's; starting from nothing, from another tensor, or from out itself."""
    from fastagg.backends import resolve

    be = resolve(backend, torch.device("cpu"))
    us = _with_floats()
    m = len(us)
    coef = torch.linspace(0.05, 0.3, m, dtype=torch.float64)
    start = torch.randn(D, generator=torch.Generator().manual_seed(9), dtype=dtype)
    out = start.clone() if init == "out" else torch.empty(D, dtype=dtype)
    sq, msq = fold(us, [f"u{j}" for j in range(m)], coef, be, init={"none": None, "other": start, "out": out}[init],
                   out=out)
    want = sum(coef[j] * _dense(us[j]) for j in range(m)) + (0 if init == "none" else start.double())
    assert_close(out, want, rtol=0, atol=torch.finfo(dtype).eps * (m + 2) * float(want.abs().max()), name="sum")
    want_sq = torch.stack([_dense(u).square().sum() for u in us])
    rtol, atol = tolerance(dtype, "norm")  # float32 sums: each block's squares summed in float32
    assert_close(sq, want_sq, rtol=rtol, atol=atol, name="sq")
    assert_close(msq, out.double().square().sum(), rtol=1e-12, atol=0, name="mean sq")


def test_float_parts_of_layerwise_rounds_are_sliced_per_layer():
    from fastagg.backends import resolve
    from fastagg.compress import LayerwiseUpdate

    sizes = (1000, 2001)
    xs = _xs(3)
    lw = [LayerwiseUpdate((quantize_int8(x[:sizes[0]], 64), sparsify_topk(x[sizes[0]:], 0.1))) for x in xs[:2]]
    us = [xs[2], lw[0], lw[1]]  # a float client first: the layers are the first layerwise update's
    coef = torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64)
    out = torch.empty(D)
    sq, msq = fold(us, ["a", "b", "c"], coef, resolve("cpu", torch.device("cpu")), init=None, out=out)
    dense = [u.double() if isinstance(u, torch.Tensor) else torch.cat([dequantize(p) for p in u.parts]) for u in us]
    want = sum(c * x for c, x in zip(coef, dense))
    assert_close(out, want, rtol=0, atol=1e-6 * float(want.abs().max()), name="sum")
    assert_close(sq[0], xs[2].double().square().sum(), rtol=NORM_RTOL, atol=0,
                 name="the float client's norm")
    w = torch.zeros(D)
    fastagg.fedexp_step(us, eps=1e-3, weights=[5.0, 2.0, 3.0], params=w)
    ref = torch.zeros(D, dtype=torch.float64)
    fastagg.fedexp_step(dense, eps=1e-3, weights=[5.0, 2.0, 3.0], params=ref, backend="reference")
    assert_close(w, ref, rtol=1e-5, atol=1e-6, name="params")


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_entry_point_takes_float_clients_beside_compressed_ones(backend):
    """The functional round, the server optimizers (an internal Accumulator), the Accumulator's add_many and the
    robust rules (dequantized rows) on one list of float (a read-only numpy array among them) and compressed clients:
    as on the float64 updates."""
    us = _with_floats()
    dense = [_dense(u) for u in us]
    # the float32 client as a read-only numpy array (as Flower's replies arrive): viewed, not copied
    us[0] = np.frombuffer(us[0].numpy().tobytes(), dtype=np.float32)
    ws = [float(j + 1) for j in range(len(us))]
    w, ref = torch.randn(D), None
    ref = w.double().clone()
    got = fastagg.fedexp_step(us, eps=1e-3, weights=ws, params=w, backend=backend)
    want = fastagg.fedexp_step(dense, eps=1e-3, weights=ws, params=ref, backend="reference")
    assert_close(got.eta, want.eta, rtol=1e-5, atol=0, name="eta")
    assert_close(got.sq_norms, want.sq_norms, rtol=NORM_RTOL, atol=0, name="sq_norms")
    assert_close(w, ref, rtol=1e-5, atol=1e-5, name="params")
    a, b = torch.zeros(D), torch.zeros(D, dtype=torch.float64)
    oa, ob = server.FedAdam([a], lr=0.1, backend=backend), server.FedAdam([b], lr=0.1, backend="reference")
    for _ in range(2):
        oa.step(us, weights=ws)
        ob.step([x.clone() for x in dense], weights=ws)
    assert_close(a, b, rtol=1e-4, atol=1e-6, name="FedAdam params")
    acc = fastagg.Accumulator(like=torch.zeros(D), backend=backend)
    assert acc.add_many(us, ws) == [True] * len(us)
    want_sum = sum(wt * x for wt, x in zip(ws, dense))
    assert_close(acc.weighted_sum, want_sum, rtol=0, atol=1e-5 * float(want_sum.abs().max()), name="sum")
    assert_close(acc.weighted_sq_norm_sum, sum(wt * float(x @ x) for wt, x in zip(ws, dense)),
                 rtol=NORM_RTOL, atol=0, name="sq sum")
    r1, r2 = torch.zeros(D), torch.zeros(D)
    server.FedAvg([r1], aggregate=Median(), backend=backend).step(us)
    server.FedAvg([r2], aggregate=Median(), backend=backend).step(torch.stack([x.float() for x in dense]))
    assert torch.equal(r1, r2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_float_client_beside_compressed_ones_is_raised_or_left_out(backend):
    us = _with_floats()
    us[3] = us[3].clone()
    us[3][17] = float("nan")
    w = torch.ones(D)
    with pytest.raises(ValueError, match="deltas\\[3\\]"):
        fastagg.fedexp_step(us, eps=1e-3, params=w, backend=backend)
    assert torch.equal(w, torch.ones(D))
    res = fastagg.fedexp_step(us, eps=1e-3, params=w, backend=backend, on_nonfinite="skip")
    assert not bool(res.finite) and res.nonfinite.tolist() == [j == 3 for j in range(len(us))]
    assert torch.equal(w, torch.ones(D))
    acc = fastagg.Accumulator(like=torch.zeros(D), backend=backend)
    with pytest.raises(ValueError, match="deltas\\[3\\] has a NaN or Inf scale or value"):
        acc.add_many(us)
    assert acc.num_clients == 0 and not bool(acc.weighted_sum.any())
    assert acc.add_many(us, on_nonfinite="skip") == [j != 3 for j in range(len(us))]
    keep = [u for j, u in enumerate(us) if j != 3]
    want = sum(_dense(u) for u in keep)
    assert_close(acc.weighted_sum, want, rtol=0, atol=1e-5 * float(want.abs().max()), name="sum without it")


@pytest.mark.parametrize("item, error, match", [
    ({"w": torch.zeros(D)}, TypeError, "deltas\\[1\\] is a dict: beside compressed updates"),
    (torch.zeros(D, dtype=torch.int16).numpy(), TypeError, "deltas\\[1\\] has dtype torch.int16"),
    (np.array([object()] * D), TypeError, "deltas\\[1\\] is a numpy array of object"),
    (torch.zeros(D, dtype=torch.int32), TypeError, "deltas\\[1\\] has dtype torch.int32"),
    (torch.zeros(D + 1), ValueError, f"deltas\\[1\\] has {D + 1} elements"),
    (torch.zeros(2 * D)[::2], ValueError, "deltas\\[1\\] is not contiguous"),
    (torch.zeros(D, device="meta"), ValueError, "deltas\\[1\\] is on meta"),
])
def test_a_float_client_that_does_not_fit_is_refused_naming_it_and_nothing_changes(item, error, match):
    us = _mixed()
    batch = [us[0], item, us[1]]
    w = torch.ones(D)
    with pytest.raises(error, match=match):
        fastagg.fedexp_step(batch, eps=1e-3, params=w)
    assert torch.equal(w, torch.ones(D))
    acc = fastagg.Accumulator(like=torch.zeros(D))
    acc.add(us[2])
    before = _state(acc)
    with pytest.raises(error, match=match):
        acc.add_many(batch)
    after = _state(acc)
    assert torch.equal(after[0], before[0]) and after[1:] == before[1:]
    mean = torch.zeros(D)
    with pytest.raises(ValueError, match="mean_out overlaps deltas\\[1\\]"):
        fastagg.fedexp_step([us[0], mean], eps=1e-3, mean_out=mean)


# -- bad input --------------------------------------------------------------------------------------------------
def _fp8_with_nan_code(u):
    codes = u.codes.view(torch.uint8).clone()
    codes[5] = 0x7F
    return Fp8Blockwise(codes.view(torch.float8_e4m3fn), u.scales, u.block)


def _sparse(u, indices=None, values=None):
    return SparseUpdate(u.indices if indices is None else indices, u.values if values is None else values, u.numel)


BAD = {
    "fp8-nan-code": (lambda us: _fp8_with_nan_code(us[1]), "holds a NaN code"),
    "sparse-out-of-range": (lambda us: _sparse(us[3], us[3].indices.clone().index_fill_(0, torch.tensor([0]), -1)),
                            "index -1 is outside"),
    "sparse-past-the-end": (lambda us: _sparse(us[3], torch.cat([us[3].indices[:-1], us[3].indices.new_tensor([D])])),
                            f"index {D} is outside"),
    "sparse-duplicated": (lambda us: _sparse(us[3], torch.cat([us[3].indices[:1], us[3].indices[:-1]])), "duplicated"),
    "sparse-unsorted": (lambda us: _sparse(us[3], us[3].indices.flip(0)), "unsorted"),
    "sparse-nan-value": (lambda us: _sparse(us[3], values=us[3].values.clone().index_fill_(0, torch.tensor([2]),
                                                                                         float("nan"))), "NaN or Inf"),
    "other-size": (lambda us: sparsify_topk(torch.ones(D + 1), k=3), f"has {D + 1} elements"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_update_is_refused_naming_it_and_nothing_changes(backend, dtype, bad):
    us = _mixed()
    make, match = BAD[bad]
    batch = list(us[:2]) + [make(us)]
    acc = fastagg.Accumulator(like=torch.zeros(D, dtype=dtype), backend=backend)
    acc.add(us[0], client_id="first")
    before = _state(acc)
    with pytest.raises(ValueError, match=match) as e:
        acc.add_many(batch)
    assert "deltas[2]" in str(e.value) or bad == "sparse-nan-value"
    after = _state(acc)
    assert torch.equal(after[0], before[0]) and after[1:] == before[1:]
    w = torch.ones(D)
    with pytest.raises(ValueError, match=match):
        fastagg.fedexp_step(batch, eps=1e-3, params=w, backend=backend)
    assert torch.equal(w, torch.ones(D))
    if bad == "sparse-nan-value":  # a non-finite client: on_nonfinite="skip" leaves it out, the others fold
        assert acc.add_many(batch, client_ids=["a", "b", "c"], on_nonfinite="skip") == [True, True, False]


def test_the_cpu_binding_checks_sparse_indices_itself():
    from fastagg.backends.cpu import compiled

    c = compiled()
    out, sq = torch.zeros(10), torch.zeros(1, dtype=torch.float64)
    coef = torch.ones(1, dtype=torch.float64)

    def call(ix, vals=None):
        v = torch.ones(ix.numel()) if vals is None else vals
        c.sparse_fold([ix.__dlpack__()], [v.__dlpack__()], coef.__dlpack__(), out.__dlpack__(), out.__dlpack__(),
                      sq.__dlpack__(), None)

    call(torch.tensor([0, 3, 9]))
    assert out.tolist() == [1, 0, 0, 1, 0, 0, 0, 0, 0, 1]
    for ix, match in [(torch.tensor([0, 10]), "index 10 \\(entry 1\\) is outside \\[0, 10\\)"),
                      (torch.tensor([-1, 2], dtype=torch.int32), "index -1"),
                      (torch.tensor([4, 4]), "strictly increasing"),
                      (torch.tensor([5, 2]), "strictly increasing"),
                      (torch.tensor([2 ** 40]), "outside"),
                      (torch.tensor([1.0]), "int64 or int32")]:
        before = out.clone()
        with pytest.raises((ValueError, TypeError), match=match):
            call(ix)
        assert torch.equal(out, before)
    with pytest.raises(ValueError, match="value 0 is not finite"):
        call(torch.tensor([1]), torch.tensor([float("inf")]))
    with pytest.raises(ValueError, match="has 2 elements; expected 1"):
        call(torch.tensor([1]), torch.ones(2))


def test_the_cpu_binding_finds_a_bad_entry_deep_in_long_clients_and_starts_from_init():
    """Long clients are checked by branch-free passes (in parallel over clients); a bad entry anywhere is still
    named with its client and entry, nothing written. init: None starts from zeros, another tensor is copied, out
    itself folds in place; an init overlapping out partly is refused."""
    from fastagg.backends.cpu import compiled

    c = compiled()
    d, k = 300_000, 20_000
    g = torch.Generator().manual_seed(5)
    ixs = [torch.randperm(d, generator=g)[:k].sort().values for _ in range(3)]
    vals = [torch.randn(k, generator=g) for _ in range(3)]
    coef = torch.tensor([1.0, 2.0, -0.5], dtype=torch.float64)
    sq, msq = torch.zeros(3, dtype=torch.float64), torch.zeros((), dtype=torch.float64)

    def call(ix, vs, init, out):
        c.sparse_fold([i.__dlpack__() for i in ix], [v.__dlpack__() for v in vs], coef.__dlpack__(),
                      None if init is None else init.__dlpack__(), out.__dlpack__(), sq.__dlpack__(),
                      msq.__dlpack__())

    want = torch.zeros(d, dtype=torch.float64)
    for i in range(3):
        want[ixs[i]] += float(coef[i]) * vals[i].double()
    base = torch.randn(d, generator=g)
    for init_kind in ("none", "other", "same"):
        out = base.clone() if init_kind == "same" else torch.full((d,), 7.0)
        init = None if init_kind == "none" else base if init_kind == "other" else out
        call(ixs, vals, init, out)
        expect = want + (0.0 if init_kind == "none" else base.double())
        assert torch.allclose(out.double(), expect, rtol=0, atol=1e-5)
        assert sq.tolist() == pytest.approx([float((v.double() ** 2).sum()) for v in vals], rel=1e-12)
        assert float(msq) == pytest.approx(float((out.double() ** 2).sum()), rel=1e-12)
    out = torch.zeros(d + 1)
    with pytest.raises(ValueError, match="overlap"):
        call(ixs, vals, out[1:], out[:d])
    for where, bad, match in [("rise", None, "client 1: indices must be strictly increasing; entry 12345"),
                              ("range", None, f"client 1: index {d} \\(entry {k - 1}\\) is outside"),
                              ("nan", float("nan"), "client 1: value 15000 is not finite"),
                              ("-inf", float("-inf"), "client 1: value 15000 is not finite")]:
        ix1, v1 = ixs[1].clone(), vals[1].clone()
        if where == "rise":
            ix1[12345] = ix1[12344]
        elif where == "range":
            ix1[-1] = d
        else:
            v1[15000] = bad
        out = torch.full((d,), 3.0)
        with pytest.raises(ValueError, match=match):
            call([ixs[0], ix1, ixs[2]], [vals[0], v1, vals[2]], None, out)
        assert bool((out == 3.0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_fp8_code_decodes_as_torch_decodes_it(backend):
    """The C++ backend decodes e4m3 arithmetically (no table): all 254 finite codes, in tiles of every alignment,
    equal torch's float8_e4m3fn values exactly; the two NaN codes are refused."""
    from fastagg.backends import resolve

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    q = torch.cat([finite.roll(k) for k in range(9)])  # every code at every position mod 8
    u = Fp8Blockwise(q.view(torch.float8_e4m3fn), torch.ones(-(-q.numel() // 64)), 64)
    out = torch.empty(q.numel())
    sq, _ = fold([u], ["u"], torch.ones(1, dtype=torch.float64), resolve(backend, torch.device("cpu")), init=None,
                 out=out)
    want = q.view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(out, want)
    assert float(sq[0]) == float(want.double().square().sum())
    for nan in (0x7F, 0xFF):
        bad = q.clone()
        bad[13] = nan
        with pytest.raises(ValueError, match="holds a NaN code"):
            fold([Fp8Blockwise(bad.view(torch.float8_e4m3fn), u.scales, 64)], ["u"], torch.ones(1, dtype=torch.float64),
                 resolve(backend, torch.device("cpu")), init=None, out=out)


def test_the_c_scan_of_sparse_clients_agrees_with_the_torch_checks():
    """compress.sparse.scan (one parallel C++ pass over CPU clients of both index dtypes) finds the same first bad
    entry and the same non-finite values as the torch ops, so the messages naming them are the same."""
    from fastagg.compress.sparse import SparseUpdate, scan

    g = torch.Generator().manual_seed(9)
    d = 100_000
    cases = []
    for dtype in (torch.int32, torch.int64):
        ix = torch.randperm(d, generator=g)[:5000].sort().values.to(dtype)
        v = torch.randn(5000, generator=g)
        cases.append(SparseUpdate(ix, v, d))                                       # fine
        cases.append(SparseUpdate(ix[:0], v[:0], d))                               # empty
        cases.append(SparseUpdate(ix[:1], v[:1], d))                               # one entry
        late = ix.clone()
        late[-1] = late[-2]                                                        # duplicated at the end
        cases.append(SparseUpdate(late, v, d))
        early = ix.clone()
        early[1], early[2] = ix[2], ix[1]                                          # unsorted near the start
        cases.append(SparseUpdate(early, v, d))
        nan = v.clone()
        nan[4999] = float("nan")
        cases.append(SparseUpdate(ix, nan, d))
    found = scan(cases)
    assert found is not None and len(found) == len(cases)
    for u, (first, finite) in zip(cases, found):
        assert finite == bool(torch.isfinite(u.values).all())
        errors = []
        for hint in (None, first):
            try:
                u.check_indices("deltas[0]", hint)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        assert errors[0] == errors[1]
    assert [f for f, _ in found] == [-1, -1, -1, 4999, 2, -1] * 2


# the C++ backend on both lookup paths at full size; the others (the Triton interpreter is slow) once, smaller
CODE_BOOK_CASES = [(b, lk) for b in BACKENDS for lk in (("avx512", "gather") if b == "cpu" else ("any",))]


@pytest.mark.parametrize("backend, lookups", CODE_BOOK_CASES)
@pytest.mark.parametrize("block, m", [(4096, 5), (64, 3), (192, 40), (100, 4)])
def test_code_book_clients_fold_like_the_dequantized_oracle(backend, block, m, lookups, monkeypatch):
    """Codebook8 clients (FLARE's BLOCKWISE8 form: uint8 codes into a 256-entry book, an absmax per block) folded
    where they lie: on CPUs with AVX-512 VBMI the C++ fold looks codes up by byte permutes (tiles spanning blocks,
    clients in register groups of 32: m = 40 splits them), elsewhere (or FASTAGG_NO_AVX512=1) by gathers; both
    equal the float64 oracle, and a code whose book entry is NaN is refused naming the client."""
    from fastagg.compress import Codebook8

    if lookups == "gather":
        monkeypatch.setenv("FASTAGG_NO_AVX512", "1")
    g = torch.Generator().manual_seed(block + m)
    d = (2 * 65536 + 1001 if block != 4096 else 3 * 4096 + 77) if backend == "cpu" else 2 * max(block, 192) + 77
    m = m if backend == "cpu" else min(m, 5)
    book = torch.sort(torch.randn(256, generator=g)).values
    us = [Codebook8(torch.randint(0, 256, (d,), generator=g, dtype=torch.uint8),
                    torch.rand(-(-d // block), generator=g) + 0.5, block, book) for _ in range(m)]
    ws = [1.0 + (j % 5) for j in range(m)]
    oracle = sum(w * dequantize(u) for w, u in zip(ws, us)) / sum(ws)
    for dtype in (torch.float32, torch.float64):
        acc = fastagg.Accumulator(like=torch.zeros(d, dtype=dtype), backend=backend)
        assert acc.add_many(us, ws) == [True] * m
        mean = acc.weighted_sum / acc.total_weight
        assert_close(mean, oracle, rtol=0, atol=torch.finfo(dtype).eps * (m + 2) * float(oracle.abs().max()),
                     name="mean")
        assert_close(acc.sq_norms, [float(dequantize(u).square().sum()) for u in us], rtol=1e-12, atol=0,
                     name="norms")
        # without the clients' norms (the FedAvg family's fold: the kernel skips the squares): the same sum
        bare = fastagg.Accumulator(like=torch.zeros(d, dtype=dtype), backend=backend, client_norms=False)
        assert bare.add_many(us, ws) == [True] * m
        assert torch.equal(bare.weighted_sum, acc.weighted_sum)
        with pytest.raises(RuntimeError, match="client_norms=False"):
            bare.sq_norms
    nan_book = book.clone()
    nan_book[200] = float("nan")
    codes = us[-1].codes.clone()
    codes[d - 2] = 200
    bad = Codebook8(codes, us[-1].scales, block, nan_book)
    for norms in (True, False):  # a NaN book entry is found with or without the norms (the squares flag it)
        acc = fastagg.Accumulator(like=torch.zeros(d), backend=backend, client_norms=norms)
        with pytest.raises(ValueError, match="deltas\\[1\\].*NaN"):
            acc.add_many([us[0], bad])
        assert acc.num_clients == 0


def _dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed dynamic map (``create_dynamic_map(signed=True)``, the book FLARE's BLOCKWISE8 sends): 127
    negative means of linspace(0.1, 1) per decade, their negations, 0 and 1.0, sorted. tests_nvflare checks it
    against bitsandbytes' own."""
    data = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist() + ((-(10 ** (-6 + i))) * means).tolist()  # (float32 products)
    return torch.sort(torch.tensor(data + [0.0, 1.0])).values


def _symmetric_book(g, last: float) -> torch.Tensor:
    half = torch.sort(torch.rand(127, generator=g) * 3 + 0.01).values
    return torch.cat([-half.flip(0), torch.zeros(1), half, torch.tensor([last])])


@pytest.mark.parametrize("block, m", [(4096, 16), (64, 35), (100, 3)])
def test_sign_symmetric_code_books_fold_like_the_oracle_on_both_lookup_paths(block, m, monkeypatch):
    """A book whose codes c and 254 - c differ in the sign bit alone (bitsandbytes' dynamic map, which FLARE sends;
    any sign * magnitude book) is looked up by one byte permute per plane instead of two (the VBMI tile's symmetric
    form; code 255 by its own entry; on a CPU without VBMI or AVX2 both settings run the loop that exists there): the sums equal the gather path's bit for bit and the float64 oracle; a book
    one bit away from symmetric takes the general form and folds as exactly; a NaN entry a code points at (255, or
    a symmetric NaN pair) still names its client."""
    from fastagg.compress import Codebook8

    g = torch.Generator().manual_seed(block + m)
    d = 2 * 65536 + 1001
    near = _dynamic_map()
    near[40] = torch.nextafter(near[40], torch.tensor(0.0))
    books = {"dynamic map": _dynamic_map(), "symmetric, 255 = -7": _symmetric_book(g, -7.0),
             "one bit off": near}
    for name, book in books.items():
        codes = [torch.randint(0, 256, (d,), generator=g, dtype=torch.uint8) for _ in range(m)]
        codes[0][:300] = 255  # (the entry no half of the book holds)
        codes[1][:300] = 127
        us = [Codebook8(c, torch.rand(-(-d // block), generator=g) + 0.5, block, book) for c in codes]
        ws = [1.0 + (j % 5) for j in range(m)]
        oracle = sum(w * dequantize(u) for w, u in zip(ws, us)) / sum(ws)
        sums = {}
        for lookups in ("avx512", "gather"):
            monkeypatch.setenv("FASTAGG_NO_AVX512", "1" if lookups == "gather" else "0")
            for norms in (True, False):
                acc = fastagg.Accumulator(like=torch.zeros(d), backend="cpu", client_norms=norms)
                assert acc.add_many(us, ws) == [True] * m
                sums[lookups, norms] = acc.weighted_sum.clone()
                if norms:
                    assert_close(acc.sq_norms, [float(dequantize(u).square().sum()) for u in us], rtol=1e-12,
                                 atol=0, name=f"{name} norms")
        first = sums["avx512", True]
        assert all(torch.equal(s, first) for s in sums.values()), name
        assert_close(first / sum(ws), oracle, rtol=0, atol=torch.finfo(torch.float32).eps * (m + 2) *
                     float(oracle.abs().max()), name=name)
    nan_book = _symmetric_book(g, float("nan"))
    nan_book[10], nan_book[244] = float("nan"), -float("nan")
    assert (nan_book[10].view(torch.int32) ^ nan_book[244].view(torch.int32)) & 0x7FFFFFFF == 0
    clean = torch.randint(11, 244, (d,), generator=g, dtype=torch.uint8)
    for bad_code in (255, 10, 244):
        dirty = clean.clone()
        dirty[d // 2] = bad_code
        us = [Codebook8(clean, torch.ones(-(-d // block)), block, nan_book),
              Codebook8(dirty, torch.ones(-(-d // block)), block, nan_book)]
        for lookups in ("avx512", "gather"):
            monkeypatch.setenv("FASTAGG_NO_AVX512", "1" if lookups == "gather" else "0")
            for norms in (True, False):
                acc = fastagg.Accumulator(like=torch.zeros(d), backend="cpu", client_norms=norms)
                with pytest.raises(ValueError, match="deltas\\[1\\].*NaN"):
                    acc.add_many(us)
                assert acc.num_clients == 0
                acc.add_many(us[:1])
                assert torch.equal(acc.weighted_sum, dequantize(us[0], torch.float32))


def test_a_sparse_round_scans_its_clients_once_and_still_finds_a_nan(monkeypatch):
    """check_batch (index order) and nonfinite_scales (finite values) share one C++ scan of the sparse clients per
    round, in fedexp_step, a server optimizer and Accumulator.add_many; a NaN value found by it still raises naming
    the client, or with on_nonfinite="skip" leaves it out."""
    from fastagg.compress import fold, sparsify_topk
    from fastagg.server import FedAvg

    calls = []
    real = fold.scan
    monkeypatch.setattr(fold, "scan", lambda us: calls.append(len(us)) or real(us))
    g = torch.Generator().manual_seed(5)
    us = [sparsify_topk(torch.randn(3000, generator=g), 0.05) for _ in range(3)]
    fastagg.fedexp_step(us, eps=1e-3, backend="cpu")
    FedAvg([torch.zeros(3000)], backend="cpu").step(us)
    fastagg.Accumulator(like=torch.zeros(3000), backend="cpu").add_many(us)
    assert calls == [3, 3, 3]
    vals = us[1].values.clone()
    vals[7] = float("nan")
    nan = type(us[1])(us[1].indices, vals, us[1].numel)
    with pytest.raises(ValueError, match="deltas\\[1\\]"):
        fastagg.fedexp_step([us[0], nan, us[2]], eps=1e-3, backend="cpu")
    res = fastagg.fedexp_step([us[0], nan, us[2]], eps=1e-3, backend="cpu", on_nonfinite="skip")
    assert res.nonfinite.tolist() == [False, True, False]


def test_the_c_scans_of_scales_and_values_agree_with_the_torch_checks(monkeypatch):
    """The round's pre-check (compress.fold._part_status) reads CPU scales and sparse values by one C++ pass each
    kind; without the compiled module, torch ops: the same answers for NaN, +-Inf, zero and negative scales, at the
    first and last block, sparse NaN values, and strided scales (those take the torch path)."""
    from fastagg.backends import cpu
    from fastagg.compress import Int8Blockwise
    from fastagg.compress.fold import _part_status

    us = _mixed()
    base = us[0]
    parts = list(us)
    for at, v in [(0, float("nan")), (-1, float("inf")), (3, float("-inf")), (0, 0.0), (-1, -2.0), (5, 0.0)]:
        s = base.scales.clone()
        s[at] = v
        parts.append(Int8Blockwise(base.codes, s, base.block))
    wide = torch.stack([base.scales, base.scales], 1)[:, 0]  # strided
    parts.append(Int8Blockwise(base.codes, wide, base.block))
    sp = us[3]
    vals = sp.values.clone()
    vals[-1] = float("nan")
    parts.append(type(sp)(sp.indices, vals, sp.numel))
    got = _part_status(parts)
    monkeypatch.setattr(cpu, "IMPORT_ERROR", RuntimeError("pretend the module failed to load"))
    want = _part_status(parts)
    assert got == want
    n = base.scales.numel()
    assert [g for g in got[len(us):]] == [(False, -1), (False, -1), (False, 3), (True, 0), (True, n - 1),
                                          (True, 5), (True, -1), (False, -1)]
    with pytest.raises(TypeError, match="float32"):
        cpu.compiled().scale_scan([torch.ones(3, dtype=torch.float64).__dlpack__()])
