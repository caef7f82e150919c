"""Fresh output buffers (the default mean and evaluation model of a round) that fault in cheaply.

A fresh 40 MB CPU tensor from ``torch.empty`` is faulted in 4 KiB page by page by its first write: ~8 ms on the
2-core VM, a quarter of a whole FedExP round. Large CPU outputs are instead mapped anonymously with
``MADV_HUGEPAGE`` (Linux transparent huge pages in ``madvise`` mode, this machine's default), which faults them in
2 MiB at a time: ~3.9 ms for the same 40 MB (measured, bench/RESULTS.md). The memory is owned by the tensor like
any other (``torch.frombuffer`` keeps the mapping alive while a view of it exists) and is never reused, so a
result can never be overwritten by a later call. Elsewhere (GPU, small sizes, no ``madvise``) ``torch.empty``.
"""
from __future__ import annotations

import mmap
import warnings

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 4 << 20  # below this the page faults cost little


def empty(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialized 1-D tensor of ``numel`` elements."""
    device = torch.device(device)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
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
