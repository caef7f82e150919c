"""Fresh output buffers (the default mean and evaluation model of a round) that fault in cheaply.

A fresh 40 MB CPU tensor from ``torch.empty`` is faulted in 4 KiB page by page by its first write: ~8 ms on the
2-core VM, a quarter of a whole FedExP round. Large CPU outputs are instead mapped anonymously with
``MADV_HUGEPAGE`` (Linux transparent huge pages in ``madvise`` mode, this machine's default), which faults them in
2 MiB at a time: ~3.9 ms for the same 40 MB (measured, bench/RESULTS.md). The memory is owned by the tensor like
any other (``torch.frombuffer`` keeps the mapping alive while a view of it exists) and is never reused, so a
result can never be overwritten by a later call. Elsewhere (GPU, below 4 MB or above 256 MB, no ``madvise``)
``torch.empty``.
"""
from __future__ import annotations

import mmap
import warnings

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 4 << 20  # below this the page faults cost little
# Above this, huge-page faults stop paying on the VM: a fresh buffer written once, medians of 6 (2026-11-26):
# 40 MB 4.2 vs 8.9 ms, 100 MB 12.2 vs 22.2, 200 MB 17.6 vs 43.3, 400 MB 94 vs 85 ms with a 300 ms worst case
# (each 2 MiB fault of memory the host has not backed yet is slow).
MAX_BYTES = 256 << 20


def empty(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialized 1-D tensor of ``numel`` elements."""
    device = torch.device(device)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or not MIN_BYTES <= nbytes <= MAX_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(numel, dtype=dtype, device=device)
    size = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    try:
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return torch.empty(numel, dtype=dtype, device=device)
    with warnings.catch_warnings():  # frombuffer warns about non-writable buffers; this one is writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(region, dtype=dtype, count=numel)
