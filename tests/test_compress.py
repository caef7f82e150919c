"""int8 blockwise clients (fastagg.compress) folded where they lie, on every backend, against a float64 oracle that
dequantizes first; bad input refused naming the client with the accumulator unchanged."""
from __future__ import annotations

import math

import pytest
import torch

import fastagg
from fastagg import server
from fastagg.asynchronous import AsyncServer, Constant
from fastagg.compress import Int8Blockwise, dequantize, quantize_int8
from fastagg.testing import assert_close, cpu_backends

BACKENDS = cpu_backends()
D = 5003  # not a multiple of any block: the last block is short


def _clients(m, d=D, block=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(d, generator=g, dtype=dtype) * (1 + i) for i in range(m)]
    return xs, [quantize_int8(x, block) for x in xs]


def _sum_atol(oracle: torch.Tensor, m: int, dtype: torch.dtype) -> float:
    """float32 sums of m terms: each add rounds by at most half an ulp of the running magnitude."""
    return m * torch.finfo(dtype).eps * float(oracle.abs().max()) + 1e-300


def _state(acc):
    return (acc.weighted_sum.clone(), float(acc.weighted_sq_norm_sum), acc.total_weight, acc.num_clients,
            list(acc.client_ids))


def _same_state(a, b):
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


# -- the format ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [1, 7, 64, 256, 4096, 10_000])
def test_quantize_error_bound_codes_and_bytes(block):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(D, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, D, dtype=torch.float64)
    x[:block] = 0.0  # an all-zero block: scale 1, codes 0, exact
    u = quantize_int8(x, block)
    blocks = math.ceil(D / block)
    assert u.codes.dtype == torch.int8 and u.scales.dtype == torch.float32 and u.scales.numel() == blocks
    assert int(u.codes.min()) >= -127 and int(u.codes.max()) <= 127
    assert u.nbytes == D + 4 * blocks
    xt = dequantize(u)
    s = u.scales.to(torch.float64).repeat_interleave(block)[:D]
    assert bool(((x - xt).abs() <= s / 2 * (1 + 1e-6)).all())  # half a step of the block's scale
    assert float(u.scales[0]) == 1.0 and torch.equal(xt[:block], x[:block])
    assert bool((u.scales > 0).all())


def test_quantize_takes_a_state_dict_in_flat_order_and_refuses_nan():
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 3))
    sd = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    u = quantize_int8(sd, 32)
    flat = torch.cat([v.reshape(-1) for v in sd.values()])
    assert_close(dequantize(u), flat, rtol=0, atol=float(flat.abs().max()) / 127, name="dequantized")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_int8(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="block"):
        quantize_int8(torch.ones(4), 0)


@pytest.mark.parametrize("make, match", [
    (lambda: Int8Blockwise(torch.zeros(10, dtype=torch.int16), torch.ones(1), 16), "codes must be a 1-D torch.int8"),
    (lambda: Int8Blockwise(torch.zeros(10, dtype=torch.int8), torch.ones(1, dtype=torch.float64), 16), "scales"),
    (lambda: Int8Blockwise(torch.zeros(10, dtype=torch.int8), torch.ones(2), 16), "need 1 scales, got 2"),
    (lambda: Int8Blockwise(torch.zeros(10, dtype=torch.int8), torch.ones(1), 0), "block"),
    (lambda: Int8Blockwise(torch.zeros(10, dtype=torch.int8), torch.ones(1), True), "block"),
    (lambda: Int8Blockwise(torch.zeros(2, 5, dtype=torch.int8), torch.ones(1), 16), "1-D"),
])
def test_a_malformed_update_is_refused_when_built(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()


# -- folded where they lie ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block", [1, 64, 3000])
def test_accumulator_folds_int8_clients_like_the_dequantized_oracle(backend, dtype, block):
    _, us = _clients(5, block=block)
    ws = [1.0, 2.0, 0.5, 3.0, 0.0]
    oracle = sum(w * dequantize(u) for w, u in zip(ws, us))
    sq_oracle = sum(w * float((dequantize(u) ** 2).sum()) for w, u in zip(ws, us))
    many = fastagg.Accumulator(like=torch.zeros(D, dtype=dtype), backend=backend)
    assert many.add_many(us, ws, client_ids=list(range(5))) == [True] * 5
    one = fastagg.Accumulator(like=torch.zeros(D, dtype=dtype), backend=backend)
    for i, (u, w) in enumerate(zip(us, ws)):
        assert one.add(u, w, client_id=i)
    for acc in (many, one):
        assert acc.weighted_sum.dtype == dtype and acc.num_clients == 5 and acc.total_weight == sum(ws)
        assert_close(acc.weighted_sum, oracle, rtol=0, atol=_sum_atol(oracle, 5, dtype), name="sum")
        assert_close(acc.weighted_sq_norm_sum, sq_oracle, rtol=1e-12, atol=0, name="sq")
        assert_close(acc.sq_norms, [float((dequantize(u) ** 2).sum()) for u in us], rtol=1e-12, atol=0,
                     name="norms")


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block, m", [(192, 5), (320, 70), (64, 3), (100, 4)])
def test_cpu_tiles_spanning_blocks_across_chunks_and_client_groups(dtype, block, m, isa, monkeypatch):
    """The C++ sweep lets a tile hold many blocks (block a multiple of 64): 192 and 320 put block boundaries
    inside its 65536-column chunks and chunk boundaries inside blocks; m = 70 splits the clients into register
    groups of 64; block 100 keeps one block per tile. Norms per client are exact (integer squares per block).
    float32 int8 tiles run on AVX-512 VNNI where the CPU has it, else (or FASTAGG_NO_AVX512=1) on AVX2."""
    if isa == "avx2":
        monkeypatch.setenv("FASTAGG_NO_AVX512", "1")
    d = 2 * 65536 + 777
    xs, us = _clients(m, d=d, block=block, seed=block)
    ws = [0.5 + (i % 7) for i in range(m)]
    oracle = sum(w * dequantize(u) for w, u in zip(ws, us))
    acc = fastagg.Accumulator(like=torch.zeros(d, dtype=dtype), backend="cpu")
    assert acc.add_many(us, ws) == [True] * m
    assert_close(acc.weighted_sum, oracle, rtol=0, atol=_sum_atol(oracle, m, dtype), name="sum")
    assert_close(acc.sq_norms, [float((dequantize(u) ** 2).sum()) for u in us], rtol=1e-12, atol=0, name="norms")
    before = _state(acc)
    for at in (70, 65536 + 200, d - 5):  # inside a register group of 64, in the second chunk, in a tile's tail
        bad = Int8Blockwise(us[-1].codes.clone(), us[-1].scales, block)
        bad.codes[at] = -128
        with pytest.raises(ValueError, match="deltas\\[2\\] holds the code -128"):
            acc.add_many(us[:2] + [bad], client_ids=["a", "b", "c"])
        assert _same_state(before, _state(acc))
    from fastagg.compress import quantize_fp8  # fp8 e4m3 tiles span blocks alike

    f8 = [quantize_fp8(x, block) for x in xs]
    oracle = sum(w * dequantize(u) for w, u in zip(ws, f8))
    acc = fastagg.Accumulator(like=torch.zeros(d, dtype=dtype), backend="cpu")
    assert acc.add_many(f8, ws) == [True] * m
    assert_close(acc.weighted_sum, oracle, rtol=0, atol=_sum_atol(oracle, m, dtype), name="fp8 sum")
    assert_close(acc.sq_norms, [float((dequantize(u) ** 2).sum()) for u in f8], rtol=1e-12, atol=0,
                 name="fp8 norms")
    from fastagg.compress import Fp8Blockwise

    for at, code in ((70, 0x7F), (65536 + 200, 0xFF), (d - 3, 0xFF)):
        nan = f8[-1].codes.view(torch.uint8).clone()
        nan[at] = code
        with pytest.raises(ValueError, match="deltas\\[1\\].*NaN code"):
            acc.add_many(f8[:1] + [Fp8Blockwise(nan.view(torch.float8_e4m3fn), f8[-1].scales, block)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mixed_round_steps_fedexp_as_on_the_dequantized_updates(backend):
    xs, us = _clients(6, block=128, seed=3)
    floats = xs[:3]  # three clients send float32, three int8
    acc = fastagg.Accumulator(like=torch.zeros(D), backend=backend)
    for x in floats:
        acc.add(x, 2.0)
    acc.add_many(us[3:], [1.0, 1.0, 1.0])
    got = acc.fedexp_step(eps=1e-3)
    deltas = [x.double() for x in floats] + [dequantize(u) for u in us[3:]]
    want = fastagg.fedexp_step(deltas, eps=1e-3, weights=[2.0, 2.0, 2.0, 1.0, 1.0, 1.0], backend="reference")
    assert_close(got.eta, want.eta, rtol=1e-5, atol=0, name="eta")
    assert_close(got.mean, want.mean, rtol=1e-5, atol=1e-6 * float(want.mean.abs().max()), name="mean")


@pytest.mark.parametrize("name, kw", [("FedAvg", {}), ("FedAvgM", {"momentum": 0.9}), ("FedAdam", {"lr": 0.1}),
                                      ("FedYogi", {"lr": 0.1}), ("FedExP", {"eps": 1e-3})])
def test_server_optimizers_step_on_int8_clients_as_on_their_dequantized_updates(name, kw):
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 4))  # parameters only: no buffers
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ref = {k: v.double() for k, v in params.items()}
    opt = getattr(server, name)(params, **kw)
    oracle = getattr(server, name)(ref, backend="reference", **kw)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        ups = [{k: 0.01 * torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(4)]
        us = [quantize_int8(u, 256) for u in ups]
        acc = fastagg.Accumulator(like=params)
        acc.add_many(us, [1.0, 2.0, 3.0, 4.0])
        opt.step(acc)
        deq = [dict(zip(params, torch.split(dequantize(u), [v.numel() for v in params.values()]))) for u in us]
        oracle.step([{k: t.reshape(params[k].shape) for k, t in d.items()} for d in deq], [1.0, 2.0, 3.0, 4.0])
    for k in params:
        assert_close(params[k], ref[k], rtol=1e-5, atol=1e-6, name=k)


def test_the_async_server_takes_int8_updates_with_their_staleness_discount():
    w = torch.zeros(D, dtype=torch.float64)
    srv = AsyncServer(server.FedAvg(w), buffer_size=2, staleness=Constant())
    _, us = _clients(2, dtype=torch.float64)
    srv.submit(us[0], 0)
    srv.submit(us[1], 0)
    assert srv.version == 1
    assert_close(w, (dequantize(us[0]) + dequantize(us[1])) / 2, rtol=1e-12, atol=1e-12, name="w")


# -- bad input ---------------------------------------------------------------------------------------------------
def _with(u, codes=None, scales=None):
    return Int8Blockwise(u.codes.clone() if codes is None else codes, u.scales.clone() if scales is None else scales,
                         u.block)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad, match", [("nan-scale", "NaN or Inf scale"), ("inf-scale", "NaN or Inf scale"),
                                        ("zero-scale", "must be > 0"), ("negative-scale", "must be > 0"),
                                        ("code-128", "-128")])
def test_a_bad_update_is_refused_naming_it_and_nothing_changes(backend, bad, match):
    _, us = _clients(3)
    acc = fastagg.Accumulator(like=torch.zeros(D), backend=backend)
    acc.add(us[0], client_id="a")
    before = _state(acc)
    u = us[1]
    if bad == "code-128":
        codes = u.codes.clone()
        codes[D - 1] = -128
        u = _with(u, codes=codes)
    else:
        scales = u.scales.clone()
        scales[3] = {"nan-scale": float("nan"), "inf-scale": float("inf"), "zero-scale": 0.0,
                     "negative-scale": -1.0}[bad]
        u = _with(u, scales=scales)
    with pytest.raises(ValueError, match=match):
        acc.add_many([us[2], u], client_ids=["b", "c"])
    assert _same_state(_state(acc), before)
    with pytest.raises(ValueError, match=match):
        acc.add(u, client_id="c")
    assert _same_state(_state(acc), before)
    if bad in ("nan-scale", "inf-scale"):  # a non-finite update: on_nonfinite="skip" leaves it out
        assert acc.add(u, on_nonfinite="skip") is False and _same_state(_state(acc), before)


def test_wrong_size_block_mix_buffers_and_resend_are_refused():
    _, us = _clients(2)
    acc = fastagg.Accumulator(like=torch.zeros(D))
    with pytest.raises(ValueError, match=f"has {D - 1} elements; the accumulator's `like` has {D}"):
        acc.add(quantize_int8(torch.ones(D - 1), 64))
    with pytest.raises(TypeError, match="deltas\\[1\\] is a dict: beside compressed updates"):
        acc.add_many([us[0], {"w": torch.ones(D)}])
    with pytest.raises(TypeError, match="base="):
        acc.add(us[0], base=torch.zeros(D))
    acc.add(us[0], client_id=7)
    with pytest.raises(ValueError, match="already folded"):
        acc.add(us[1], client_id=7)
    assert acc.num_clients == 1
    bn = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    with_buffers = fastagg.Accumulator(like=bn)
    with pytest.raises(ValueError, match="carries no buffers"):
        with_buffers.add(quantize_int8(torch.ones(sum(p.numel() for p in bn.parameters()))))


def test_an_update_that_would_overflow_the_sum_is_refused():
    acc = fastagg.Accumulator(like=torch.zeros(8))
    one = torch.tensor([127, 0, 0, 0, 0, 0, 0, 0], dtype=torch.int8)
    huge = Int8Blockwise(one, torch.full((1,), 3e38 / 127), 8)  # x~_0 = 3e38, the rest 0
    acc.add(huge)
    before = _state(acc)
    with pytest.raises(ValueError, match="overflow"):  # 3e38 + 3e38: the sum, not the client, is beyond float32
        acc.add(huge)
    assert _same_state(_state(acc), before)
    assert acc.add(huge, on_nonfinite="skip") is False and _same_state(_state(acc), before)
    # a client whose own values lie beyond float32 (127 x 3e38) is non-finite, as a NaN scale is
    beyond = Int8Blockwise(torch.full((8,), 127, dtype=torch.int8), torch.full((1,), 3e38), 8)
    with pytest.raises(ValueError, match="NaN or Inf"):
        acc.add(beyond)
    assert acc.add(beyond, on_nonfinite="skip") is False and _same_state(_state(acc), before)


def test_the_cpu_binding_checks_what_it_is_handed():
    from fastagg.backends.cpu import compiled

    c = compiled()
    d = 100
    q, s = torch.zeros(d, dtype=torch.int8), torch.ones(2)
    coef = torch.ones(1, dtype=torch.float64)
    out, sq = torch.zeros(d), torch.zeros(1, dtype=torch.float64)
    bad, msq = torch.zeros(1, dtype=torch.bool), torch.zeros(1, dtype=torch.float64)

    def call(codes=None, scales=None, block=64, coef_=None, init=None, out_=None):
        c.blockwise_fold([(codes if codes is not None else q).__dlpack__()],
                         [(scales if scales is not None else s).__dlpack__()], block, None, False,
                         (coef_ if coef_ is not None else coef).__dlpack__(),
                              None if init is None else init.__dlpack__(), (out_ if out_ is not None else out).__dlpack__(),
                              sq.__dlpack__(), bad.__dlpack__(), msq.__dlpack__())

    call()
    shifted = torch.zeros(d + 1)
    for kw, match in [({"codes": torch.zeros(d - 1, dtype=torch.int8)}, "codes\\[0\\] has 99 elements"),
                      ({"codes": torch.zeros(d, dtype=torch.int16)}, "unsupported dtype|int8"),
                      ({"scales": torch.ones(3)}, "scales\\[0\\] has 3 elements"),
                      ({"scales": torch.tensor([1.0, -1.0])}, "scale of block 1"),
                      ({"scales": torch.tensor([1.0, float("nan")])}, "scale of block 1"),
                      ({"block": 0}, "block must be >= 1"),
                      ({"block": 10}, "has 2 elements; expected 10"),
                      ({"coef_": torch.tensor([float("inf")], dtype=torch.float64)}, "coef"),
                      ({"init": shifted[1:], "out_": shifted[:d]}, "overlaps"),  # (init = out is in place)
                      ({"codes": torch.zeros(2 * d, dtype=torch.int8)[::2]}, "contiguous")]:
        with pytest.raises((ValueError, TypeError), match=match):
            call(**kw)


# -- the functional round and the optimizers' lists --------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_fedexp_step_on_int8_clients_is_one_sweep_equal_to_the_oracle(backend):
    _, us = _clients(6, block=128, seed=4)
    w = torch.randn(D, generator=torch.Generator().manual_seed(9))
    ref = w.double().clone()
    weights = [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]
    got = fastagg.fedexp_step(us, eps=1e-3, weights=weights, params=w, backend=backend)
    want = fastagg.fedexp_step([dequantize(u) for u in us], eps=1e-3, weights=weights, params=ref,
                               backend="reference")
    assert_close(got.eta, want.eta, rtol=1e-5, atol=0, name="eta")
    assert_close(got.sq_norms, want.sq_norms, rtol=1e-12, atol=0, name="norms")
    assert_close(w, ref, rtol=1e-5, atol=1e-6, name="params")
    plain = fastagg.fedavg_step(us, weights=weights, backend=backend)
    assert_close(plain.mean_flat, want.mean_flat, rtol=1e-5, atol=1e-6 * float(want.mean_flat.abs().max()),
                 name="mean")


def test_a_nan_scale_in_a_round_raises_naming_it_or_skips_the_round():
    _, us = _clients(3)
    scales = us[1].scales.clone()
    scales[0] = float("nan")
    us[1] = _with(us[1], scales=scales)
    w = torch.zeros(D)
    with pytest.raises(ValueError, match=r"deltas\[1\]"):
        fastagg.fedexp_step(us, eps=1e-3, params=w)
    res = fastagg.fedexp_step(us, eps=1e-3, params=w, on_nonfinite="skip")
    assert not bool(res.finite) and torch.equal(w, torch.zeros(D))


def test_a_server_optimizer_takes_a_list_of_int8_clients():
    params = torch.zeros(D, dtype=torch.float64)
    ref = params.clone()
    opt = server.FedAdam(params, lr=0.1)
    oracle = server.FedAdam(ref, lr=0.1, backend="reference")
    for seed in range(3):
        _, us = _clients(4, seed=seed, dtype=torch.float64)
        opt.step(us, [1.0, 2.0, 3.0, 4.0])
        oracle.step([dequantize(u) for u in us], [1.0, 2.0, 3.0, 4.0])
    assert_close(params, ref, rtol=1e-10, atol=1e-12, name="params")
    _, us = _clients(2)
    scales = us[0].scales.clone()
    scales[2] = float("inf")
    us[0] = _with(us[0], scales=scales)
    before = params.clone()
    with pytest.raises(ValueError, match="NaN or Inf scale"):
        opt.step(us)
    assert torch.equal(params, before)
    skip = server.FedAvg(params, on_nonfinite="skip")
    skip.step(us)  # the client with an Inf scale is left out, the other stepped
    assert_close(params, before + dequantize(us[1]), rtol=1e-6, atol=1e-7, name="params")
    before = params.clone()
    with pytest.raises(TypeError, match="deltas\\[1\\] is a list: beside compressed updates"):
        opt.step([us[1], [torch.zeros(D)]])
    assert torch.equal(params, before)


def test_add_many_with_skip_leaves_out_only_the_nonfinite_update():
    _, us = _clients(3)
    scales = us[1].scales.clone()
    scales[0] = float("nan")
    us[1] = _with(us[1], scales=scales)
    acc = fastagg.Accumulator(like=torch.zeros(D))
    assert acc.add_many(us, on_nonfinite="skip") == [True, False, True]
    oracle = dequantize(us[0]) + dequantize(us[2])
    assert_close(acc.weighted_sum, oracle, rtol=0, atol=_sum_atol(oracle, 2, torch.float32), name="sum")


@pytest.mark.parametrize("block, m, d", [(256, 16, 65536 + 4099), (192, 70, 2 * 65536 + 77), (100, 3, 5003)])
def test_the_avx512_and_avx2_one_byte_tiles_give_the_same_bits(block, m, d, monkeypatch):
    """Where the CPU has AVX-512 the float32 int8 (VNNI) and fp8 folds run 64 columns in four zmm registers, else
    in eight ymm ones: each column gets the same float32 FMAs in the same client order, so the round's mean is bit
    for bit the AVX2 path's, and for int8 the norms and ||mean||^2 too (integer squares); fp8's float64 squares are
    summed over other lanes (tails of a tile, tiles spanning blocks, client groups of 64 / 32)."""
    from fastagg.compress import quantize_fp8

    xs, us = _clients(m, d=d, block=block, seed=d)
    ws = [1.0 + (i % 3) for i in range(m)]
    for clients, exact_norms in ((us, True), ([quantize_fp8(x, block) for x in xs], False)):
        got = []
        for flag in ("0", "1"):
            monkeypatch.setenv("FASTAGG_NO_AVX512", flag)
            r = fastagg.fedexp_step(clients, eps=1e-3, weights=ws, backend="cpu")
            got.append((r.mean_flat, r.sq_norms, r.mean_sq_norm))
        assert torch.equal(got[0][0], got[1][0])
        for a, b in zip(got[0][1:], got[1][1:]):
            assert torch.equal(a, b) if exact_norms else torch.allclose(a, b, rtol=1e-14, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_clients_than_one_sweep_keeps_in_registers(backend):
    """70 clients (the AVX2 path folds 64 at a time) and a size whose tiles end in a partial group of 32."""
    _, us = _clients(70, d=1000 + 17, block=512, seed=11)
    acc = fastagg.Accumulator(like=torch.zeros(1017), backend=backend)
    acc.add_many(us)
    oracle = sum(dequantize(u) for u in us)
    assert_close(acc.weighted_sum, oracle, rtol=0, atol=_sum_atol(oracle, 70, torch.float32), name="sum")
    assert_close(acc.sq_norms, [float((dequantize(u) ** 2).sum()) for u in us], rtol=1e-12, atol=0, name="norms")


def test_stochastic_rounding_is_unbiased_keyed_and_reproducible():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, generator=g, dtype=torch.float64)
    a = quantize_int8(x, 64, stochastic=True, seed=7, round=3, client=1)
    assert torch.equal(a.codes, quantize_int8(x, 64, stochastic=True, seed=7, round=3, client=1).codes)
    for other in ({"seed": 8}, {"round": 4}, {"client": 2}):
        kw = {"seed": 7, "round": 3, "client": 1, **other}
        assert not torch.equal(a.codes, quantize_int8(x, 64, stochastic=True, **kw).codes), other
    s = a.scales.to(torch.float64).repeat_interleave(64)[:300]
    assert bool(((dequantize(a) - x).abs() < s).all())  # within one step (floor or ceil)
    mean = sum(dequantize(quantize_int8(x, 64, stochastic=True, seed=k)) for k in range(400)) / 400
    # unbiased: each coordinate's average of 400 draws is within 5 standard errors (<= s/2 / sqrt(400))
    assert bool(((mean - x).abs() <= 5 * (s / 2) / 20).all())
    det = dequantize(quantize_int8(x, 64))
    assert float((det - x).abs().max()) <= float(s.max()) / 2 * (1 + 1e-6)
    with pytest.raises(ValueError, match="seed"):
        quantize_int8(x, 64, stochastic=True, seed=-1)
    with pytest.raises(ValueError, match="client"):
        quantize_int8(x, 64, stochastic=True, client=2 ** 32)
