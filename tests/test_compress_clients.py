"""Client-side compression (fastagg.client.compress_updates, fastagg.compress.spec) and the simulator's
--compress: specs parsed or refused clearly, the batched quantizers equal the one-client ones row by row, error
feedback keeps exactly what was not sent, bytes_sent in metrics.csv and the summary, checkpoints resume it."""
from __future__ import annotations

import csv

import pytest
import torch

from fastagg import client
from fastagg.testing import cpu_backends
from fastagg.compress import (dequantize, quantize_fp8, quantize_int8, quantize_int8_rows, quantize_qsgd,
                              sparsify_randk, sparsify_topk)
from fastagg.compress.spec import Compression, parse, sent_bytes


@pytest.mark.parametrize("spec, want", [
    ("int8", Compression("int8")),
    ("int8:block=64,stochastic", Compression("int8", block=64, stochastic=True)),
    ("fp8:block=128", Compression("fp8", block=128)),
    ("qsgd:s=4,bucket=512", Compression("qsgd", levels=4, bucket=512)),
    ("topk:0.01", Compression("topk", fraction=0.01, error_feedback=True)),
    ("randk:0.1,ef=0", Compression("randk", fraction=0.1, error_feedback=False)),
    ("bf16", Compression("bf16")),
    (" none ", Compression("none")),
])
def test_specs_parse_and_print_back(spec, want):
    got = parse(spec)
    assert got == want and parse(str(got)) == got


@pytest.mark.parametrize("spec, match", [
    ("int4", "unknown compression 'int4'"), ("int8:block=0", "block must be an integer >= 1"),
    ("qsgd:s=300", "s must be an integer in \\[1, 127\\]"), ("topk:2", "fraction must be a number in \\(0, 1\\]"),
    ("fp8:stochastic", "not a setting of fp8"), ("topk:0.1,ef=yes", "ef must be 0 or 1"), ("", "a compression spec"),
    ("int8:blok=64", "'blok' is not a setting of int8"),
])
def test_bad_specs_are_refused_naming_what_is_wrong(spec, match):
    with pytest.raises(ValueError, match=match):
        parse(spec)


def test_the_batched_quantizers_equal_the_one_client_ones_row_by_row():
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    ids = [3, 9, 11, 40]
    for spec, one in [("int8:block=64,stochastic", lambda r, c: quantize_int8(r, 64, stochastic=True, seed=5,
                                                                              round=2, client=c)),
                      ("fp8:block=64", lambda r, c: quantize_fp8(r, 64)),
                      ("qsgd:s=8,bucket=100", lambda r, c: quantize_qsgd(r, 8, bucket=100, seed=5, round=2, client=c)),
                      ("topk:0.02,ef=0", lambda r, c: sparsify_topk(r, 0.02)),
                      ("randk:0.02,ef=0", lambda r, c: sparsify_randk(r, 0.02, seed=5, round=2, client=c))]:
        got = client.compress_updates(x, spec, client_ids=ids, seed=5, round=2)
        for i, c in enumerate(ids):
            assert torch.equal(dequantize(got[i]), dequantize(one(x[i], c))), (spec, i)


def test_error_feedback_keeps_exactly_what_was_not_sent_and_sends_it_later():
    g = torch.Generator().manual_seed(1)
    state = client.ClientState(6, 50)
    first = torch.randn(3, 50, generator=g)
    sent = client.compress_updates(first, "topk:0.1", state=state, client_ids=[0, 2, 5])
    dense = torch.stack([dequantize(u, torch.float32) for u in sent])
    assert torch.allclose(state.vector("residual")[[0, 2, 5]], first - dense)
    assert bool((state.vector("residual")[[1, 3, 4]] == 0).all())  # clients that sat out keep theirs
    zero = torch.zeros(3, 50)
    again = client.compress_updates(zero, "topk:0.1", state=state, client_ids=[0, 2, 5])
    total = dense + torch.stack([dequantize(u, torch.float32) for u in again])
    # over rounds everything is sent: what was sent plus what is kept equals what the client had
    assert torch.allclose(total + state.vector("residual")[[0, 2, 5]], first, atol=1e-6)
    with pytest.raises(ValueError, match="pass state="):
        client.compress_updates(first, "topk:0.1")
    sd = state.state_dict()
    other = client.ClientState(6, 50)
    other.load_state_dict(sd)
    assert torch.equal(other.vector("residual"), state.vector("residual"))


def test_sent_bytes_counts_what_goes_on_the_wire():
    x = torch.randn(2, 1000)
    assert sent_bytes(client.compress_updates(x, "none")) == 2 * 4000
    assert sent_bytes(client.compress_updates(x, "bf16")) == 2 * 2000
    assert sent_bytes(quantize_int8_rows(x, 256)) == 2 * (1000 + 4 * 4)
    assert sent_bytes(client.compress_updates(x, "topk:0.01,ef=0")) == 2 * 10 * 8


def _metrics(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_the_simulator_compresses_counts_bytes_and_resumes(tmp_path):
    from fastagg.sim.runner import Config, run

    cfg = dict(dataset="digits", algorithms=("fedavg",), rounds=3, seeds=(0,), compress="topk:0.1")
    run(Config(**cfg, out=str(tmp_path / "a")))
    rows = _metrics(tmp_path / "a" / "metrics.csv")
    sent = [int(r["bytes_sent"]) for r in rows]
    assert sent[0] == 0 and sent[1] > 0 and sent[2] == 2 * sent[1] and sent[3] == 3 * sent[1]
    summary = _metrics(tmp_path / "a" / "summary.csv")
    assert float(summary[0]["bytes_per_round"]) == sent[1]
    # two rounds, then one more resumed from the checkpoint: the same metrics (error feedback residuals and the
    # byte count travel in it)
    run(Config(**{**cfg, "rounds": 2}, out=str(tmp_path / "b")))
    run(Config(**cfg, out=str(tmp_path / "b")), resume=True)
    again = _metrics(tmp_path / "b" / "metrics.csv")
    assert [float(r["bytes_sent"]) for r in again] == [float(r["bytes_sent"]) for r in rows]
    assert [r["train_loss"] for r in again] == [r["train_loss"] for r in rows]
    with pytest.raises(ValueError, match="--compress runs in the synchronous mode"):
        run(Config(**cfg, mode="async"))


def test_the_compression_tradeoff_experiment_writes_its_table_and_plot(tmp_path, monkeypatch):
    from fastagg.sim import compression_tradeoff as ct

    monkeypatch.setattr(ct, "SPECS", {"fp32": "none", "int8": "int8:block=256", "top-k 5% + EF": "topk:0.05"})
    assert ct.main(["--out", str(tmp_path), "--rounds", "2", "--seeds", "0"]) == 0
    rows = [line for line in (tmp_path / "COMPRESSION.md").read_text().splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["fp32", "int8", "top-k 5% + EF"]
    assert "3.94x smaller" in rows[2]
    assert (tmp_path / "accuracy_vs_bytes.png").stat().st_size > 1000


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block", [1, 7, 64, 256, 5000])
@pytest.mark.parametrize("stochastic", [False, True])
def test_the_fused_cpu_int8_quantizer_writes_the_definitions_codes_bit_for_bit(dtype, block, stochastic):
    """quantize_int8_rows on CPU rows runs the C++ kernel (csrc/quantized.h); the torch ops are the definition:
    the same scales and codes for every row, block, rounding mode and input dtype (ties and all-zero blocks too)."""
    from fastagg.compress import int8

    g = torch.Generator().manual_seed(block)
    x = (torch.randn(5, 1003, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, 1003, dtype=torch.float64))
    x[1, :block] = 0.0                                   # an all-zero block
    x[2, :8] = torch.tensor([0.5, 1.5, -2.5, 127.0, -127.0, 63.5, 0.0, -0.5], dtype=torch.float64)  # ties
    x = x.to(dtype)
    ids = [0, 1, 7, 2 ** 32 - 1, 12345]
    fused = int8.quantize_int8_rows(x, block, stochastic=stochastic, seed=2 ** 63 + 5, round=9, clients=ids)
    plain = int8._torch_rows(x, block, stochastic, 2 ** 63 + 5, 9, ids)
    for a, b in zip(fused, plain):
        assert torch.equal(a.scales, b.scales) and torch.equal(a.codes, b.codes)


def test_the_cpu_int8_quantizer_binding_checks_what_it_is_handed():
    from fastagg.backends.cpu import compiled

    c = compiled()
    x, codes, scales = torch.zeros(2, 10), torch.zeros(20, dtype=torch.int8), torch.zeros(2, dtype=torch.float32)
    c.quantize_int8_rows(x.__dlpack__(), 16, False, 0, 0, [0, 1], codes.__dlpack__(), scales.__dlpack__())
    for kw, match in [(dict(clients=[0]), "2 rows but 1 client ids"), (dict(block=0), "block must be >= 1"),
                      (dict(codes=torch.zeros(19, dtype=torch.int8)), "codes_out has 19 elements"),
                      (dict(scales=torch.zeros(3)), "scales_out has 3 elements"),
                      (dict(x=torch.zeros(2, 10, dtype=torch.int32)), "floating|float32"),
                      (dict(x=torch.zeros(4, 10)[::2]), "contiguous"),
                      (dict(clients=[0, 2 ** 32]), "below 2\\^32"),
                      (dict(codes=x.view(torch.int8)[0, :20]), "overlaps")]:
        a = {**dict(x=x, block=16, clients=[0, 1], codes=codes, scales=scales), **kw}
        with pytest.raises((ValueError, TypeError), match=match):
            c.quantize_int8_rows(a["x"].__dlpack__(), a["block"], False, 0, 0, a["clients"], a["codes"].__dlpack__(),
                                 a["scales"].__dlpack__())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block", [1, 7, 64, 256, 5000])
def test_the_fused_cpu_fp8_quantizer_writes_the_definitions_codes_bit_for_bit(dtype, block):
    """quantize_fp8_rows on CPU rows runs the C++ kernel; the torch ops (float32 -> float8_e4m3fn) are the
    definition: the same scales and codes over magnitudes from 1e-6 to 1e6, all-zero blocks and every dtype."""
    from fastagg.compress import fp8

    g = torch.Generator().manual_seed(block + 1)
    x = (torch.randn(5, 1003, generator=g, dtype=torch.float64) * torch.logspace(-6, 6, 1003, dtype=torch.float64))
    x[1, :block] = 0.0
    x = x.to(dtype)
    fused = fp8.quantize_fp8_rows(x, block)
    plain = fp8._torch_rows(x, block)
    for a, b in zip(fused, plain):
        assert a.codes.dtype == torch.float8_e4m3fn
        assert torch.equal(a.scales, b.scales) and torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "reference"])
def test_the_fused_fp8_rounding_matches_torch_at_every_boundary(backend):
    """Scale 1 (each row's absmax is 448): every e4m3 value, the midpoints between neighbours (ties to even), one
    float32 ulp either side of each midpoint, and the subnormal range down to 0: the C++ and Triton codes equal
    torch's conversion."""
    from fastagg.compress import fp8

    vals = fp8.e4m3_table().to(torch.float64)
    finite = vals[~vals.isnan()].unique()                 # sorted, -448 .. 448
    mids = (finite[1:] + finite[:-1]) / 2
    m32 = mids.to(torch.float32)
    near = torch.cat([m32, torch.nextafter(m32, torch.tensor(float("inf"))),
                      torch.nextafter(m32, torch.tensor(float("-inf")))]).to(torch.float64)
    tiny = torch.linspace(-2.0 ** -6, 2.0 ** -6, 4001, dtype=torch.float64)
    probe = torch.cat([finite, near, tiny])
    row = torch.cat([torch.tensor([448.0], dtype=torch.float64), probe])
    got = fp8.quantize_fp8_rows(row[None], row.numel(), backend=backend)[0]
    want = fp8._torch_rows(row[None], row.numel())[0]
    assert float(got.scales[0]) == 1.0
    assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))


def test_the_cpu_fp8_quantizer_binding_checks_what_it_is_handed():
    from fastagg.backends.cpu import compiled

    c = compiled()
    x, codes, scales = torch.zeros(2, 10), torch.zeros(20, dtype=torch.int8), torch.zeros(2, dtype=torch.float32)
    c.quantize_fp8_rows(x.__dlpack__(), 16, codes.__dlpack__(), scales.__dlpack__())
    for kw, match in [(dict(block=0), "block must be >= 1"),
                      (dict(codes=torch.zeros(19, dtype=torch.int8)), "codes_out has 19 elements"),
                      (dict(scales=torch.zeros(3)), "scales_out has 3 elements"),
                      (dict(x=torch.zeros(2, 10, dtype=torch.int32)), "floating|float32"),
                      (dict(x=torch.zeros(4, 10)[::2]), "contiguous"),
                      (dict(x=torch.zeros(20)), "2-D"),
                      (dict(codes=x.view(torch.int8)[0, :20]), "overlaps")]:
        a = {**dict(x=x, block=16, codes=codes, scales=scales), **kw}
        before = a["codes"].clone()
        with pytest.raises((ValueError, TypeError), match=match):
            c.quantize_fp8_rows(a["x"].__dlpack__(), a["block"], a["codes"].__dlpack__(), a["scales"].__dlpack__())
        assert torch.equal(a["codes"], before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 255, 256, 1002])
def test_the_fused_quantizers_refuse_a_nan_or_inf_anywhere(dtype, bad, where):
    """The fused CPU quantizers check finiteness as they read (no separate pass): a NaN or Inf in any row and
    block (the first, a block's last, the next block's first, the short last block) raises for int8 (both
    roundings) and fp8, as the torch path does."""
    from fastagg.compress import fp8, int8

    x = torch.randn(3, 1003, generator=torch.Generator().manual_seed(where), dtype=dtype)
    x[2, where] = bad
    calls = [lambda: int8.quantize_int8_rows(x, 256), lambda: int8.quantize_int8_rows(x, 256, stochastic=True),
             lambda: fp8.quantize_fp8_rows(x, 256), lambda: quantize_int8(x[2], 64)]
    for call in calls:
        with pytest.raises(ValueError, match="NaN or Inf"):
            call()


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "reference"])
@pytest.mark.parametrize("block, d", [(64, 1003), (64, 8292), (100, 250), (4096, 5000)])  # 8292: three
@pytest.mark.parametrize("stochastic", [False, True])  # programs of the Triton kernel's 64 blocks a row, the last short
def test_every_backends_int8_quantizer_writes_the_definitions_codes(backend, block, d, stochastic):
    """The C++ kernel and the Triton one (run by the interpreter here; CUDA rows on a GPU) against the torch-op
    definition (``backend="reference"``): the same scales and codes, Philox words included (seed above 2^63,
    client ids up to 2^32 - 1), ties to even; a NaN in any block raises."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(3, d, generator=g, dtype=torch.float64) * torch.logspace(-2, 2, d, dtype=torch.float64)
    x[0, :4] = torch.tensor([0.5, 1.5, -2.5, 0.0], dtype=torch.float64) * float(x[0].abs().max()) / 127
    x = x.to(torch.float32)
    kw = dict(stochastic=stochastic, seed=2 ** 63 + 11, round=3, clients=[0, 7, 2 ** 32 - 1])
    got = quantize_int8_rows(x, block, backend=backend, **kw)
    want = quantize_int8_rows(x, block, backend="reference", **kw)
    for a, b in zip(got, want):
        assert torch.equal(a.scales, b.scales) and torch.equal(a.codes, b.codes)
    x[2, d - 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_int8_rows(x, block, backend=backend, **kw)


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "reference"])
@pytest.mark.parametrize("block, d", [(64, 1003), (64, 8292), (100, 350), (4096, 5000)])
def test_every_backends_fp8_quantizer_writes_the_definitions_codes(backend, block, d):
    """The C++ and Triton fp8 quantizers against the torch-op definition: magnitudes over twelve decades (so every
    e4m3 exponent, the subnormals and zero occur), every e4m3 midpoint; a NaN raises."""
    from fastagg.compress import fp8

    g = torch.Generator().manual_seed(d)
    x = torch.randn(3, d, generator=g, dtype=torch.float64) * torch.logspace(-6, 6, d, dtype=torch.float64)
    vals = fp8.e4m3_table().to(torch.float64)
    finite = vals[~vals.isnan()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    x[1, :1] = 448.0
    x[1, 1:1 + mids.numel()] = mids
    x = x.to(torch.float32)
    got = fp8.quantize_fp8_rows(x, block, backend=backend)
    want = fp8.quantize_fp8_rows(x, block, backend="reference")
    for a, b in zip(got, want):
        assert torch.equal(a.scales, b.scales)
        assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
    x[0, 5] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        fp8.quantize_fp8_rows(x, block, backend=backend)
