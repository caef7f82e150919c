"""The GPU's checks before a compressed fold (fastagg.backends.triton.quantized.compressed_scan, run here by the
Triton interpreter on CPU tensors): every part's verdict -- NaN/Inf, the first scale <= 0 or index not above the one
before, the largest scale, the smallest and largest index -- against a plain definition, across tiles; and the
hostile-client tests of the other files run again with CPU parts routed through it (on a GPU it replaces the
per-client host reads), so a hostile client is refused with the same error, nothing changed."""
from __future__ import annotations

import importlib
import math
import struct

import pytest
import torch

from fastagg.compress import Int8Blockwise, SparseUpdate, quantize_int8

import test_compress  # noqa: E402 (tests/ is on the path under pytest)
import test_compress_formats  # noqa: E402
import test_compress_hostile  # noqa: E402

# the hostile-client tests of those files, collected here again and run with the GPU's scan (the fixture below)
test_a_bad_int8_update_is_refused_naming_it_and_nothing_changes = \
    test_compress.test_a_bad_update_is_refused_naming_it_and_nothing_changes
test_a_nan_scale_in_a_round_raises_naming_it_or_skips_the_round = \
    test_compress.test_a_nan_scale_in_a_round_raises_naming_it_or_skips_the_round
test_add_many_with_skip_leaves_out_only_the_nonfinite_update = \
    test_compress.test_add_many_with_skip_leaves_out_only_the_nonfinite_update
test_an_update_that_would_overflow_the_sum_is_refused = \
    test_compress.test_an_update_that_would_overflow_the_sum_is_refused
test_wrong_size_block_mix_buffers_and_resend_are_refused = \
    test_compress.test_wrong_size_block_mix_buffers_and_resend_are_refused
test_a_bad_update_is_refused_naming_it_and_nothing_changes = \
    test_compress_formats.test_a_bad_update_is_refused_naming_it_and_nothing_changes
test_a_nan_float_client_beside_compressed_ones_is_raised_or_left_out = \
    test_compress_formats.test_a_nan_float_client_beside_compressed_ones_is_raised_or_left_out
test_a_client_beyond_float32_is_named_as_such_not_as_nan = \
    test_compress_hostile.test_a_client_beyond_float32_is_named_as_such_not_as_nan
test_large_finite_scales_whose_codes_stay_inside_float32_are_not_left_out = \
    test_compress_hostile.test_large_finite_scales_whose_codes_stay_inside_float32_are_not_left_out
test_one_client_beyond_float32_is_left_out_alone_and_the_honest_ones_aggregate = \
    test_compress_hostile.test_one_client_beyond_float32_is_left_out_alone_and_the_honest_ones_aggregate
test_robust_and_dp_rules_leave_out_a_scale_of_zero_or_below_which_every_fold_refuses = \
    test_compress_hostile.test_robust_and_dp_rules_leave_out_a_scale_of_zero_or_below_which_every_fold_refuses
test_robust_rules_leave_out_a_client_beyond_float32 = \
    test_compress_hostile.test_robust_rules_leave_out_a_client_beyond_float32

quantized = importlib.import_module("fastagg.backends.triton.quantized")
fold = importlib.import_module("fastagg.compress.fold")
NONE = 1 << 62
TILE = quantized._SCAN_TILE


@pytest.fixture(autouse=True)
def gpu_scan(monkeypatch):
    """Every compressed part scanned as on a GPU (by the Triton kernel), whatever its device; counts the scans."""
    calls = []

    def scanner(device):
        def scan(**kw):
            calls.append(len(kw["scales"]) + len(kw["values"]))
            return quantized.compressed_scan(**kw)
        return scan
    monkeypatch.setattr(fold, "_device_scanner", scanner)
    return calls


def _bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _want_scales(s: torch.Tensor) -> list:
    v = s.tolist()
    finite = [math.isfinite(x) for x in v]
    first = next((j for j, x in enumerate(v) if x <= 0), NONE)
    top = max([_bits(x) for x, ok in zip(v, finite) if ok and x > 0], default=0)
    return [0 if all(finite) else -1, first, -top, 0]


def _want_sparse(ix: torch.Tensor, v: torch.Tensor) -> list:
    i = ix.tolist()
    first = next((t for t in range(1, len(i)) if i[t] <= i[t - 1]), NONE)
    return [0 if all(math.isfinite(x) for x in v.tolist()) else -1, first, min(i, default=NONE),
            -max(i, default=-NONE)]


def test_the_scan_finds_what_the_definition_says_across_tiles():
    """Parts of one element to three tiles; each flaw alone, at the first and last element and across a tile's
    edge (an index equal to the one before it in the previous tile); int32 and int64 indices interleaved (the
    kernel runs per kind; the rows come back in the callers' order). A kernel that misses a tile, a mask or the
    element before a tile finds a different answer."""
    g = torch.Generator().manual_seed(3)
    scales = []
    for n in (1, 7, TILE - 1, TILE + 1, 2 * TILE + 5):
        s = torch.rand(n, generator=g) + 0.5
        scales.append(s)
        for at, x in ((0, float("nan")), (n - 1, float("inf")), (n // 2, float("-inf")), (n - 1, 0.0),
                      (0, -0.0), (n // 3, -1e-30), (n - 1, 3e38)):
            t = s.clone()
            t[at] = x
            scales.append(t)
    scales.append(torch.empty(0))
    scales.append(torch.full((TILE + 3,), float("nan")))
    values, indices = [], []
    for n in (1, 5, TILE, TILE + 1, 2 * TILE + 7):
        for dtype in (torch.int32, torch.int64):
            ix = torch.randperm(10 * n + 10, generator=g)[:n].sort().values.to(dtype)
            v = torch.randn(n, generator=g)
            cases = [(ix, v), (ix - 3, v), (ix + 2 ** 31 if dtype == torch.int64 else ix, v)]
            if n > 1:
                dup = ix.clone()
                dup[-1] = dup[-2]
                swap = ix.clone()
                swap[0], swap[1] = ix[1], ix[0]
                cases += [(dup, v), (swap, v), (ix.flip(0), v)]
            if n > TILE:
                edge = ix.clone()
                edge[TILE] = edge[TILE - 1]  # the pair straddles two programs
                cases.append((edge, v))
            nan = v.clone()
            nan[-1] = float("nan")
            cases.append((ix, nan))
            for a, b in cases:
                indices.append(a.contiguous())
                values.append(b.contiguous())
    indices.append(torch.empty(0, dtype=torch.int64))
    values.append(torch.empty(0))
    got = quantized.compressed_scan(scales=scales, values=values, indices=indices).tolist()
    want = [_want_scales(s) for s in scales] + [_want_sparse(i, v) for i, v in zip(indices, values)]
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a == b, (k, a, b)


def test_a_round_reads_every_clients_verdict_at_once(gpu_scan):
    """fedexp_step on 6 int8 and 3 sparse clients: one scan of all 9 parts (on a GPU: one host read for all of
    them), and the step equals the C++ backend's (which scans by C++ passes) bit for bit."""
    import fastagg
    from fastagg.compress import sparsify_topk

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3000, generator=g) for _ in range(9)]
    us = [quantize_int8(x, 64) for x in xs[:6]] + [sparsify_topk(x, 0.1) for x in xs[6:]]
    got = fastagg.fedexp_step(us, eps=1e-3, backend="cpu")
    assert gpu_scan == [9]
    gpu_scan.clear()
    fold._device_scanner = lambda device: None  # (the fixture's monkeypatch restores it)
    want = fastagg.fedexp_step(us, eps=1e-3, backend="cpu")
    assert gpu_scan == []
    assert torch.equal(got.mean_flat, want.mean_flat) and torch.equal(got.sq_norms, want.sq_norms)


def test_the_scans_records_agree_with_the_c_passes_and_give_the_bounds():
    """The GPU's records against the C++ passes' (first flaw, finite) for the same parts, plus what only the GPU
    scan gives: a sparse part's smallest and largest index and a blockwise part's largest scale times its largest
    code value."""
    g = torch.Generator().manual_seed(2)
    u = quantize_int8(torch.randn(5000, generator=g), 64)
    parts = [u]
    for at, x in ((0, float("nan")), (-1, 0.0), (5, -2.0)):
        s = u.scales.clone()
        s[at] = x
        parts.append(Int8Blockwise(u.codes, s, 64))
    ix = torch.arange(10, 5000, 7, dtype=torch.int32)
    parts.append(SparseUpdate(ix, torch.randn(ix.numel(), generator=g), 5000))
    bad = ix.clone()
    bad[100] = bad[99]
    parts.append(SparseUpdate(bad, torch.randn(ix.numel(), generator=g), 5000))
    gpu = fold._scan(parts)
    real = fold._device_scanner
    fold._device_scanner = lambda device: None
    try:
        cpp = fold._scan(parts)
    finally:
        fold._device_scanner = real
    for p in parts:
        assert (gpu[id(p)].first, gpu[id(p)].finite) == (cpp[id(p)].first, cpp[id(p)].finite)
    assert gpu[id(parts[4])].bounds == (10, int(ix[-1]))
    assert gpu[id(parts[0])].largest == float(u.scales.max()) * 127.0


def test_more_parts_than_a_grid_holds_are_scanned_in_chunks(monkeypatch):
    """A grid's second dimension holds at most 65535 programs (one a part: 1000 clients of 100 layers exceed it):
    parts go in chunks. With chunks of 2, five parts of each kind give the one-chunk answer."""
    g = torch.Generator().manual_seed(4)
    scales = [torch.rand(n, generator=g) - 0.1 for n in (3, 50, 7, 9000, 1)]
    indices = [torch.randperm(200, generator=g)[:n].sort().values.to(dt) for n, dt in
               ((5, torch.int32), (40, torch.int64), (2, torch.int32), (30, torch.int64), (9, torch.int32))]
    indices[3][7] = indices[3][6]
    values = [torch.randn(ix.numel(), generator=g) for ix in indices]
    values[2][1] = float("inf")
    whole = quantized.compressed_scan(scales=scales, values=values, indices=indices)
    monkeypatch.setattr(quantized, "_GRID_Y", 2)
    chunked = quantized.compressed_scan(scales=scales, values=values, indices=indices)
    assert torch.equal(chunked, whole)
    want = [_want_scales(s) for s in scales] + [_want_sparse(i, v) for i, v in zip(indices, values)]
    assert whole.tolist() == want
