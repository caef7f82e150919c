"""Flat parameter buffers: per-layer tensors, numpy arrays, state_dicts and modules <-> one 1-D buffer.

fastagg's kernels see a model as one flat vector. :class:`Layout` records how a model's entries map into
that vector (names, shapes, dtypes, offsets) so that a flat result can be given back in the caller's form,
as views, without copies.

Which entries are *parameters* (they count: FedExP's eta and every server optimizer see them) and which are
*buffers* (never counted, never extrapolated; averaged with the clients' weights, ``rows.py``):

* a flat tensor/array, or a list of them: every entry is a parameter (integer entries are rejected);
* an ``nn.Module``: its parameters are parameters, its buffers (BatchNorm running statistics and
  ``num_batches_tracked``) are buffers;
* a ``state_dict``: entries named like the global module's buffers when the global model is a module, else
  entries whose last name component is one of torch's buffer names (``running_mean``, ``running_var``,
  ``num_batches_tracked``) and every non-floating entry are buffers; the other floating entries are parameters.
  ``Layout.of(..., buffers=True)`` counts floating buffers as parameters (explicit opt-in).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections import OrderedDict as OrderedDict_
from collections.abc import Mapping, Sequence
from itertools import chain
from operator import attrgetter, itemgetter, methodcaller
from typing import Any

import numpy as np
import torch

from . import _facts

__all__ = ["Layout", "flatten", "is_floating", "as_tensor", "split_entries", "is_buffer_name", "BUFFER_NAMES"]


def as_tensor(x: Any, name: str | None = None) -> torch.Tensor:
    """A torch view of ``x``: tensors pass through, numpy arrays are wrapped without a copy. Tensors on the meta
    device (shapes without data) are refused, naming ``name``: there is nothing to read or write."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "meta":
            raise ValueError(f"{name or f'a tensor of shape {tuple(x.shape)}'} is on meta: the meta device holds no "
                             "data, and fastagg reads and writes real tensors")
        check_memory(x, name)
        return x
    if isinstance(x, np.ndarray):
        if x.flags.writeable:
            return torch.from_numpy(x)
        with warnings.catch_warnings():  # torch warns on read-only arrays; fastagg never writes to them
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(x)
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def check_memory(t: torch.Tensor, name: str | None = None) -> None:
    """``t``'s memory holds its elements as they read, and all of them: kernels read and write the stored bytes, so a
    lazily negated or conjugated view (``torch._neg_view``, ``.conj()``) would read with the wrong sign, an efficient
    zero tensor has no memory, and a tensor whose storage was shrunk under it (``untyped_storage().resize_``) would be
    read past its storage's end."""
    what = name or f"a tensor of shape {tuple(t.shape)}"
    if t.is_neg() or t.is_conj():
        raise ValueError(f"{what} is a lazily negated or conjugated view; fastagg reads memory as stored: pass "
                         ".resolve_neg() / .resolve_conj()")
    if t._is_zerotensor():
        raise ValueError(f"{what} is an efficient zero tensor, which has no memory: pass torch.zeros(...)")
    n = t.numel()
    if n and t.layout == torch.strided and not t.is_nested:  # (others are refused as entries: not dense)
        extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if stride > 0)
        need = (t.storage_offset() + extent) * t.element_size()
        if t.untyped_storage().nbytes() < need:
            raise ValueError(f"{what} needs {need} bytes of storage but its storage holds "
                             f"{t.untyped_storage().nbytes()} (resized under it): nothing is read from it")


def is_floating(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.is_floating_point()
    if isinstance(x, np.ndarray):
        return np.issubdtype(x.dtype, np.floating)
    return False


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a model's entries map into one flat vector.

    ``names[k]`` (``None`` for plain lists) has ``shapes[k]`` and ``dtypes[k]`` and occupies
    ``flat[offsets[k] : offsets[k] + numels[k]]``. ``kind`` is ``"flat"``, ``"list"`` or ``"dict"``.
    Two layouts are compatible when their :meth:`signature` is equal.
    """

    kind: str
    names: tuple
    shapes: tuple
    dtypes: tuple
    numpy: bool = False
    aliases: tuple = ()  # (alias, entry) pairs: names of tied entries (the same tensor as ``entry``), not entries

    @property
    def numels(self) -> tuple:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def offsets(self) -> tuple:
        out, off = [], 0
        for n in self.numels:
            out.append(off)
            off += n
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def signature(self) -> tuple:
        """(name, shape, dtype) per entry; what checkpoints compare."""
        return tuple((n, tuple(s), str(d)) for n, s, d in zip(self.names, self.shapes, self.dtypes))

    def first_difference(self, other: "Layout") -> str | None:
        """A sentence naming the first entry where ``other`` differs, or None if compatible."""
        a, b = self.signature(), other.signature()
        for k, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"entry {k}: {x[0] or k} has shape {y[1]} dtype {y[2]}; expected {x[0] or k} shape {x[1]} dtype {x[2]}"
        if len(a) != len(b):
            return f"{len(b)} entries; expected {len(a)}"
        return None

    @classmethod
    def of(cls, obj: Any, *, buffers: bool = False, buffer_names=None, tied: bool = True) -> "Layout":
        """The layout of the parameters of a flat tensor/array, a list of tensors/arrays, a state_dict or an
        nn.Module (``buffers=True``: floating buffers count too). ``tied``: a state_dict's tied entries are one
        entry (:func:`tied_aliases`; a model's, in a step); False: every entry of the state_dict (:func:`flatten`)."""
        entries = _entries(obj, buffers=buffers, where="model", buffer_names=buffer_names)
        kind = "flat" if _is_flat(obj) else ("dict" if isinstance(obj, (Mapping, torch.nn.Module)) else "list")
        numpy = any(isinstance(v, np.ndarray) for _, v in entries)
        aliases = tied_aliases(obj) if tied or isinstance(obj, torch.nn.Module) else ()
        if aliases:
            tied = {a for a, _ in aliases}
            entries = [(n, v) for n, v in entries if n not in tied]
        return cls(
            kind,
            tuple(n for n, _ in entries),
            tuple(tuple(v.shape) for _, v in entries),
            tuple(as_tensor(v).dtype for _, v in entries),
            numpy,
            aliases,
        )

    def unflatten(self, flat: torch.Tensor | np.ndarray) -> Any:
        """Views of ``flat`` in this layout's form: a flat vector, a list, or a dict of name -> view."""
        if self.kind == "flat":
            return flat
        views = [flat[o : o + n].reshape(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]
        if self.kind == "dict":
            return dict(zip(self.names, views))
        return views


def tied_aliases(obj: Any) -> tuple:
    """(alias, entry) pairs of a module's or a state_dict's tied entries: names under which an earlier entry's
    tensor appears again (GPT-2's ``lm_head.weight`` is its ``transformer.wte.weight``). A module's are its
    parameters and buffers listed twice; a state_dict's, torch tensors that are the same view of the same memory as
    an earlier entry (same address, shape, strides, dtype and device). They are one entry: stepped once, written
    once (the alias sees it), and a client's value under the alias name is not read."""
    out = []
    if isinstance(obj, torch.nn.Module):
        seen: dict = {}
        for n, t in [*obj.named_parameters(remove_duplicate=False), *obj.named_buffers(remove_duplicate=False)]:
            first = seen.setdefault(id(t), n)
            if first != n:
                out.append((n, first))
    elif isinstance(obj, Mapping):
        ts = [(k, v) for k, v in obj.items()
              if type(v) in (torch.Tensor, torch.nn.Parameter) and v.layout == torch.strided and v.numel() > 0]
        try:
            ptrs = list(map(_DATA_PTR, map(itemgetter(1), ts)))
        except RuntimeError:  # (a tensor without memory: nothing is tied to it; the entry checks name it)
            return ()
        if len(set(ptrs)) == len(ptrs):  # (no two entries at one address: nothing is tied)
            return ()
        seen = {}
        for (k, v), ptr in zip(ts, ptrs):
            first = seen.setdefault((v.device, v.dtype, ptr, tuple(v.shape), v.stride()), k)
            if first != k:
                out.append((k, first))
    return tuple(out)


def _is_flat(obj: Any) -> bool:
    return isinstance(obj, (torch.Tensor, np.ndarray))


BUFFER_NAMES = ("running_mean", "running_var", "num_batches_tracked")


def is_buffer_name(name: str) -> bool:
    """torch's names for module buffers (BatchNorm / InstanceNorm running statistics and their counter)."""
    return name.rsplit(".", 1)[-1] in BUFFER_NAMES


def split_entries(obj: Any, *, where: str, buffer_names=None, buffers_count: bool = False) -> tuple[list, list]:
    """``(parameters, buffers)`` of ``obj``, each a list of (name, tensor-or-array); see the module docstring.
    ``buffer_names`` (a set) names a state_dict's buffers (the global module's); ``buffers_count`` moves floating
    buffers to the parameters."""
    if _is_flat(obj):
        if obj.ndim != 1:
            raise ValueError(f"{where} must be 1-D when given as one tensor, got shape {tuple(obj.shape)}")
        return [(None, obj)], []
    if isinstance(obj, torch.nn.Module):
        params = [(n, v.detach()) for n, v in obj.named_parameters()]
        bufs = [(n, b.detach()) for n, b in obj.named_buffers()]
    elif isinstance(obj, Mapping):
        params, bufs = [], []
        for k, v in obj.items():
            if not _is_flat(v):
                raise TypeError(f"{where}[{k!r}] is a {type(v).__name__}; expected a torch.Tensor or numpy.ndarray")
            named_buffer = (k in buffer_names) if buffer_names is not None else is_buffer_name(str(k))
            (bufs if named_buffer or not is_floating(v) else params).append((k, v))
    elif isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        for k, v in enumerate(obj):
            if not _is_flat(v):
                raise TypeError(f"{where}[{k}] is a {type(v).__name__}; expected a torch.Tensor or numpy.ndarray")
            if not is_floating(v):
                raise TypeError(f"{where}[{k}] has dtype {v.dtype}; expected a floating dtype")
        return [(None, v) for v in obj], []
    else:
        raise TypeError(
            f"{where} is a {type(obj).__name__}; expected a tensor, numpy array, list of them, state_dict or nn.Module"
        )
    if buffers_count:
        params += [(n, b) for n, b in bufs if is_floating(b)]
        bufs = [(n, b) for n, b in bufs if not is_floating(b)]
    return params, bufs


def _entries(obj: Any, *, buffers: bool, where: str, buffer_names=None) -> list:
    """(name, tensor-or-array) for every parameter entry of ``obj``; raises on what cannot count."""
    return split_entries(obj, where=where, buffer_names=buffer_names, buffers_count=buffers)[0]


def entries(obj: Any, *, where: str, buffers: bool = False) -> list:
    """The parameter entries of ``obj`` as torch tensors (numpy wrapped without copies)."""
    return [as_tensor(v) for _, v in _entries(obj, buffers=buffers, where=where)]


def flatten(obj: Any, *, buffers: bool = False, out: torch.Tensor | None = None, dtype: torch.dtype | None = None):
    """Copy a model's parameter entries into one flat buffer: ``flat[offsets[k]:...] = entry_k.reshape(-1)``.

    Returns ``(flat, layout)``; ``layout.unflatten(flat)`` gives views in the original form. ``out`` reuses a
    buffer; ``dtype`` defaults to the first entry's. This is a copy: the ops take per-layer input directly
    and never need it.

    >>> flat, layout = flatten([torch.ones(2, 3), torch.zeros(4)])
    >>> flat.shape, [t.shape for t in layout.unflatten(flat)]
    (torch.Size([10]), [torch.Size([2, 3]), torch.Size([4])])
    """
    layout = Layout.of(obj, buffers=buffers, tied=False)  # (every entry of a state_dict, tied ones too)
    tensors = entries(obj, where="model", buffers=buffers)
    if not tensors:
        raise ValueError("model has no floating entries to flatten")
    dtype = dtype or tensors[0].dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch dtype, got {dtype!r}")
    if out is None:
        out = torch.empty(layout.numel, dtype=dtype, device=tensors[0].device)
    elif not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    elif not out.is_floating_point():
        raise TypeError(f"out has dtype {out.dtype}; the entries are floating (an integer buffer would truncate them)")
    elif out.shape != (layout.numel,):
        raise ValueError(f"out must have shape ({layout.numel},), got {tuple(out.shape)}")
    for t, o, n in zip(tensors, layout.offsets, layout.numels):
        out[o : o + n].copy_(t.reshape(-1))
    return out, layout


def memory_spans(ts: list) -> tuple | None:
    """(starts, ends) of the bytes of the contiguous tensors ``ts`` as uint64 arrays, or None when one of them is an
    efficient zero tensor, holds elements but no memory (a storage freed under it) or reaches past the end of its
    storage (one resized smaller under it: torch itself would read past it): :func:`check_memory`'s memory checks
    over a whole list, four C calls a tensor and one a storage (None: check them one by one to name the tensor)."""
    n = len(ts)
    if n == 0:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)
    f = _facts.facts(ts)
    if f is not None and f[:, _facts.OK].all():
        return _spans_of(f[:, _facts.DATA], f[:, _facts.NBYTES]) if _memory_ok(f) else None
    try:
        stores = list(map(_STORAGE, ts))
        lo = np.fromiter(map(_DATA_PTR, ts), dtype=np.uint64, count=n)
        size = np.fromiter(map(_NBYTES, ts), dtype=np.uint64, count=n)
        stored_lo = np.fromiter(map(_DATA_PTR, stores), dtype=np.uint64, count=n)
        stored_hi = np.fromiter(map(_STORED_BYTES, stores), dtype=np.uint64, count=n) + stored_lo
    except (RuntimeError, TypeError, ValueError, OverflowError):  # (no storage at all: the one-by-one check says so)
        return None
    hi = lo + size
    if np.any((size > 0) & ((lo == 0) | (lo < stored_lo) | (hi > stored_hi))):
        return None
    empty = np.flatnonzero(size == 0)  # a zero tensor with elements has no address (above); one without, here
    if len(empty) and any(ts[j]._is_zerotensor() for j in empty.tolist()):
        return None
    return lo, hi


_DATA_PTR, _NBYTES = methodcaller("data_ptr"), attrgetter("nbytes")
_STORAGE, _STORED_BYTES = methodcaller("untyped_storage"), methodcaller("nbytes")
_DTYPE, _SHAPE, _DEVICE = attrgetter("dtype"), attrgetter("shape"), attrgetter("device")
_GRAD = attrgetter("requires_grad")


@dataclasses.dataclass(frozen=True)
class DictPlan:
    """What reading M state_dicts of one layout into rows needs from the layout alone (:func:`dict_plan`): which
    entries are parameters and which buffers, their shapes, the checks against the model's buffers."""

    pidx: list            # parameter entries (positions in the dict), in ``names``' order
    bidx: list            # buffer entries
    by_kind: list         # buffer entries only because client 0's is not floating (every client's must not be)
    ref_dtype: torch.dtype
    ref_shapes: list
    bshapes: list
    take_p: Any           # values -> the parameter entries' values (a tuple or a list)
    take_b: Any           # values -> the buffer entries' values
    flat_at: list         # entries that travel as 1-D views (no elements, or more than 8 dimensions)
    bnames: tuple
    counters: list        # buffer columns whose model buffer is an integer (a floating value is refused there)
    form: Layout
    lens: list            # the parameter entries' element counts
    shape_rows: Any = None  # [entries, 1 + MAX_DIMS] every entry's (ndim, sizes) as the facts hold them (None: >8 dims)
    expect: dict = dataclasses.field(default_factory=dict, compare=False)  # (dtype, device) -> _expected_facts


_LAYOUT_COLUMNS = [_facts.DTYPE, *range(_facts.NDIM, _facts.NUMEL)]
_DICT_PLANS: dict = {}  # layout key -> DictPlan or None (at most _DICT_PLANS_KEPT: a server sees a few layouts)
_DICT_PLANS_KEPT = 64


def dict_plan(keys: tuple, vals0: list, names: tuple, buffer_names, like_dtype, refs: list,
              refs_key: tuple, facts0: np.ndarray | None = None) -> DictPlan | None:
    """The layout of client 0's state_dict (``keys`` -> ``vals0``) matched to the model's parameter entries
    ``names``: built once per distinct (keys, dtypes, shapes, names, buffer names, the dtype the rows must have,
    ``refs_key``: the (name, shape, kind) of the model buffers ``refs``, name -> tensor dicts) and then looked up
    (its ~0.3 ms of Python a call at 122 entries is a dict lookup). None: the entries do not line up with ``names``, or a buffer's
    shape differs from the model's (the caller's general path names what). ``facts0``: ``vals0``'s facts
    (:mod:`fastagg._facts`, every one known), whose dtype and shape columns then stand for their dtypes and shapes
    in the key (one bytes object, not 2 x 122 attribute calls)."""
    layout = (("facts", facts0[:, _LAYOUT_COLUMNS].tobytes()) if facts0 is not None
              else (tuple(map(_DTYPE, vals0)), tuple(map(_SHAPE, vals0))))
    key = (keys, tuple(map(type, keys)), layout, tuple(names),
           None if buffer_names is None else frozenset(buffer_names), like_dtype, refs_key)
    plan = _DICT_PLANS.get(key, False)
    if plan is not False:
        return plan
    named = [k in buffer_names for k in keys] if buffer_names is not None else [is_buffer_name(str(k)) for k in keys]
    is_param = [not n and v.is_floating_point() for n, v in zip(named, vals0)]
    pidx = [j for j, p in enumerate(is_param) if p]
    bidx = [j for j, p in enumerate(is_param) if not p]
    plan = None
    if pidx and tuple(keys[j] for j in pidx) == tuple(names):
        ref_dtype = like_dtype if like_dtype is not None else vals0[pidx[0]].dtype
        ref_shapes = [vals0[j].shape for j in pidx]
        bshapes = [vals0[j].shape for j in bidx]
        bnames = tuple(keys[j] for j in bidx)
        got = [[(k, r.get(n)) for k, n in enumerate(bnames)] for r in refs]
        if not any(ref is not None and bshapes[k] != ref.shape for g in got for k, ref in g):
            plan = DictPlan(
                pidx, bidx, [j for j in bidx if not named[j]], ref_dtype, ref_shapes, bshapes,
                (lambda v: [v[pidx[0]]]) if len(pidx) == 1 else itemgetter(*pidx),
                (lambda v: [v[bidx[0]]]) if len(bidx) == 1 else (itemgetter(*bidx) if bidx else (lambda v: ())),
                [k for k, s in enumerate(ref_shapes) if len(s) > 8 or 0 in s], bnames,
                sorted({k for g in got for k, ref in g if ref is not None and not ref.is_floating_point()}),
                Layout("dict", tuple(names), tuple(tuple(s) for s in ref_shapes), (ref_dtype,) * len(pidx), False),
                [math.prod(s) for s in ref_shapes], _shape_rows([v.shape for v in vals0]))
    if len(_DICT_PLANS) >= _DICT_PLANS_KEPT:
        _DICT_PLANS.clear()
    _DICT_PLANS[key] = plan
    return plan


def _shape_rows(shapes: list) -> np.ndarray | None:
    rows = [_facts.shape_row(s) for s in shapes]
    return None if any(r is None for r in rows) else np.stack(rows) if rows else np.zeros((0, 1 + _facts.MAX_DIMS))


def dicts_by_facts(f: np.ndarray, plan: DictPlan, device_row: int) -> tuple | None:
    """:func:`rows._tensor_dicts`' checks of M state_dicts laid out as ``plan`` from their entries' facts ``f``
    ([M, entries, NCOLUMNS], from :mod:`fastagg._facts`) in a few array operations: every entry a plain tensor of
    its planned shape, with memory (no efficient zero tensor), not a lazily negated view; the parameter entries of
    the planned dtype, on the device of client 0's first one (``device_row``), contiguous, not requiring grad; the
    buffers real, contiguous, off the meta device, and not floating where the model's is an integer counter (or
    where client 0's is not floating); the memory checks of :func:`memory_spans`. Returns the parameter entries'
    spans (entry-major: entry 0 of every client first), or None when a check fails or a fact is not known (the
    Python checks then run and name what is wrong)."""
    F = _facts
    if plan.shape_rows is None:
        return None
    key = (F.dtype_code(plan.ref_dtype), device_row)
    want = plan.expect.get(key)
    if want is None:
        want = plan.expect[key] = _expected_facts(plan, *key)
    if ((f ^ want[0]) & want[1]).any():
        return None
    if plan.bidx and (f[:, plan.bidx, F.DEVICE] >> 16 == F.META).any():
        return None
    return _spans_of(f[:, plan.pidx, F.DATA].T, f[:, plan.pidx, F.NBYTES].T)


def dicts_by_attributes(every: list, ps_of: list, bs_of: list, entries: list, vals_of: list, plan,
                         device: torch.device) -> tuple | None:
    """:func:`dicts_by_facts`' checks attribute by attribute (where fastagg._tensor_facts is not used): the
    parameter entries' spans, or None."""
    try:
        return _dicts_by_attributes(every, ps_of, bs_of, entries, vals_of, plan, device)
    except (RuntimeError, TypeError, ValueError):  # (an entry torch cannot describe: nested...; named there)
        return None


def _dicts_by_attributes(every: list, ps_of: list, bs_of: list, entries: list, vals_of: list, plan,
                         device: torch.device) -> tuple | None:
    m = len(vals_of)
    if set(map(type, every)) != {torch.Tensor}:
        return None
    ps_all, bs_all = list(chain.from_iterable(ps_of)), list(chain.from_iterable(bs_of))
    if (list(map(_SHAPE, ps_all)) != plan.ref_shapes * m or set(map(_DTYPE, ps_all)) != {plan.ref_dtype}
            or set(map(_DEVICE, ps_all)) != {device} or not all(map(_CONTIGUOUS, ps_all)) or any(map(_GRAD, ps_all))
            or list(map(_SHAPE, bs_all)) != plan.bshapes * m or any(t.is_complex for t in set(map(_DTYPE, bs_all)))
            or any(d.type == "meta" for d in set(map(_DEVICE, bs_all)))
            or any(v[j].is_floating_point() for v in vals_of for j in plan.by_kind) or any(map(_NEG, every))):
        return None
    spans = memory_spans(list(chain.from_iterable(entries)))  # (zero tensors and freed storages refused here,
    if spans is None or (bs_all and (not all(map(_CONTIGUOUS, bs_all))  # the buffers' too: contiguous ones
                                     or memory_spans(bs_all) is None)):  # here)
        return None
    # a floating value for an integer counter is refused (general path): one dtype set over those columns
    bidx = plan.bidx
    if any(dt.is_floating_point for dt in set(_DTYPE(v[bidx[k]]) for v in vals_of for k in plan.counters)):
        return None
    return spans


def _expected_facts(plan: DictPlan, dtype: int, device: int) -> tuple:
    """(values, masks), [entries, NCOLUMNS] each: an entry's facts pass :func:`dicts_by_facts`' checks exactly when
    ``(facts ^ values) & masks`` is zero (a column compared whole, or the flag bits that must be set or clear)."""
    F = _facts
    val, mask = F.expect_shapes(plan.shape_rows)
    val[:, F.FLAGS], mask[:, F.FLAGS] = F.MEMORY_OK, F.NEG | F.ZERO_TENSOR | F.MEMORY_OK
    p, b = plan.pidx, plan.bidx
    val[p, F.DTYPE], val[p, F.DEVICE], mask[p, F.DTYPE], mask[p, F.DEVICE] = dtype, device, -1, -1
    val[p, F.FLAGS] |= F.CONTIGUOUS
    mask[p, F.FLAGS] |= F.CONTIGUOUS | F.REQUIRES_GRAD
    if b:
        val[b, F.FLAGS] |= F.CONTIGUOUS
        mask[b, F.FLAGS] |= F.CONTIGUOUS | F.COMPLEX
    integer = plan.by_kind + [b[c] for c in plan.counters]
    if integer:
        mask[integer, F.FLAGS] |= F.FLOATING
    return val, mask


def _spans_of(data: np.ndarray, nbytes: np.ndarray) -> tuple:
    """(starts, ends) as flat uint64 arrays from the DATA and NBYTES facts of tensors whose memory checks passed
    (the MEMORY_OK flag, set in C: every byte inside its storage)."""
    lo = data.astype(np.uint64).reshape(-1)
    return lo, lo + nbytes.astype(np.uint64).reshape(-1)


def _memory_ok(f: np.ndarray) -> bool:
    """:func:`memory_spans`' checks from the tensors' facts: every one known, none an efficient zero tensor, every
    one's bytes inside its storage (the MEMORY_OK flag)."""
    flags = f[:, _facts.FLAGS]
    return bool(f[:, _facts.OK].all() and not (flags & _facts.ZERO_TENSOR).any() and (flags & _facts.MEMORY_OK).all())


_PARAM_PLANS: dict = {}  # (keys, key types, dtypes, shapes, buffers_count) -> (positions, Layout) or None
_CONTIGUOUS = methodcaller("is_contiguous")
_NEG, _CONJ = methodcaller("is_neg"), methodcaller("is_conj")


def param_dict_entries(params: Any, *, buffers_count: bool, supported: tuple) -> tuple | None:
    """The hot path of ``rows.param_rows`` for a global model given as a state_dict of plain CPU / CUDA tensors
    (the functional API's ``params=``, every call): ``(names, tensors, buffer names, buffers, layout)``, with every
    check of the general path made over the whole dict at once -- which entries are parameters and buffers and the
    layout planned once per (keys, dtypes, shapes); one dtype in ``supported`` and one device for the parameters;
    contiguous entries; no lazily negated / conjugated view; :func:`memory_spans`' memory checks; no two entries
    sharing memory. None on anything else (tied entries, numpy, a check failing): the general path then accepts it
    or names the entry at fault."""
    if type(params) not in (dict, OrderedDict_) or not params:
        return None
    keys, vals = tuple(params), list(params.values())
    f = _facts.facts(vals)
    if f is not None and f[:, _facts.OK].all():  # the same checks from the entries' facts, read in C
        flags = f[:, _facts.FLAGS]
        if (not (f[:, _facts.DEVICE] == f[0, _facts.DEVICE]).all() or (f[0, _facts.DEVICE] >> 16) == _facts.META
                or not (flags & _facts.CONTIGUOUS).all() or np.any(flags & (_facts.NEG | _facts.CONJ))):
            return None
        spans = _spans_of(f[:, _facts.DATA], f[:, _facts.NBYTES]) if _memory_ok(f) else None
    else:
        if set(map(type, vals)) != {torch.Tensor} or any(t.layout != torch.strided for t in vals):
            return None  # (sparse and the like: the general path names them)
        if (len(set(map(_DEVICE_OF, vals))) != 1 or vals[0].device.type == "meta"
                or not all(map(_CONTIGUOUS, vals)) or any(map(_NEG, vals)) or any(map(_CONJ, vals))):
            return None
        spans = memory_spans(vals)
    if spans is None:
        return None
    lo, hi = spans
    live = np.flatnonzero(hi > lo)
    order = live[np.argsort(lo[live], kind="stable")]
    if len(order) > 1 and np.any(lo[order[1:]] < hi[order[:-1]]):
        return None  # two entries share memory: tied (one tensor under two names) or overlapping (named there)
    key = (keys, tuple(map(type, keys)), tuple(map(_DTYPE, vals)), tuple(map(_SHAPE, vals)), buffers_count)
    plan = _PARAM_PLANS.get(key, False)
    if plan is False:
        plan = None
        named, bufs = split_entries(params, where="params", buffers_count=buffers_count)
        pos = {k: j for j, k in enumerate(keys)}
        if named and len({vals[pos[k]].dtype for k, _ in named}) == 1 and vals[pos[named[0][0]]].dtype in supported:
            plan = ([pos[k] for k, _ in named], [pos[k] for k, _ in bufs], Layout.of(params, buffers=buffers_count,
                                                                                     tied=False))
        if len(_PARAM_PLANS) >= _DICT_PLANS_KEPT:
            _PARAM_PLANS.clear()
        _PARAM_PLANS[key] = plan
    if plan is None:
        return None
    pidx, bidx, form = plan
    ps, bs = [vals[j] for j in pidx], [vals[j] for j in bidx]
    return [keys[j] for j in pidx], ps, [keys[j] for j in bidx], bs, form


_DEVICE_OF = attrgetter("device")
