"""One fold of compressed clients, shared by the Accumulator, the functional round and the server optimizers (above
the backends): the checks every backend relies on, then the backends' ``blockwise_fold`` and ``sparse_fold``
(csrc/quantized.h), one sweep per group of clients of one format and block, in the order the groups first appear
(float tensors beside them, a mixed round: the stats pass of float rows, first)."""
from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np
import torch

from ..backends import resolve, scale_scan
from ..flat import as_tensor
from ..passes import run_stats
from ..rows import _check_dtype, _flat_view, client_rows

from .blockwise import FLOAT32_OVERFLOW, Blockwise, block_scales, check_blockwise
from .codebook import LAYER_FORMATS, Codebook8, LayerwiseUpdate
from .fp8 import E4M3_MAX, Fp8Blockwise
from .sparse import SparseUpdate, check_sparse, scan

FORMATS = LAYER_FORMATS + (LayerwiseUpdate,)


def compressed_list(x, name: str = "deltas") -> list | None:
    """``x`` as a list of updates when it is a non-empty list or tuple holding compressed updates, else None. The
    others may be float tensors or numpy arrays of the model's flat size (a mixed round: clients that sent float32 /
    bf16 beside those that sent int8, folded in the same call; numpy arrays are viewed as tensors, not copied); any
    other kind beside compressed updates is refused naming it."""
    if not isinstance(x, (list, tuple)) or not x or not any(isinstance(u, FORMATS) for u in x):
        return None
    out = []
    for i, u in enumerate(x):
        if isinstance(u, np.ndarray):
            try:
                u = as_tensor(u)
            except TypeError:
                raise TypeError(f"{name}[{i}] is a numpy array of {u.dtype}; a float update is float32, float64 "
                                "or float16") from None
        elif not isinstance(u, (FORMATS, torch.Tensor)):
            raise TypeError(f"{name}[{i}] is a {type(u).__name__}: beside compressed updates a list takes float "
                            "tensors or numpy arrays of the model's flat size (other forms -- per-layer lists, "
                            "dicts, modules -- go into an Accumulator in an add of their own)")
        out.append(u)
    return out


def numel_of(u) -> int:
    """Elements of a compressed update or a float tensor."""
    return u.numel() if isinstance(u, torch.Tensor) else u.numel


def tensors_of(u) -> list:
    """``(field, tensor)`` of every tensor an update holds (a float tensor: itself), for the aliasing checks."""
    if isinstance(u, torch.Tensor):
        return [("", u)]
    return [(f".{f.name}", getattr(u, f.name)) for f in dataclasses.fields(u)
            if isinstance(getattr(u, f.name), torch.Tensor)]


def check_batch(updates: list, names: list, *, numel: int, device: torch.device, where: str,
                scans: dict | None = None) -> None:
    """Formats, sizes, devices and sparse indices (in range, strictly increasing), each error naming the update.
    ``scans``: a dict that keeps what the scan of every compressed part found (by ``id``: :func:`_scan`) for
    :func:`nonfinite_scales` of the same call (one pass answers both: index order here, finite values and scales
    there; on a GPU one launch per kind of part and one host read for the round). Float tensors (a mixed round):
    contiguous, of a float dtype (converted on load into the sums' dtype, as the codes are)."""
    parts = _check_forms(updates, names, numel=numel, device=device, where=where)
    sparse = [(u, name) for u, name in parts if isinstance(u, SparseUpdate)]
    if scans is None and not sparse:
        return
    found = _scan([u for u, _ in (parts if scans is not None else sparse)])
    if scans is not None:
        scans.update(found)
    for u, name in sparse:
        u.check_indices(name, found[id(u)].first, found[id(u)].bounds)


def _check_forms(updates: list, names: list, *, numel: int | None, device: torch.device, where: str) -> list:
    """:func:`check_batch` but the sparse indices; returns ``(part, name)`` of every compressed part (a layerwise
    update's layers), in order."""
    layered = [u for u in updates if isinstance(u, LayerwiseUpdate)]
    if layered and any(isinstance(u, FORMATS) and not isinstance(u, LayerwiseUpdate) for u in updates):
        raise TypeError("layerwise updates (one part per layer) and whole-vector ones cannot share a call")
    parts = []
    device = torch.device(device)
    for u, name in zip(updates, names):
        if isinstance(u, torch.Tensor):  # the checks of float client rows
            _check_dtype(u, name)
            _flat_view(u, name)
        elif isinstance(u, LayerwiseUpdate):
            if u.sizes() != layered[0].sizes():
                raise ValueError(f"{name} has layers of {list(u.sizes())[:4]}... elements; the first layerwise "
                                 f"update's are {list(layered[0].sizes())[:4]}...")
            parts += _check_forms(list(u.parts), [f"{name} layer {k}" for k in range(len(u.parts))], numel=None,
                                  device=device, where=where)
        else:
            if isinstance(u, SparseUpdate):
                check_sparse(u, name)
            else:
                check_blockwise(u, name)
            parts.append((u, name))
        if numel is not None and numel_of(u) != numel:
            raise ValueError(f"{name} has {numel_of(u)} elements; {where} has {numel}")
        if u.device != device:
            raise ValueError(f"{name} is on {u.device}; {where} is on {device}")
    return parts


@dataclasses.dataclass(frozen=True)
class _Found:
    """What the scan of one compressed part found. ``first``: a sparse part's first entry whose index does not
    exceed the one before, a blockwise part's first block whose scale is <= 0 (-1: none; None: not scanned for, the
    index check then looks itself). ``finite``: every value / scale finite. From the GPU's scan also ``bounds`` (a
    sparse part's smallest and largest index) and ``largest`` (a blockwise part's largest finite scale times its
    largest finite ``|v(q)|``), so that no check reads the part again."""

    first: int | None
    finite: bool
    bounds: tuple | None = None
    largest: float | None = None


def _device_scanner(device: torch.device):
    """The Triton backend's ``compressed_scan`` for parts on a CUDA device; None elsewhere (CPU parts: the C++
    passes; a GPU without Triton: torch ops)."""
    if device.type != "cuda":
        return None
    try:
        return resolve("triton", device).compressed_scan
    except (ImportError, RuntimeError, ValueError):
        return None


def _scan(parts: list) -> dict:
    """``id(part) -> _Found`` of compressed parts: one C++ pass per kind for contiguous CPU parts (``sparse_scan``,
    ``scale_scan``), the Triton scan for CUDA parts (:func:`_device_scan`), torch ops for the rest."""
    found: dict = {}
    devices: dict = {}
    for p in parts:
        devices.setdefault(p.device, []).append(p)
    for dev, ps in devices.items():
        scanner = _device_scanner(dev)
        if scanner is not None:
            found.update(_device_scan(ps, scanner))
            continue
        sparse = [p for p in ps if isinstance(p, SparseUpdate)]
        blocks = [p for p in ps if isinstance(p, Blockwise)]
        got = scan(sparse) if sparse else None
        if got is not None:
            found.update((id(p), _Found(r[0], bool(r[1]))) for p, r in zip(sparse, got))
            sparse = []
        if blocks and all(p.scales.device.type == "cpu" and p.scales.is_contiguous() for p in blocks):
            got = scale_scan([p.scales for p in blocks])
            if got is not None:
                found.update((id(p), _Found(r[1], bool(r[0]))) for p, r in zip(blocks, got))
                blocks = []
        rest = sparse + blocks
        for p, (ok, low) in zip(rest, _torch_status(rest) if rest else []):
            found[id(p)] = _Found(None if isinstance(p, SparseUpdate) else low, ok)
    return found


def _device_scan(parts: list, scanner) -> dict:
    """:func:`_scan` of parts on one GPU: the backend's scan (one launch per kind of part) and the largest finite
    ``|v(q)|`` of each distinct code book (fp8: 448, int8: 127), read by the host at once -- one read for the round,
    whatever M."""
    blocks = [p for p in parts if isinstance(p, Blockwise)]
    sparse = [p for p in parts if isinstance(p, SparseUpdate)]
    found = scanner(scales=[p.scales.contiguous() for p in blocks], values=[p.values.contiguous() for p in sparse],
                    indices=[p.indices.contiguous() for p in sparse])
    tables = {id(t): t for t in (p.table() for p in blocks if not isinstance(p, Fp8Blockwise)) if t is not None}
    read = found.reshape(-1)
    if tables:
        a = torch.stack(list(tables.values())).to(found.device, torch.float64).abs()
        read = torch.cat([read, torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(1).view(torch.int64)])
    host = read.tolist()
    tops = dict(zip(tables, (struct.unpack("<d", struct.pack("<q", v))[0] for v in host[4 * len(parts):])))
    out = {}
    for k, p in enumerate(blocks + sparse):
        nonfinite, first, c, e = host[4 * k:4 * k + 4]
        first = -1 if first >= 1 << 62 else first
        if isinstance(p, SparseUpdate):
            out[id(p)] = _Found(first, nonfinite == 0, bounds=(c, -e))
        else:
            t = p.table()
            top = E4M3_MAX if isinstance(p, Fp8Blockwise) else 127.0 if t is None else tops[id(t)]
            out[id(p)] = _Found(first, nonfinite == 0, largest=struct.unpack("<f", struct.pack("<i", -c))[0] * top)
    return out


def _parts(u) -> tuple:
    return u.parts if isinstance(u, LayerwiseUpdate) else (u,)


def _layer(u, k: int, at: int, n: int):
    """Layer ``k`` (elements ``at .. at + n``) of a layerwise update or a float tensor."""
    return u.parts[k] if isinstance(u, LayerwiseUpdate) else _flat_view(u, "")[at:at + n]


def _part_status(parts: list, found: dict | None = None) -> list:
    """Per part ``(finite, first block whose scale is <= 0 or -1)``: a sparse part's values, a blockwise part's
    scales (as :func:`_scan` ``found`` them; None: scanned here), a float tensor's values (one more read of each;
    one host read for them all)."""
    if found is None:
        found = _scan([p for p in parts if not isinstance(p, torch.Tensor)])
    out: list = [None] * len(parts)
    floats = [j for j, p in enumerate(parts) if isinstance(p, torch.Tensor)]
    if floats:
        for j, ok in zip(floats, torch.stack([torch.isfinite(parts[j]).all() for j in floats]).tolist()):
            out[j] = (bool(ok), -1)
    for j, p in enumerate(parts):
        if out[j] is None:
            r = found[id(p)]
            out[j] = (r.finite, -1 if isinstance(p, SparseUpdate) else r.first)
    return out


def _torch_status(parts: list) -> list:
    """``(finite, first block whose scale is <= 0 or -1)`` by torch ops, for all of ``parts`` (one device) at once:
    parts of one length, dtype and kind stacked into a matrix and reduced along its rows, one host read for the lot.
    No scatter: 16 clients' millions of scales reduced into 16 slots by atomics took 10-20 ms on an H200."""
    ts = [(p.values if isinstance(p, SparseUpdate) else p.scales).reshape(-1) for p in parts]
    groups: dict = {}
    for k, (p, t) in enumerate(zip(parts, ts)):
        groups.setdefault((t.numel(), t.dtype, isinstance(p, SparseUpdate)), []).append(k)
    order, found = [], []
    for (n, _, sparse), ks in groups.items():
        x = torch.stack([ts[k] for k in ks])
        finite = torch.isfinite(x).all(1) if n else torch.ones(len(ks), dtype=torch.bool, device=x.device)
        if sparse or n == 0:  # sparse values may be anything finite
            first = torch.full((len(ks),), -1, dtype=torch.int64, device=x.device)
        else:
            low = x <= 0
            first = torch.where(low.any(1), low.to(torch.uint8).argmax(1), -1)  # argmax: the first maximum
        order += ks
        found.append(torch.stack([finite.to(torch.int64), first]))
    out: list = [None] * len(parts)
    for k, ok, lo in zip(order, *torch.cat(found, 1).tolist()):
        out[k] = (bool(ok), int(lo))
    return out


def nonfinite_scales(updates: list, names: list, scans: dict | None = None) -> list:
    """Indices of the updates with a NaN or Inf scale (blockwise) or value (sparse), or whose dequantized values lie
    beyond float32 (``|s_b v(q_j)|`` rounds to Inf: no quantizer writes them, and one such client would overflow
    the round's sums with the honest ones): the callers leave them out or raise, per ``on_nonfinite``. Raises naming
    the first blockwise update with a scale <= 0. The one check of scales every path that reads compressed updates
    runs (the folds; :func:`dense_rows`, for the robust rules and DP, leaves a scale <= 0 out first). ``scans``:
    what :func:`check_batch` found of the same updates (the parts it did not scan are scanned here)."""
    parts = [(j, k, p) for j, u in enumerate(updates) for k, p in enumerate(_parts(u))]
    found = dict(scans or {})
    found.update(_scan([p for _, _, p in parts if not isinstance(p, torch.Tensor) and id(p) not in found]))
    status = _part_status([p for _, _, p in parts], found)
    finite = [True] * len(updates)
    for (j, _, _), (ok, _) in zip(parts, status):
        finite[j] = finite[j] and ok
    for (j, k, p), (_, low) in zip(parts, status):
        if finite[j] and low >= 0:
            where = f" layer {k}" if isinstance(updates[j], LayerwiseUpdate) else ""
            raise ValueError(f"{names[j]}{where}: the scale of block {low} is {float(p.scales[low])!r} (scales must "
                             "be > 0)")
    blockwise = [(j, p) for j, _, p in parts if finite[j] and isinstance(p, Blockwise) and p.scales.numel()]
    if blockwise:
        for (j, p), big in zip(blockwise, _beyond_float32([p for _, p in blockwise], found)):
            finite[j] = finite[j] and not big
    return [j for j, ok in enumerate(finite) if not ok]


def _largest_code(p: Blockwise, tops: dict) -> float:
    """The largest ``|v(q)|`` of the format's valid codes (int8: 127, a code book's finite entries)."""
    t = p.table()
    if t is None:
        return 127.0
    if id(t) not in tops:
        a = t.detach().abs().to(torch.float64)
        tops[id(t)] = float(torch.where(torch.isnan(a), torch.zeros_like(a), a).max())
    return tops[id(t)]


def _beyond_float32(parts: list, found: dict) -> list:
    """Per blockwise part (finite scales > 0): whether some ``|s_b v(q_j)|`` rounds to Inf in float32. The largest
    scale times the largest code value: from the GPU's scan, else one host read of every part's largest scale;
    only a part where that product reaches the overflow (none a quantizer writes) is dequantized to look at its
    codes."""
    if all(found[id(p)].largest is not None for p in parts):
        largest = [found[id(p)].largest for p in parts]
    else:
        tops: dict = {}
        scales = torch.stack(torch._foreach_max([p.scales for p in parts])).to(torch.float64).cpu().tolist()
        largest = [s * _largest_code(p, tops) for p, s in zip(parts, scales)]
    out = []
    for p, top in zip(parts, largest):
        big = top >= FLOAT32_OVERFLOW
        if big:  # (NaN codes: refused by the fold itself)
            t, q = p.table(), p.code_bytes()
            v = q.to(torch.float64) if t is None else t.to(q.device, torch.float64)[q.view(torch.uint8).long()]
            big = bool((v.abs() * block_scales(p.scales, p.block, p.numel) >= FLOAT32_OVERFLOW).any())
        out.append(big)
    return out


def _groups(updates: list) -> list:
    """Positions of the updates grouped by (format, block; float clients by dtype), float groups first, the others
    in order of first appearance."""
    groups: dict = {}
    books = _books([u.code for u in updates if isinstance(u, Codebook8)])
    for j, u in enumerate(updates):
        # one sweep per format, block and code book (equal books share it: compared by value)
        book = books[id(u.code)] if isinstance(u, Codebook8) else None
        if isinstance(u, torch.Tensor):
            key = ("float", u.dtype)
        else:
            key = ("sparse",) if isinstance(u, SparseUpdate) else (type(u), u.block, book)
        groups.setdefault(key, []).append(j)
    # float clients first: their stats pass starts from init, which must not be its output
    return sorted(groups.values(), key=lambda g: not isinstance(updates[g[0]], torch.Tensor))


def _books(tables: list) -> dict:
    """``id -> bytes`` of the distinct code-book tensors (clients often share one; 16 FLARE clients send 16 equal
    ones): all read by the host at once."""
    distinct = {id(t): t for t in tables}
    if not distinct:
        return {}
    host = torch.stack([t.detach() for t in distinct.values()]).cpu().numpy()
    return {k: row.tobytes() for k, row in zip(distinct, host)}


def fold(updates: list, names: list, coef: torch.Tensor, backend, *, init: torch.Tensor | None,
         out: torch.Tensor, norms: bool = True) -> tuple:
    """``out = init + sum_i coef_i x~_i``; returns ``(sq_norms [M] float64, mean_sq 0-d float64)`` where
    ``sq_norms_i = ||x~_i||^2`` and ``mean_sq = ||out||^2``. Raises naming the updates holding an invalid code (out
    is then garbage: callers write into a spare buffer). ``init`` must not overlap ``out`` unless it is ``out``.
    Layerwise updates are folded layer by layer (each layer's slice of ``init`` and ``out``). ``norms=False``:
    ``sq_norms`` is None, and a backend skips the squares where it can (the FedAvg family needs no client norms)."""
    layered = next((u for u in updates if isinstance(u, LayerwiseUpdate)), None)
    if layered is None:
        return _fold_flat(updates, names, coef, backend, init=init, out=out, norms=norms)
    sq = torch.zeros(len(updates), dtype=torch.float64, device=out.device) if norms else None
    msq = torch.zeros((), dtype=torch.float64, device=out.device)
    at = 0
    for k, n in enumerate(layered.sizes()):
        s, ms = _fold_flat([_layer(u, k, at, n) for u in updates], [f"{name} layer {k}" for name in names], coef,
                           backend,
                           init=None if init is None else init[at:at + n], out=out[at:at + n], norms=norms)
        if norms:
            sq += s
        msq += ms
        at += n
    return sq, msq


def _fold_flat(updates: list, names: list, coef: torch.Tensor, backend, *, init: torch.Tensor | None,
               out: torch.Tensor, norms: bool = True) -> tuple:
    m, dev = len(updates), out.device
    sq = torch.empty(m, dtype=torch.float64, device=dev)
    msq = torch.empty((), dtype=torch.float64, device=dev)
    groups = _groups(updates)
    for n, group in enumerate(groups):
        first = updates[group[0]]
        src = init if n == 0 else out
        whole = len(group) == m  # (then the group is 0 .. m - 1: positions are grouped in order)
        gsq = sq if whole else torch.empty(len(group), dtype=torch.float64, device=dev)
        gcoef = coef if whole else coef[group]
        if isinstance(first, torch.Tensor):  # float clients of a mixed round: the stats pass of float rows
            rows = client_rows([_flat_view(updates[j], names[j]) for j in group], name="deltas")
            if src is not None and src.data_ptr() == out.data_ptr():  # the pass reads its start apart from out
                src = src.clone()
            _, fsq, _, fmsq = run_stats(rows, gcoef, backend, mean_init=src, mean_out=out)
            gsq.copy_(fsq)
            msq.copy_(fmsq)
        elif isinstance(first, SparseUpdate):
            itype = torch.int64 if any(updates[j].indices.dtype == torch.int64 for j in group) else torch.int32
            last = n == len(groups) - 1
            backend.sparse_fold(indices=[updates[j].indices.to(itype) for j in group],
                                values=[updates[j].values for j in group], coef=gcoef, init=src, out=out,
                                sq_out=gsq,
                                msq_out=msq if last else None)
        else:
            bad = torch.empty(len(group), dtype=torch.bool, device=dev)
            backend.blockwise_fold(codes=[updates[j].code_bytes() for j in group],
                                   scales=[updates[j].scales for j in group], block=first.block,
                                   table=first.table(), e4m3=isinstance(first, Fp8Blockwise), coef=gcoef,
                                   init=src, out=out, sq_out=gsq if norms else None, bad_out=bad, msq_out=msq)
            if bool(bad.any()):
                who = ", ".join(names[group[j]] for j in bad.nonzero().flatten().tolist())
                raise ValueError(f"{who} {first.INVALID_CODES}")
        if norms and not whole:
            sq[group] = gsq
    return (sq if norms else None), msq


def dense_rows(updates: list, names: list, *, numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The updates dequantized into the rows of one ``[M, d]`` tensor of ``dtype`` (for the rules that read every
    client: robust aggregation, DP's clipping). Checked for form as a fold checks them (:func:`check_batch`: formats,
    sizes, devices, sparse indices raise naming the update); an update no quantizer writes -- a NaN/Inf scale or
    value, values beyond float32, an invalid code or a scale <= 0 (:func:`malformed`) -- gives a non-finite row:
    these rules leave such a client out (an attack, counted among ``f``) instead of refusing the round. (The folds
    of the plain rules, which cannot tell one client's contribution from the others', raise on an invalid code or a
    scale <= 0 under every ``on_nonfinite``.)"""
    scans: dict = {}
    check_batch(updates, names, numel=numel, device=device, where="the params", scans=scans)
    bad = {j for j, u in enumerate(updates) if not isinstance(u, torch.Tensor) and malformed(u)}
    rest = [j for j in range(len(updates)) if j not in bad]
    bad |= {rest[j] for j in nonfinite_scales([updates[j] for j in rest], [names[j] for j in rest], scans)}
    out = torch.empty(len(updates), numel, dtype=dtype, device=device)
    for i, (u, name) in enumerate(zip(updates, names)):
        if isinstance(u, torch.Tensor):
            out[i] = _flat_view(u, name)
        elif i in bad:  # left out by the rule: a non-finite row
            out[i] = float("nan")
        else:
            out[i] = u.dequantize(torch.float64)
    return out


def malformed(u) -> bool:
    """Whether a compressed update holds what no quantizer writes besides NaN/Inf: an invalid code (int8 -128, a
    NaN fp8 / code-book code) or a finite scale <= 0."""
    for part in _parts(u):
        if isinstance(part, SparseUpdate):
            continue
        s = part.scales
        if bool((torch.isfinite(s) & ~(s > 0)).any()) or part.holds_invalid_code():
            return True
    return False


class CompressedRows:
    """One rank's compressed clients where :func:`fastagg.distributed.all_stats` takes float client rows: the same
    header (``numel``, ``num_clients``, ``dtype``, ``form``: the layout of the params they update; no buffers), and
    a local pass that folds the updates where they lie instead of reading rows. Clients with a NaN/Inf scale or
    value are flagged non-finite (the round is then not finite on every rank: raised or skipped) and not read."""

    buffers = None

    def __init__(self, updates: list, names: list, *, numel: int, device: torch.device, form):
        self.updates, self.names, self.numel, self.device, self.form = list(updates), list(names), numel, device, form
        self.dtype = torch.float32

    @property
    def num_clients(self) -> int:
        return len(self.updates)

    def stats(self, coefs: torch.Tensor, backend, *, mean_out: torch.Tensor | None,
              mean_dtype: torch.dtype) -> tuple:
        """``(mean, sq_norms, nonfinite)``: ``mean = sum_i coefs_i x~_i`` over the finite clients (into
        ``mean_out``), ``sq_norms_i = ||x~_i||^2`` (NaN for a non-finite client)."""
        m = len(self.updates)
        out = mean_out if mean_out is not None else torch.empty(self.numel, dtype=mean_dtype, device=self.device)
        bad = nonfinite_scales(self.updates, self.names)
        flags = torch.zeros(m, dtype=torch.bool, device=self.device)
        sq = torch.full((m,), float("nan"), dtype=torch.float64, device=self.device)
        left_out = set(bad)
        keep = [j for j in range(m) if j not in left_out]
        if bad:
            flags[bad] = True
        if keep:
            sq[keep], _ = fold([self.updates[j] for j in keep], [self.names[j] for j in keep],
                               coefs.to(torch.float64)[keep].contiguous(), backend, init=None, out=out)
        else:
            out.zero_()
        return out, sq, flags


def densified(deltas: Any, base: Any = None) -> Any:
    """``deltas`` as the rules that read every client take them (:func:`fastagg.robust.aggregate`,
    :func:`fastagg.privacy.release`): a list holding compressed updates (float ones beside them allowed) as
    dequantized rows of the model's size, float64 if any float client is float64, else float32 -- one that no
    quantizer writes (NaN/Inf, an invalid code, a scale <= 0) a non-finite row, which those rules leave out --;
    anything else as it is. ``base=`` (full models) does not apply to compressed updates: a TypeError."""
    updates = compressed_list(deltas)
    if updates is None:
        return deltas
    if base is not None:
        raise TypeError("base= does not apply to compressed updates: they are the updates themselves")
    first = updates[0]
    dtype = torch.float64 if any(isinstance(u, torch.Tensor) and u.dtype == torch.float64 for u in updates) \
        else torch.float32
    return dense_rows(updates, [f"deltas[{i}]" for i in range(len(updates))], numel=numel_of(first),
                      device=first.device, dtype=dtype)
