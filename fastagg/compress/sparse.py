"""Sparse updates: top-k and random-k (indices + values per client), folded by scatter-add.

A :class:`SparseUpdate` of a d-element update holds ``k`` indices, **strictly increasing** in [0, d) (sorted,
no duplicates: anything else is refused, naming the client), int32 or int64, and their float32 values; the update
it stands for is ``x~_j = values[t]`` where ``indices[t] = j``, 0 elsewhere. Exact: the kept entries are float32
of the client's entries (exact for float32 updates).

- :func:`sparsify_topk`: the ``k`` entries of largest ``|x_j|`` (ties: the lower index).
- :func:`sparsify_randk`: ``k`` entries drawn uniformly without replacement, keyed by ``(seed, round, client)``;
  unscaled (biased: ``E[x~] = (k / d) x``) as error feedback uses it, or with ``unbiased=True`` scaled by ``d / k``.

Error feedback (Stich et al. 2018; Karimireddy et al. 2019) keeps what was not sent on the client and adds it to the
next update: :func:`fastagg.client.compress_updates` with a ``ClientState``. Bytes: k * (4 + 4) with int32 indices
(d < 2^31), k * (8 + 4) with int64.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .._checks import check_int
from ..backends import sparse_scan
from .blockwise import FLOAT32_MAX, FLOAT32_OVERFLOW, as_rows, check_keys

__all__ = ["SparseUpdate", "sparsify_topk", "sparsify_randk", "sparsify_rows"]


@dataclasses.dataclass(frozen=True)
class SparseUpdate:
    """``indices`` (1-D int32 or int64, strictly increasing in [0, numel)), ``values`` (1-D float32, as many),
    ``numel`` (the update's size d). Built checked: dtypes, shapes, devices, numel (the index order and range are
    checked by :meth:`check_indices` and again by the C++ fold)."""

    indices: torch.Tensor
    values: torch.Tensor
    numel: int

    FORMAT = "sparse"

    def __post_init__(self):
        check_sparse(self, "the update")
        object.__setattr__(self, "numel", int(self.numel))  # (a numpy integer kept as a Python int)

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return self.indices.numel() * self.indices.element_size() + 4 * self.values.numel()

    def check_indices(self, name: str, first_not_rising: int | None = None, bounds: tuple | None = None) -> None:
        """Raises naming ``name`` when an index is outside [0, numel) or the indices are not strictly increasing
        (``first_not_rising``: the first entry whose index does not exceed the one before, -1 for none, when
        :func:`scan` or a GPU's scan has found it; ``bounds``: the smallest and largest index, when a GPU's scan has
        found them -- otherwise the first and last are read)."""
        ix = self.indices
        if ix.numel() == 0:
            return
        lo, hi = bounds if bounds is not None else (int(ix[0]), int(ix[-1]))
        if first_not_rising is None:
            bad = (ix[1:] <= ix[:-1]).nonzero() if ix.numel() > 1 else ix[:0]
            first_not_rising = int(bad[0]) + 1 if bad.numel() else -1
        if first_not_rising >= 0:
            t = first_not_rising
            what = "duplicated" if int(ix[t]) == int(ix[t - 1]) else "unsorted"
            raise ValueError(f"{name}: indices must be strictly increasing (sorted, no duplicates); index {int(ix[t])} "
                             f"at entry {t} follows {int(ix[t - 1])} ({what})")
        if lo < 0 or hi >= self.numel:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name}: index {bad} is outside [0, {self.numel})")

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        check_sparse(self, "the update")
        self.check_indices("the update")
        out = torch.zeros(self.numel, dtype=torch.float64, device=self.device)
        out[self.indices.long()] = self.values.to(torch.float64)
        return out.to(dtype)


def scan(updates: list) -> list | None:
    """Per sparse update ``(first entry whose index does not exceed the one before or -1, every value finite)``, by
    one parallel C++ pass over all of them (csrc/bindings.cpp ``sparse_scan``); None when they are not CPU tensors
    or the compiled module does not load (the callers then use torch ops)."""
    if not updates or any(u.indices.device.type != "cpu" or not (u.indices.is_contiguous() and
                                                                 u.values.is_contiguous()) for u in updates):
        return None
    out: list = [None] * len(updates)
    for dtype in (torch.int32, torch.int64):  # one index dtype per call
        at = [j for j, u in enumerate(updates) if u.indices.dtype == dtype]
        if at:
            found = sparse_scan([updates[j].indices for j in at], [updates[j].values for j in at])
            if found is None:
                return None
            for j, r in zip(at, found):
                out[j] = r
    return out


def check_sparse(u: Any, name: str) -> None:
    check_int(u.numel, f"{name}: numel")
    for field, t, dtypes in (("indices", u.indices, (torch.int32, torch.int64)), ("values", u.values, (torch.float32,))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {field} must be a torch tensor, got {type(t).__name__}")
        if t.dtype not in dtypes or t.dim() != 1:
            raise TypeError(f"{name}: {field} must be a 1-D tensor of {' or '.join(map(str, dtypes))}, got {t.dtype} "
                            f"of shape {tuple(t.shape)}")
    if u.indices.numel() != u.values.numel():
        raise ValueError(f"{name}: {u.indices.numel()} indices but {u.values.numel()} values")
    if u.indices.device != u.values.device:
        raise ValueError(f"{name}: indices are on {u.indices.device} but values on {u.values.device}")
    if u.indices.numel() > u.numel:
        raise ValueError(f"{name}: {u.indices.numel()} entries of a {u.numel}-element update")


def _count(d: int, fraction: Any, k: Any) -> int:
    if (fraction is None) == (k is None):
        raise TypeError("give one of fraction= (of the entries, in (0, 1]) and k= (how many)")
    if k is not None:
        return check_int(k, "k", maximum=d)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
    return min(d, max(1, math.ceil(fraction * d))) if d else 0


def sparsify_rows(rows: torch.Tensor, *, kind: str = "topk", fraction: float | None = None, k: int | None = None,
                  unbiased: bool = False, seed: int = 0, round: int = 0, clients: list | None = None) -> list:
    """Each row of an ``[M, d]`` batch as a :class:`SparseUpdate`: ``kind="topk"`` or ``"randk"`` (module
    docstring), ``k`` entries per row (or ``ceil(fraction * d)``, at least 1)."""
    if kind not in ("topk", "randk"):
        raise ValueError(f"kind must be 'topk' or 'randk', got {kind!r}")
    x = as_rows(rows, "the updates")
    m, d = x.shape
    kk = _count(d, fraction, k)
    clients = list(range(m)) if clients is None else list(clients)
    seed, round, clients = check_keys(seed, round, clients)
    if len(clients) != m:
        raise ValueError(f"{m} rows but {len(clients)} client ids")
    if kind == "topk":
        # a stable descending sort: equal magnitudes keep the lower index
        picked = torch.sort(x.abs(), dim=1, descending=True, stable=True).indices[:, :kk]
    else:
        picked = torch.stack([torch.randperm(d, generator=_keyed(seed, round, c), device="cpu")[:kk]
                              for c in clients]).to(x.device) if m else torch.zeros(0, kk, dtype=torch.int64)
    idx = torch.sort(picked, dim=1).values
    vals = torch.gather(x, 1, idx).to(torch.float64)
    if kind == "randk" and unbiased and kk:
        vals = vals * (d / kk)
    _check_float32(vals, idx, "scaled by d / k, " if kind == "randk" and unbiased else "")
    vals = vals.to(torch.float32)
    itype = torch.int32 if d < 2 ** 31 else torch.int64
    return [SparseUpdate(idx[i].to(itype).contiguous(), vals[i].contiguous(), d) for i in range(m)]


def _check_float32(vals: torch.Tensor, idx: torch.Tensor, how: str) -> None:
    """Raises naming the first entry picked (``vals`` float64 ``[M, k]`` at ``idx``) whose value rounds to Inf in
    float32 (a float64 update of 1e39): values are sent as float32, and an Inf one would be refused by every server
    (and, with error feedback, leave -Inf in the client's residual)."""
    big = vals.abs() >= FLOAT32_OVERFLOW
    if bool(big.any()):
        i, j = (int(v) for v in big.nonzero()[0])
        row = f"row {i}, " if vals.shape[0] > 1 else ""
        raise ValueError(f"the updates: {row}entry {int(idx[i, j])} is {float(vals[i, j])!r} ({how}beyond float32's "
                         f"range, {FLOAT32_MAX:.6g}); it has no compressed form")


def _keyed(seed: int, round: int, client: int) -> torch.Generator:
    """A CPU generator (torch's mt19937) seeded by a 64-bit mix of (seed, round, client): the same draws anywhere."""
    mixed = (seed * 0x9E3779B97F4A7C15 + round * 0xBF58476D1CE4E5B9 + client * 0x94D049BB133111EB) % 2 ** 63
    return torch.Generator().manual_seed(mixed)


def sparsify_topk(update: Any, fraction: float | None = None, *, k: int | None = None) -> SparseUpdate:
    """The ``k`` largest-magnitude entries of ``update`` (a flat tensor, a list of tensors, a state_dict or a
    module's parameters), or ``ceil(fraction * d)`` of them; module docstring."""
    if isinstance(update, torch.Tensor) and update.dim() == 2:
        raise ValueError("sparsify_topk takes one update; sparsify_rows takes an [M, d] batch")
    return sparsify_rows(as_rows(update), kind="topk", fraction=fraction, k=k)[0]


def sparsify_randk(update: Any, fraction: float | None = None, *, k: int | None = None, unbiased: bool = False,
                   seed: int = 0, round: int = 0, client: int = 0) -> SparseUpdate:
    """``k`` entries of ``update`` drawn uniformly without replacement, keyed by ``(seed, round, client)``;
    ``unbiased=True`` scales them by ``d / k``. Module docstring."""
    if isinstance(update, torch.Tensor) and update.dim() == 2:
        raise ValueError("sparsify_randk takes one update; sparsify_rows takes an [M, d] batch")
    return sparsify_rows(as_rows(update), kind="randk", fraction=fraction, k=k, unbiased=unbiased, seed=seed,
                         round=round, clients=[client])[0]
