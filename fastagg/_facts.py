"""Facts about many tensors at once -- dtype, device, shape, contiguity, flags, addresses -- for the per-entry checks
of a round over a state_dict of hundreds of entries, read in one C call from the compiled ``fastagg._tensor_facts``
(csrc/tensor_facts.cpp: ~2 ns a tensor where ten Python attribute calls cost ~2 us).

That module is built against torch's headers, so it is used only under the torch it was built with (its version and
git revision stamped in at build time); where it is missing (a wheel built without torch present), stale, or turned
off with ``FASTAGG_TENSOR_FACTS=0`` (read once, when fastagg is imported), :func:`facts` returns None and every
caller runs the same checks in Python.
:data:`WHY_NOT` says which, for ``fastagg.env`` reports and bug reports.

A row per tensor, int64 columns (``OK`` ... ``STORAGE_NBYTES``). ``OK`` is 1 for a plain strided tensor (exactly
``torch.Tensor``, with storage, at most 8 dimensions) whose other columns are filled in, 0 for anything else
(subclasses, numpy arrays, sparse, wrapped functorch tensors, more dimensions...), which the callers look at in
Python. ``DATA`` is ``Tensor.data_ptr()`` (for addresses, compare as unsigned).
"""
from __future__ import annotations

import os

import numpy as np
import torch

try:
    from . import _tensor_facts as _compiled
except ImportError as e:  # (not built: an isolated wheel build saw no torch)
    _compiled, _IMPORT_ERROR = None, e

OK, DTYPE, DEVICE, FLAGS, NDIM, SIZE0 = 0, 1, 2, 3, 4, 5
MAX_DIMS = 8
NUMEL, DATA, NBYTES, STORAGE_DATA, STORAGE_NBYTES = 13, 14, 15, 16, 17
NCOLUMNS = 18
_COLUMNS = ("ok", "dtype", "device", "flags", "ndim", *(f"size{d}" for d in range(MAX_DIMS)), "numel", "data",
            "nbytes", "storage_data", "storage_nbytes")
CONTIGUOUS, REQUIRES_GRAD, NEG, CONJ, ZERO_TENSOR, FLOATING, COMPLEX = 1, 2, 4, 8, 16, 32, 64
MEMORY_OK = 128  # no elements, or a nonzero address with [DATA, DATA + NBYTES) inside the storage's bytes
_FLAGS = {"contiguous": CONTIGUOUS, "requires_grad": REQUIRES_GRAD, "neg": NEG, "conj": CONJ,
          "zero_tensor": ZERO_TENSOR, "floating": FLOATING, "complex": COMPLEX, "memory_ok": MEMORY_OK}


def _load():
    """(the compiled module, None) when it can be used here, else (None, why not)."""
    setting = os.environ.get("FASTAGG_TENSOR_FACTS", "1").strip().lower()
    if setting in ("0", "false", "off", "no"):
        return None, f"turned off (FASTAGG_TENSOR_FACTS={os.environ['FASTAGG_TENSOR_FACTS']})"
    if setting not in ("1", "true", "on", "yes", ""):
        raise ValueError(f"FASTAGG_TENSOR_FACTS must be 0 or 1 (or false/true, off/on, no/yes), got "
                         f"{os.environ['FASTAGG_TENSOR_FACTS']!r}")
    mod = _compiled
    if mod is None:
        return None, (f"fastagg._tensor_facts is not importable ({_IMPORT_ERROR}); it is built only where torch is "
                      "importable while building: pip install --no-build-isolation -e .")
    built = (mod.TORCH_VERSION, mod.TORCH_GIT_VERSION)
    running = (torch.__version__, str(torch.version.git_version))
    if built != running:
        return None, (f"fastagg._tensor_facts was built for torch {built[0]} ({built[1][:12]}), this is torch "
                      f"{running[0]} ({running[1][:12]}): rebuild with pip install --no-build-isolation -e .")
    if tuple(mod.COLUMNS) != _COLUMNS or dict(mod.FLAGS) != _FLAGS or mod.MAX_DIMS != MAX_DIMS:
        return None, "fastagg._tensor_facts is from another fastagg version (its columns differ): rebuild it"
    return mod, None


_MODULE, WHY_NOT = _load()
META = None if _compiled is None else _compiled.META  # DeviceType::Meta (DEVICE >> 16)


def available() -> bool:
    return _MODULE is not None


def facts(ts: list | tuple) -> np.ndarray | None:
    """A [len(ts), NCOLUMNS] int64 array of the tensors' facts (see the module's docstring), or None where the
    compiled module is not used (the caller checks in Python)."""
    if _MODULE is None:
        return None
    return np.frombuffer(_MODULE.facts(ts), dtype=np.int64).reshape(len(ts), NCOLUMNS)


def in_storage(ts: list) -> bool | None:
    """Whether every tensor of ``ts`` (None skipped) is plain, contiguous, with memory, and all its bytes inside
    its storage -- in one C call; None where the compiled module is not used. False does not say which: the caller
    looks closer."""
    return None if _MODULE is None else _MODULE.in_storage(ts)


def row_table(rows: list):
    """A round's rows (``rows[s][i]``: client i's part of segment s, contiguous CPU tensors of one floating dtype)
    as one table capsule the kernels' bindings read in place of a DLPack capsule a row (csrc/row_table.h); None
    where the compiled module is not used or a row is not one a table may hold (then pass the capsules)."""
    return None if _MODULE is None else _MODULE.row_table(rows)


_PROBED: dict = {}  # (column, dtype or device) -> the code the module reports


def _probe(column: int, **where) -> int:
    """The value of ``column`` for a tensor of no elements made with ``where`` (no memory), made once per value."""
    key = (column, *where.values())
    code = _PROBED.get(key)
    if code is None:
        code = _PROBED[key] = int(facts([torch.empty(0, **where)])[0, column])
    return code


def dtype_code(dtype: torch.dtype) -> int:
    """The DTYPE column's value for ``dtype`` (c10::ScalarType), as the module reports it."""
    return _probe(DTYPE, dtype=dtype)


def device_code(device: torch.device) -> int:
    """The DEVICE column's value for ``device``."""
    return _probe(DEVICE, device=device)


def expect_shapes(shape_rows: np.ndarray) -> tuple:
    """(values, masks) [len(shape_rows), NCOLUMNS] that a tensor's facts pass, ``(facts ^ values) & masks == 0``,
    exactly when it is known and has the row's (ndim, sizes); callers add their dtype, device and flag checks."""
    n = len(shape_rows)
    val, mask = np.zeros((n, NCOLUMNS), dtype=np.int64), np.zeros((n, NCOLUMNS), dtype=np.int64)
    val[:, OK], mask[:, OK] = 1, -1
    if n:
        val[:, NDIM:NUMEL], mask[:, NDIM:NUMEL] = shape_rows, -1
    return val, mask


def shape_row(shape) -> np.ndarray | None:
    """``[ndim, size0..size7]`` as the NDIM..SIZE7 columns hold it; None past MAX_DIMS dimensions."""
    if len(shape) > MAX_DIMS:
        return None
    row = np.zeros(1 + MAX_DIMS, dtype=np.int64)
    row[0] = len(shape)
    row[1:1 + len(shape)] = shape
    return row
