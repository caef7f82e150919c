"""FLARE's BLOCKWISE8 results folded where they lie: the clients' updates quantized by FLARE's own
``ModelQuantizer("blockwise8")`` (bitsandbytes' CPU kernels; FLARE's filter calls ``.cuda()``, made a no-op here:
this machine has no GPU), aggregated by FastaggAggregator without FLARE's ``ModelDequantizer``, against the same
aggregator fed FLARE's dequantized results. Bad quantized results are left out naming the site."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_opt.pt.quantization.dequantizer import ModelDequantizer
from nvflare.app_opt.pt.quantization.quantizer import ModelQuantizer

from fastagg.compress import Codebook8, LayerwiseUpdate, from_bitsandbytes
from fastagg.nvflare import FastaggAggregator

SHAPES = {"conv.weight": (16, 3, 5, 5), "fc.weight": (10, 700), "fc.bias": (10,)}  # 4096-blocks cross tensors


@pytest.fixture(autouse=True)
def _cpu_bitsandbytes(monkeypatch):
    """FLARE's quantization filters move every tensor to the GPU with .cuda(); bitsandbytes has CPU kernels."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)


def _flare_quantize(params: dict) -> tuple:
    q = ModelQuantizer("blockwise8")
    q.log_info = lambda *a, **k: None
    data, state, source = q.quantization({k: v.copy() for k, v in params.items()}, None)
    meta = {"processed_algorithm": "blockwise8", "quant_state": state, "source_datatype": source,
            "quantized_flag": True}
    return data, meta


def _flare_dequantize(data: dict, meta: dict) -> dict:
    dq = ModelDequantizer()
    dq.log_info = lambda *a, **k: None
    return dq.dequantization(params={k: np.array(v) for k, v in data.items()}, quant_state=meta["quant_state"],
                             quantization_type="blockwise8", source_datatype=meta["source_datatype"], fl_ctx=None)


def _updates(m: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [{k: (0.01 * (i + 1) * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
            for i in range(m)]


def _run(agg, sent, results):
    agg.reset_stats()
    agg.set_model(FLModel(params_type=ParamsType.FULL, params=sent, current_round=0))
    took = [agg.accept_model(r) for r in results]
    return took, agg.aggregate_model()


@pytest.mark.parametrize("rule, hyper", [("fedavg", {}), ("fedexp", {"eps": 1e-3}), ("fedadam", {"lr": 0.01})])
@pytest.mark.parametrize("kind", [ParamsType.DIFF, ParamsType.FULL])
def test_blockwise8_results_fold_like_flares_dequantized_ones(rule, hyper, kind):
    rng = np.random.default_rng(1)
    sent = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    ups = _updates(4)
    payload = ups if kind == ParamsType.DIFF else [{k: sent[k] + u[k] for k in u} for u in ups]
    quantized = [_flare_quantize(p) for p in payload]
    ours, theirs = FastaggAggregator(rule, hyper), FastaggAggregator(rule, hyper)
    steps = [10, 20, 30, 40]
    took, got = _run(ours, sent, [FLModel(params_type=kind, params=d, current_round=0,
                                          meta={**meta, "client_name": f"site-{i}", "NUM_STEPS_CURRENT_ROUND": n})
                                  for i, ((d, meta), n) in enumerate(zip(quantized, steps))])
    assert took == [True] * 4
    _, want = _run(theirs, sent, [FLModel(params_type=kind, params=_flare_dequantize(d, meta), current_round=0,
                                          meta={"client_name": f"site-{i}", "NUM_STEPS_CURRENT_ROUND": n})
                                  for i, ((d, meta), n) in enumerate(zip(quantized, steps))])
    for k in SHAPES:
        np.testing.assert_allclose(got.params[k], want.params[k], rtol=1e-5, atol=1e-6, err_msg=k)
        assert got.params[k].dtype == np.float32


def test_the_diff_fold_reads_the_quantized_bytes_and_equals_bitsandbytes_dequantize():
    from bitsandbytes.functional import dequantize_blockwise, quantize_blockwise

    x = torch.randn(10_000)
    q, st = quantize_blockwise(x)
    u = from_bitsandbytes(q, st.absmax, st.code)
    assert isinstance(u, Codebook8) and u.block == st.blocksize == 4096
    np.testing.assert_allclose(u.dequantize(torch.float32).numpy(), dequantize_blockwise(q, st).numpy(), rtol=1e-6,
                               atol=1e-7)
    import fastagg

    acc = fastagg.Accumulator(like=torch.zeros(10_000))
    acc.add(LayerwiseUpdate((u,)), 2.0)
    np.testing.assert_allclose(acc.weighted_sum.numpy(), 2 * dequantize_blockwise(q, st).numpy(), rtol=1e-6,
                               atol=1e-6)


def test_bitsandbytes_book_is_the_sign_symmetric_map_the_fast_lookup_reads():
    """The book FLARE's results carry (bitsandbytes' signed dynamic map) is the one tests/test_compress_formats.py
    builds, and it is sign-symmetric about code 127 (codes c and 254 - c differ in the sign bit alone), so the C++
    fold looks it up by one byte permute per plane (csrc/quantized.cpp, table_sign_symmetric)."""
    import importlib.util
    import pathlib

    from bitsandbytes.functional import quantize_blockwise

    path = pathlib.Path(__file__).parents[1] / "tests" / "test_compress_formats.py"
    spec = importlib.util.spec_from_file_location("formats", path)
    formats = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(formats)
    _, st = quantize_blockwise(torch.randn(5000))
    book = st.code.float()
    assert torch.equal(book, formats._dynamic_map())
    bits = book.view(torch.int32)
    assert all(int(bits[c]) ^ int(bits[254 - c]) == -2 ** 31 for c in range(127))


def test_code_books_are_converted_once_and_each_result_read_through_its_own():
    """FLARE sends a copy of the book per tensor and site: equal books become one tensor, converted and checked for
    NaN once (kept across rounds); a site with another book (halved here) or with a NaN entry that none of its codes
    points at is folded through its own, as FLARE's dequantizer reads it; a kept book is a copy, so the sender
    changing its array after the result was accepted changes nothing."""
    rng = np.random.default_rng(3)
    sent = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    quantized = [_flare_quantize(u) for u in _updates(3, seed=3)]
    for st in quantized[1][1]["quant_state"].values():
        st["code"] = st["code"] * np.float32(0.5)
    bias = quantized[2]
    unused = sorted(set(range(256)) - set(np.asarray(bias[0]["fc.bias"]).tolist()))
    bias[1]["quant_state"]["fc.bias"]["code"] = bias[1]["quant_state"]["fc.bias"]["code"].copy()
    bias[1]["quant_state"]["fc.bias"]["code"][unused[0]] = np.nan
    want = []
    for d, m in quantized:  # each result dequantized through its own book (fastagg's float64 oracle)
        parts = {k: from_bitsandbytes(d[k], m["quant_state"][k]["absmax"], m["quant_state"][k]["code"])
                 for k in SHAPES}
        want.append({k: np.nan_to_num(p.dequantize(torch.float64).numpy()).reshape(SHAPES[k]).astype(np.float32)
                     for k, p in parts.items()})
    ref = FastaggAggregator("fedavg")
    _, expected = _run(ref, sent, [FLModel(params_type=ParamsType.DIFF, params=w, current_round=0,
                                           meta={"client_name": f"site-{i}"}) for i, w in enumerate(want)])
    agg = FastaggAggregator("fedavg")
    for _ in range(2):
        agg.reset_stats()
        agg.set_model(FLModel(params_type=ParamsType.FULL, params=sent, current_round=0))
        took = [agg.accept_model(FLModel(params_type=ParamsType.DIFF, params=d, current_round=0,
                                         meta={**m, "client_name": f"site-{i}"})) for i, (d, m) in enumerate(quantized)]
        assert took == [True] * 3
        saved = quantized[0][1]["quant_state"]["conv.weight"]["code"].copy()
        quantized[0][1]["quant_state"]["conv.weight"]["code"] *= 2  # after it was accepted
        got = agg.aggregate_model()
        quantized[0][1]["quant_state"]["conv.weight"]["code"][:] = saved
        for k in SHAPES:
            np.testing.assert_allclose(got.params[k], expected.params[k], rtol=1e-6, atol=1e-6, err_msg=k)
    assert len(agg._books._known) == 3  # bitsandbytes' map, the halved one, the one with a NaN entry


@pytest.mark.parametrize("corrupt, match", [
    (lambda d, m: m["quant_state"]["fc.weight"].__setitem__("absmax", np.ones(1, np.float32)), "need 2 scales"),
    (lambda d, m: m["quant_state"]["fc.bias"].__setitem__("code", np.full(256, np.nan, np.float32)), "NaN"),
    (lambda d, m: m["quant_state"]["fc.bias"].__setitem__("code", np.zeros(256)), "float32"),
    (lambda d, m: m["quant_state"]["fc.bias"].__setitem__("code", np.zeros(255, np.float32)), "256"),
    (lambda d, m: m["quant_state"]["fc.bias"].__setitem__("code", ["x"] * 256), "malformed"),
    (lambda d, m: m["quant_state"]["fc.bias"].__setitem__("absmax", np.ones(1, ">f4")), "byte order"),
    (lambda d, m: m["quant_state"]["conv.weight"]["absmax"].__setitem__(0, np.inf), "NaN or Inf"),
    (lambda d, m: d.__setitem__("fc.bias", np.zeros(3, np.uint8)), "has shape"),
    (lambda d, m: m.__setitem__("processed_algorithm", "float4"), "ModelDequantizer"),
    (lambda d, m: m["quant_state"].__setitem__("fc.bias", {}), "was not quantized"),
])
def test_a_bad_quantized_result_is_left_out_naming_the_site(corrupt, match, caplog):
    rng = np.random.default_rng(2)
    sent = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    good, bad = (_flare_quantize(u) for u in _updates(2))
    corrupt(*bad)
    agg = FastaggAggregator("fedavg")
    with caplog.at_level(logging.WARNING):
        took, out = _run(agg, sent, [FLModel(params_type=ParamsType.DIFF, params=d, current_round=0,
                                             meta={**m, "client_name": f"site-{i}"}) for i, (d, m) in
                                     enumerate([good, bad])])
    assert took == [True, False]
    assert any("site-1" in r.message and (match in r.message or match == "NaN") for r in caplog.records), \
        [r.message for r in caplog.records]
    ref = FastaggAggregator("fedavg")
    _, want = _run(ref, sent, [FLModel(params_type=ParamsType.DIFF, params=_flare_dequantize(*good), current_round=0,
                                       meta={"client_name": "site-0"})])
    for k in SHAPES:
        np.testing.assert_allclose(out.params[k], want.params[k], rtol=1e-6, atol=1e-7)
