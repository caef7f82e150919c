"""Fresh output buffers (fastagg/_buffers.py): huge-page mappings for mid-sized CPU outputs, torch.empty elsewhere;
every buffer is its own memory, alive as long as a view of it is."""
from __future__ import annotations

import gc
import mmap

import pytest
import torch

from fastagg import _buffers


@pytest.mark.parametrize("nbytes", [4 << 10, _buffers.MIN_BYTES, 40 << 20, _buffers.MAX_BYTES + (4 << 20)])
def test_fresh_buffers_are_writable_distinct_and_outlive_the_call(nbytes):
    n = nbytes // 4
    a, b = _buffers.empty(n, torch.float32, "cpu"), _buffers.empty(n, torch.float32, "cpu")
    assert a.shape == (n,) and a.dtype == torch.float32 and a.is_contiguous()
    assert a.data_ptr() != b.data_ptr()
    view = a[n // 2:]
    del a
    gc.collect()
    view.fill_(3.0)
    b.fill_(5.0)
    assert float(view.sum()) == 3.0 * view.numel() and float(b[-1]) == 5.0


def test_which_sizes_are_mapped_with_huge_pages(monkeypatch):
    mapped = []
    real = mmap.mmap

    def spy(*args, **kw):
        mapped.append(args[1])
        return real(*args, **kw)

    monkeypatch.setattr(mmap, "mmap", spy)
    _buffers.empty((1 << 20) // 4, torch.float32, "cpu")          # 1 MB: plain
    _buffers.empty((40 << 20) // 4, torch.float32, "cpu")         # 40 MB: mapped
    _buffers.empty((_buffers.MAX_BYTES + (2 << 20)) // 8, torch.float64, "cpu")  # above the cap: plain
    t = _buffers.empty(10 << 20, torch.float32, "meta")           # not the CPU: plain
    assert t.device.type == "meta"
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert mapped == [40 << 20]
    else:
        assert mapped == []
