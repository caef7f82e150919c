"""Compressed updates with hostile fields: a block far beyond the update's size allocates nothing beyond it, a
client whose values lie beyond float32 is left out alone, scales <= 0 are refused by the folds and left out by the
robust rules and DP, the quantizers write only scales the server accepts (or raise naming the block; top-k /
random-k the entry), and the compiled coordinate-select binding checks its window without overflowing."""
from __future__ import annotations

import contextlib
import resource

import pytest
import torch

import fastagg
from fastagg import privacy, robust, server
from fastagg.compress import (Fp8Blockwise, Int8Blockwise, dequantize, quantize_fp8, quantize_fp8_rows,
                              quantize_int8, quantize_int8_rows, quantize_qsgd)
from fastagg.compress.int8 import MAX_BLOCK
from fastagg.testing import cpu_backends

BACKENDS = cpu_backends()
F32_MAX = float(torch.finfo(torch.float32).max)
SMALLEST_SUBNORMAL = 2.0 ** -149


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


@contextlib.contextmanager
def _address_space_headroom(extra: int):
    """The process may map at most ``extra`` more bytes (RLIMIT_AS) while inside: an allocation sized by a hostile
    field (16 GiB) fails instead of paging the shared machine out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + extra
    if hard != resource.RLIM_INFINITY:  # a process may only lower its limit: the tighter of the two still holds
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# -- 1. a block far beyond d --------------------------------------------------------------------------------------
def test_a_block_far_beyond_the_update_allocates_nothing_beyond_its_size():
    """A 10-element update in one block of 2^31 - 1 (what a ~200-byte Flower reply may say) was dequantized through
    ``scales.repeat_interleave(block)``: 16 GiB of float64. Every reader now allocates O(d)."""
    d = 10
    codes = torch.tensor([1, -2, 3, -4, 5, -6, 7, -8, 9, 127], dtype=torch.int8)
    hostile = Int8Blockwise(codes, torch.tensor([0.5]), MAX_BLOCK)
    honest = Int8Blockwise(codes, torch.tensor([0.5]), 16)
    want = codes.to(torch.float64) * 0.5  # the definition: s_b * q_j, one block
    x = torch.linspace(-1, 1, d, dtype=torch.float64)
    for backend in ("reference", *BACKENDS):  # thread pools and allocator arenas mapped before the limit
        fastagg.fedavg_step([honest, honest], backend=backend)
    server.FedAvg([torch.zeros(d)], aggregate=robust.Median()).step([honest, honest, honest])
    quantize_qsgd(x, 4, seed=1)
    with _address_space_headroom(2 << 30):
        assert torch.equal(dequantize(hostile), want)
        for backend in ("reference", *BACKENDS):
            got = fastagg.fedavg_step([hostile, honest], backend=backend)
            assert torch.allclose(got.mean_flat.double(), want, rtol=1e-6, atol=0), backend
        params = torch.zeros(d)
        server.FedAvg([params], aggregate=robust.Median()).step([hostile, honest, honest])
        assert torch.allclose(params.double(), want, rtol=1e-6, atol=0)
        # the client side: a block (or QSGD bucket) far beyond d pads nothing
        assert torch.equal(dequantize(quantize_int8(x, MAX_BLOCK)), dequantize(quantize_int8(x, d)))
        assert torch.equal(dequantize(quantize_int8_rows(x[None], MAX_BLOCK, backend="reference")[0]),
                           dequantize(quantize_int8(x, d)))
        assert torch.equal(dequantize(quantize_fp8_rows(x[None], MAX_BLOCK, backend="reference")[0]),
                           dequantize(quantize_fp8(x, d)))
        assert torch.equal(quantize_qsgd(x, 4, bucket=MAX_BLOCK, seed=1).codes, quantize_qsgd(x, 4, seed=1).codes)


# -- 2. one client beyond float32 ---------------------------------------------------------------------------------
def _beyond_float32(d: int, block: int = 8) -> Int8Blockwise:
    """Finite float32 scales whose codes stand for values beyond float32: 127 x 3e37 = 3.8e39."""
    return Int8Blockwise(torch.full((d,), 127, dtype=torch.int8), torch.full((-(-d // block),), 3e37), block)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_client_beyond_float32_is_left_out_alone_and_the_honest_ones_aggregate(backend):
    d = 16
    honest = [quantize_int8(torch.full((d,), float(i + 1)), 8) for i in range(2)]
    bad = _beyond_float32(d)
    want = (dequantize(honest[0]) + dequantize(honest[1])) / 2
    params = torch.zeros(d)
    opt = server.FedAvg([params], backend=backend, on_nonfinite="skip")
    st = opt.step([honest[0], bad, honest[1]])
    assert bool(st.finite) and torch.allclose(params.double(), want, rtol=1e-6, atol=0)
    acc = fastagg.Accumulator(like=torch.zeros(d), backend=backend)
    assert acc.add_many([honest[0], bad, honest[1]], on_nonfinite="skip") == [True, False, True]
    assert acc.num_clients == 2 and torch.allclose(acc.weighted_sum.double(), 2 * want, rtol=1e-6, atol=0)
    # "raise": refused naming it, nothing changed
    params = torch.zeros(d)
    with pytest.raises(ValueError, match=r"deltas\[1\]"):
        server.FedAvg([params], backend=backend).step([honest[0], bad, honest[1]])
    assert torch.equal(params, torch.zeros(d))
    with pytest.raises(ValueError, match=r"deltas\[1\]"):
        fastagg.fedavg_step([honest[0], bad, honest[1]], backend=backend)
    # a code book entry reaching the overflow, and fp8's 448 x 1e36: beyond float32 too
    fp8 = Fp8Blockwise(torch.full((d,), 448.0).to(torch.float8_e4m3fn), torch.full((2,), 1e36), 8)
    acc = fastagg.Accumulator(like=torch.zeros(d), backend=backend)
    assert acc.add_many([honest[0], fp8], on_nonfinite="skip") == [True, False]


def test_large_finite_scales_whose_codes_stay_inside_float32_are_not_left_out():
    """The overflow check reads the codes of a block whose scale could overflow: small codes there are fine."""
    d = 8
    u = Int8Blockwise(torch.tensor([1, -2, 0, 3, 1, 1, 1, 1], dtype=torch.int8), torch.tensor([1e38]), 8)
    acc = fastagg.Accumulator(like=torch.zeros(d, dtype=torch.float64))
    assert acc.add_many([u], on_nonfinite="skip") == [True]
    assert torch.equal(acc.weighted_sum, dequantize(u))


# -- 3. the quantizers write what the server accepts ----------------------------------------------------------------
QUANTIZERS = [("int8", lambda x, be: quantize_int8_rows(x, 4, backend=be)),
              ("int8-stochastic", lambda x, be: quantize_int8_rows(x, 4, stochastic=True, seed=3, backend=be)),
              ("fp8", lambda x, be: quantize_fp8_rows(x, 4, backend=be))]


@pytest.mark.parametrize("name, quantize", QUANTIZERS)
@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_subnormal_and_zero_blocks_quantize_to_scales_the_server_accepts(name, quantize, backend, dtype):
    """Blocks of subnormal float32 values (absmax / 127 underflows to 0 in float32) got the scale 0; now a scale
    > 0 with |x| / s <= the largest code, round-tripped client -> server against the definition."""
    tiny = torch.tensor([SMALLEST_SUBNORMAL, -3 * SMALLEST_SUBNORMAL, 0.0, 2 * SMALLEST_SUBNORMAL,  # block 0
                         0.0, 0.0, 0.0, 0.0,  # an all-zero block
                         1e-40, -2e-40, 5e-41, 0.0,  # subnormal float32 absmax: scale 1e-40 / 127 subnormal
                         1.0, -0.5, 0.25, 0.0], dtype=dtype)  # a normal block
    rows = torch.stack([tiny, -tiny])
    us = quantize(rows, backend)
    top = 448.0 if name == "fp8" else 127.0
    for u, x in zip(us, rows):
        s = u.scales.to(torch.float64)
        assert bool((s > 0).all()) and bool(torch.isfinite(s).all()), s
        amax = x.to(torch.float64).abs().view(-1, 4).amax(1)
        assert bool((amax / s <= top * (1 + 2.0 ** -23)).all())  # inside the codes' range (a normal scale rounds)
        # every element within the format's step of its scale (int8: half a step, stochastic: one)
        err = (dequantize(u) - x.to(torch.float64)).abs()
        step = s.repeat_interleave(4)
        bound = step if name == "int8-stochastic" else step / 2 if name == "int8" else \
            torch.maximum(2.0 ** -4 * x.to(torch.float64).abs(), 2.0 ** -10 * step)
        assert bool((err <= bound * (1 + 1e-6)).all()), (err, bound)
    # the server takes them
    params = torch.zeros(16, dtype=torch.float64)
    st = server.FedAvg([params]).step(us)
    assert bool(st.finite)
    assert torch.allclose(params, (dequantize(us[0]) + dequantize(us[1])) / 2, rtol=0, atol=1e-300)


def test_the_fused_quantizers_give_the_definitions_subnormal_scales_bit_for_bit():
    x = torch.tensor([[SMALLEST_SUBNORMAL, 0, 0, 0], [1e-40, 0, 0, 0], [3e-39, 1e-39, 0, 0], [1.0, 0, 0, 0]],
                     dtype=torch.float32).reshape(1, -1)
    for be in BACKENDS:
        for q in (lambda r, b: quantize_int8_rows(r, 4, backend=b), lambda r, b: quantize_fp8_rows(r, 4, backend=b),
                  lambda r, b: quantize_int8_rows(r, 4, stochastic=True, backend=b)):
            got, want = q(x, be)[0], q(x, "reference")[0]
            assert torch.equal(got.scales, want.scales) and torch.equal(got.code_bytes(), want.code_bytes()), be


@pytest.mark.parametrize("name, quantize", QUANTIZERS + [
    ("qsgd", lambda x, be: [quantize_qsgd(r, 4, bucket=4) for r in x])])
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_values_beyond_float32_are_refused_naming_the_block(name, quantize, backend):
    """float64 updates beyond float32's range had an Inf scale (or codes standing for Inf) written silently."""
    x = torch.ones(2, 12, dtype=torch.float64)
    x[1, 9] = 1e39  # row 1, block 2
    with pytest.raises(ValueError, match="row 1, block 2 holds values beyond float32" if name != "qsgd" else
                       "block 2 holds values beyond float32"):
        quantize(x, backend)
    x[1, 9] = 1e300  # the scale itself beyond float32
    with pytest.raises(ValueError, match="block 2 holds values beyond float32"):
        quantize(x, backend)
    x[1, 9] = F32_MAX  # the largest float32 is representable
    assert all(bool(torch.isfinite(dequantize(u).float()).all()) for u in quantize(x[:, :8], backend))


@pytest.mark.parametrize("big", [1e39, 1e300])
def test_sparsification_refuses_values_beyond_float32_naming_the_entry(big):
    """top-k / random-k of a float64 update beyond float32 sent Inf values silently, and with error feedback left
    -Inf in the client's residual (every later round poisoned): now refused naming the entry, the state unchanged."""
    from fastagg.client import ClientState, compress_updates
    from fastagg.compress import sparsify_randk, sparsify_topk

    x = torch.zeros(2, 10, dtype=torch.float64)
    x[:, 1] = 1.0
    x[1, 7] = big
    with pytest.raises(ValueError, match=r"entry 7 is .*beyond float32"):
        sparsify_topk(x[1], 0.2)
    with pytest.raises(ValueError, match=r"entry 7 is .*beyond float32"):
        sparsify_randk(x[1], 1.0)
    with pytest.raises(ValueError, match=r"d / k, beyond float32"):  # 4e37 x d / k = 4e38
        sparsify_randk(torch.full((10,), 4e37), k=1, unbiased=True)
    assert torch.equal(sparsify_topk(torch.tensor([F32_MAX, 1.0], dtype=torch.float64), k=1).values,
                       torch.tensor([F32_MAX]))  # the largest float32 is sent as it is
    state = ClientState(2, 10, dtype=torch.float64)
    compress_updates(torch.arange(20, dtype=torch.float64).reshape(2, 10) / 20, "topk:0.2", state=state,
                     client_ids=[0, 1])  # a round that leaves a residual behind
    residual = state.vector("residual").clone()
    assert bool(residual.abs().sum() > 0)
    with pytest.raises(ValueError, match=r"row 1, entry 7 is .*beyond float32"):
        compress_updates(x, "topk:0.2", state=state, client_ids=[0, 1])
    assert torch.equal(state.vector("residual"), residual) and bool(torch.isfinite(residual).all())


# -- 4. one check of scales for every path --------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [0.0, -1.0, -0.0])
@pytest.mark.parametrize("rule", [lambda: robust.Median(), lambda: robust.TrimmedMean(0.2),
                                  lambda: privacy.ServerSideFixedClipping(0.0, 1.0, 5)])
def test_robust_and_dp_rules_leave_out_a_scale_of_zero_or_below_which_every_fold_refuses(scale, rule):
    """The rules that read every client (robust, DP) leave out a client no quantizer writes, as they leave out a
    NaN one (an attack: reported in ``excluded``); the plain folds, which see only the sum, refuse it naming it."""
    d = 8
    xs = [torch.linspace(-1, 1, d) * (i + 1) for i in range(5)]
    us = [quantize_int8(x, 4) for x in xs]
    bad = us[3].scales.clone()
    bad[1] = scale
    us[3] = Int8Blockwise(us[3].codes, bad, 4)
    params = torch.ones(d)
    st = server.FedAvg([params], aggregate=rule(), on_nonfinite="skip").step(us)
    assert st.robust.excluded.tolist() == [False, False, False, True, False]
    assert bool(torch.isfinite(params).all())
    params.copy_(torch.ones(d))
    with pytest.raises(ValueError, match=r"deltas\[3\]: the scale of block 1"):  # (the plain fold)
        server.FedAvg([params], on_nonfinite="skip").step(us)
    assert torch.equal(params, torch.ones(d))


def test_robust_rules_leave_out_a_client_beyond_float32():
    d = 8
    us = [quantize_int8(torch.linspace(-1, 1, d) * (i + 1), 4) for i in range(4)] + [_beyond_float32(d, 4)]
    params = torch.zeros(d, dtype=torch.float64)
    st = server.FedAvg([params], aggregate=robust.Median(), on_nonfinite="skip").step(us)
    want = torch.stack([dequantize(u) for u in us[:4]]).median(0)
    assert bool(torch.isfinite(params).all())
    lo, hi = torch.stack([dequantize(u) for u in us[:4]]).sort(0).values[1:3]
    assert torch.allclose(params, (lo + hi) / 2, rtol=1e-12, atol=0), (params, want)
    assert st is not None


# -- 5. the coordinate-select binding ------------------------------------------------------------------------------
@pytest.mark.parametrize("first, count", [(2 ** 63 - 1, 1), (1, 2 ** 63 - 1), (2 ** 62, 2 ** 62),
                                          (2 ** 63 - 2, 2), (-1, 2), (0, 0), (-(2 ** 63), 1), (3, 2),
                                          (0, -(2 ** 63))])
def test_the_coord_select_binding_refuses_a_window_outside_the_clients_without_wrapping(first, count):
    """first + count wrapped in int64 (INT64_MAX + 1 < M passed): the kernel then read far outside the rows."""
    from fastagg.backends.cpu import compiled

    m, d = 4, 8
    x = torch.randn(m, d)
    out, sq = torch.full((d,), 7.0), torch.zeros(m, dtype=torch.float64)
    bad = torch.zeros(m, dtype=torch.bool)
    with pytest.raises(ValueError, match="coord_select: sorted positions"):
        compiled().coord_select(x.__dlpack__(), None, [d], 0, first, count, out.__dlpack__(), sq.__dlpack__(),
                                bad.__dlpack__())
    assert torch.equal(out, torch.full((d,), 7.0))
    compiled().coord_select(x.__dlpack__(), None, [d], 0, 1, 3, out.__dlpack__(), sq.__dlpack__(), bad.__dlpack__())
    assert torch.allclose(out, x.sort(0).values[1:4].mean(0))  # the last window inside still works


def test_a_client_beyond_float32_is_named_as_such_not_as_nan():
    """An int8 update of scale 3e38 and codes 127 is finite but stands for values beyond float32: refused by the
    fold naming it as that (the message said only 'NaN or Inf scale or value')."""
    d = 64
    bad = Int8Blockwise(torch.full((d,), 127, dtype=torch.int8), torch.full((2,), 3e38), 32)
    acc = fastagg.Accumulator(like=torch.zeros(d))
    with pytest.raises(ValueError, match=r"deltas\[0\] has a NaN or Inf scale or value, or codes standing for "
                                         r"values beyond float32"):
        acc.add_many([bad], [1.0])
    assert acc.num_clients == 0
