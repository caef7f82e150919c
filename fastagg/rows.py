"""Inputs normalized for the kernels: M client rows cut into L segments, and the parameter buffer.

Every accepted form of client updates -- an ``[M, d]`` tensor (rows may be strided), a list of M flat
tensors, a list of M per-layer lists or state_dicts, numpy arrays of any of these -- becomes a
:class:`ClientRows`: for each segment ``s`` (a layer, or the whole vector) and client ``i`` a 1-D view
``rows[s][i]``. Nothing is copied; validation names the offending client, entry and value.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from itertools import chain
from operator import methodcaller
from typing import Any

import numpy as np
import torch

from . import _facts
from ._aliasing import Rows, check_writes
from .flat import (Layout, as_tensor, dict_plan, dicts_by_attributes, dicts_by_facts, param_dict_entries,
                   split_entries, tied_aliases)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Per-element math and the mean's dtype: float64 for float64 data, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def unkept_mean(rows: "ClientRows", mean_init: torch.Tensor | None, noise) -> torch.Tensor:
    """The scratch a stats pass asked for no mean (``mean_out=None``) writes its mean into, on a backend without a
    store-free pass (the C++ one keeps each block in a per-thread scratch instead): the init's dtype, else the
    rows' compute dtype. Noise is refused: it exists to be written into the mean."""
    if noise is not None and noise[0] > 0:
        raise ValueError("round_stats: noise needs a mean_out to be written into")
    dtype = mean_init.dtype if mean_init is not None else compute_dtype(rows.dtype)
    return torch.empty(rows.numel, dtype=dtype, device=rows.device)


@dataclasses.dataclass(frozen=True)
class Segments:
    """Lengths and offsets of the segments of a flat vector of ``numel`` elements."""

    lens: tuple
    offs: tuple

    @classmethod
    def of_lengths(cls, lens: Sequence[int]) -> "Segments":
        offs, off = [], 0
        for n in lens:
            offs.append(off)
            off += n
        return cls(tuple(lens), tuple(offs))

    @property
    def numel(self) -> int:
        return sum(self.lens)

    def __len__(self) -> int:
        return len(self.lens)

    def tables(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(lens, offs) as int64 tensors."""
        t = torch.tensor([self.lens, self.offs], dtype=torch.int64).to(device)
        return t[0], t[1]

    def slice(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat vector, one per segment."""
        return [flat[o : o + n] for o, n in zip(self.offs, self.lens)]


def _ptr_table(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


@dataclasses.dataclass
class Buffers:
    """Every client's buffers (BatchNorm running statistics, counters), by name: ``values[k][i]`` is client i's
    entry ``names[k]``. They never enter the rows: server steps average them (passes.py)."""

    names: tuple
    values: list


class EntryRows(Sequence):
    """``rows[s][i]`` of a :class:`ClientRows` built from contiguous N-D entries (``entries[s][i]``: a state_dict's
    tensors as the client sent them): segment s's 1-D views are made when something first asks for them. The
    compiled and Triton passes and the aliasing check read the entries themselves (their addresses and element
    counts are the views'), so a round of 16 ResNet-18 state_dicts makes none of its ~1,000 views (~1 us each)."""

    def __init__(self, entries: list, spans: tuple | None = None) -> None:
        self.entries = entries
        self._views = [None] * len(entries)
        # (starts, ends) of every entry's bytes as uint64 arrays, entry-major ([s * M + i]), when the shortcut
        # read them while checking the entries' memory: the aliasing check reuses them
        self.spans = spans

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, s):
        if isinstance(s, slice):
            return [self[k] for k in range(*s.indices(len(self)))]
        views = self._views[s]
        if views is None:
            views = self._views[s] = list(map(_FLAT, self.entries[s]))
        return views

    def __iter__(self):
        return (self[s] for s in range(len(self)))


def row_entries(rows: "ClientRows") -> list:
    """The client rows segment by segment as contiguous tensors of the rows' element counts: the N-D entries when
    the rows were built from them (no views made), else the 1-D rows."""
    return rows.rows.entries if isinstance(rows.rows, EntryRows) else rows.rows


@dataclasses.dataclass
class ClientRows:
    """M client rows in L segments: ``rows[s][i]`` is client i's part of segment s (a 1-D view).

    ``base`` (full client models) holds the global model's part of each segment; deltas are then
    ``rows[s][i] - base[s]``, formed inside the kernels and never stored. ``matrix`` is the original
    ``[M, d]`` tensor when there is one (lets backends skip per-row work).
    """

    rows: list
    segments: Segments
    num_clients: int
    dtype: torch.dtype
    device: torch.device
    form: Layout
    base: list | None = None
    matrix: torch.Tensor | None = None
    buffers: "Buffers | None" = None  # the clients' buffers (state_dict / module clients), never in the rows

    @property
    def numel(self) -> int:
        return self.segments.numel

    def row_ptrs(self) -> torch.Tensor:
        """Addresses of every row segment, ``[s * M + i]``, as a CPU int64 tensor."""
        if self.matrix is not None:
            m = self.matrix
            step = m.stride(0) * m.element_size()
            return torch.arange(self.num_clients, dtype=torch.int64) * step + m.data_ptr()
        return _ptr_table([r for seg in row_entries(self) for r in seg])

    def base_ptrs(self) -> torch.Tensor | None:
        return None if self.base is None else _ptr_table(self.base)

    def client(self, i: int) -> list:
        return [seg[i] for seg in self.rows]


@dataclasses.dataclass
class ParamRows:
    """The global model as L writable 1-D views (one per segment), plus its original form."""

    parts: list
    segments: Segments
    dtype: torch.dtype
    device: torch.device
    form: Layout
    original: Any
    buffers: list = dataclasses.field(default_factory=list)  # (name, writable tensor) of the model's buffers

    @property
    def buffer_names(self) -> set:
        return {n for n, _ in self.buffers}

    def ptrs(self) -> torch.Tensor:
        return _ptr_table(self.parts)


def _check_dtype(t: torch.Tensor, where: str) -> None:
    """``t`` is dense (strided, not nested: what the kernels read in place) and of a supported floating dtype."""
    if t.layout != torch.strided or t.is_nested:
        raise ValueError(f"{where} is a {'nested' if t.is_nested else t.layout} tensor; fastagg reads dense memory "
                         "in place: pass a dense tensor (.to_dense())")
    if t.dtype not in SUPPORTED_DTYPES:
        kind = "floating" if not t.is_floating_point() else "supported floating"
        raise TypeError(f"{where} has dtype {t.dtype}; expected a {kind} dtype (float16, bfloat16, float32, float64)")


def _flat_view(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` as a 1-D view; raises instead of copying when its elements are not contiguous."""
    _check_dtype(t, where)
    if not t.is_contiguous():
        raise ValueError(
            f"{where} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
            "fastagg reads it in place and never copies: pass .contiguous()"
        )
    return t.detach().reshape(-1)


def _client_parts(x: Any, name: str, i: int, names: tuple | None, buffer_names, ref: str) -> tuple[list, list, list]:
    """One client as (parameter tensors, buffer names, buffer tensors). Named clients (state_dicts, modules) are
    matched to ``names`` (those of ``ref``, as an error names it) by key, never by position."""
    where = f"{name}[{i}]"
    if isinstance(x, (torch.Tensor, np.ndarray)):
        t = as_tensor(x, where)
        if t.ndim != 1:
            raise ValueError(f"{where} must be a 1-D (flat) vector, got shape {tuple(t.shape)}")
        _check_dtype(t, where)
        return [t], [], []
    if isinstance(x, (Mapping, torch.nn.Module)) or (isinstance(x, Sequence) and not isinstance(x, (str, bytes))):
        params, bufs = split_entries(x, where=where, buffer_names=buffer_names)
        if names is not None and params and params[0][0] is not None:
            given = {k: v for k, v in params}
            missing = [k for k in names if k not in given]
            extra = [k for k in given if k not in set(names)]
            if missing or extra:
                raise ValueError(f"{where} has parameter entries {_short(extra)} not in {ref}" if extra
                                 else f"{where} lacks parameter entries {_short(missing)} of {ref}")
            params = [(k, given[k]) for k in names]
        wheres = [f"{where}[{key!r}]" if key is not None else f"{where}[{k}]" for k, (key, _) in enumerate(params)]
        parts = [as_tensor(v, w) for w, (_, v) in zip(wheres, params)]
        for w, t in zip(wheres, parts):
            _check_dtype(t, w)
        if not parts:
            raise ValueError(f"{where} has no floating entries")
        return parts, [n for n, _ in bufs], [as_tensor(b, f"{where}[{n!r}]") for n, b in bufs]
    raise TypeError(f"{where} is a {type(x).__name__}; expected a tensor, numpy array, list of them or state_dict")


def _short(keys: list) -> str:
    return ", ".join(repr(k) for k in keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def client_rows(x: Any, *, name: str, params: "ParamRows | None" = None, like: "ClientRows | None" = None,
                like_name: str = "the model they are matched to") -> ClientRows:
    """Validate and normalize M clients' vectors (see module docstring) without copying them.

    State_dict / module clients are matched by entry name: to ``params``' (or ``like``'s, which errors call
    ``like_name``) names when the global model is named, else to the first client's. Their buffers are collected
    apart (``ClientRows.buffers``)."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        m = as_tensor(x, name)
        if m.ndim != 2:
            raise ValueError(f"{name} must be a 2-D [num_clients, num_params] tensor or a list of clients, "
                             f"got shape {tuple(m.shape)}")
        if m.shape[0] == 0:
            raise ValueError(f"{name} is empty: need at least one client")
        _check_dtype(m, name)
        if m.shape[1] > 1 and m.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along the parameter dimension, got strides "
                             f"{m.stride()}; fastagg never copies inputs: pass .contiguous()")
        m = m.detach()
        form = Layout("flat", (None,), ((m.shape[1],),), (m.dtype,), isinstance(x, np.ndarray))
        return ClientRows([list(m.unbind(0))], Segments.of_lengths([m.shape[1]]), m.shape[0], m.dtype,
                          m.device, form, matrix=m)
    if not isinstance(x, Sequence) or isinstance(x, (str, bytes)):
        raise TypeError(f"{name} is a {type(x).__name__}; expected a [M, d] tensor/array or a list of M clients")
    if len(x) == 0:
        raise ValueError(f"{name} is empty: need at least one client")
    named = params is not None and params.form.kind == "dict"
    buffer_names = params.buffer_names if named else None
    names = params.form.names if named else None
    ref = "params" if named else f"{name}[0]"
    if like is not None and like.form.kind == "dict":
        names, ref = like.form.names, like_name
        buffer_names = set(like.buffers.names) if like.buffers is not None else set()
    if names is None and isinstance(x[0], (Mapping, torch.nn.Module)):
        names = tuple(k for k, _ in split_entries(x[0], where=f"{name}[0]")[0])
    ref_form = like.form if like is not None and like.form.kind == "dict" else params.form if named else None
    if ref_form is not None and ref_form.aliases:  # the model's tied entries: a client's copy is not read
        tied = {a for a, _ in ref_form.aliases}
        x = [{k: v for k, v in c.items() if k not in tied} if isinstance(c, Mapping) and not tied.isdisjoint(c)
             else c for c in x]
    fast = _tensor_dicts(x, name, names, buffer_names, like, params)
    if fast is not None:
        return _tied_as(fast, ref_form)
    parsed = [_client_parts(c, name, i, names, buffer_names, ref) for i, c in enumerate(x)]
    clients = [p for p, _, _ in parsed]
    first = clients[0]
    ref_shapes = [tuple(t.shape) for t in first]
    per_layer = _is_listlike(x[0])
    # every entry has one dtype: the model's it is matched to (like), else the first client's first entry's
    ref_dtype, dtype_ref = (like.dtype, like_name) if like is not None else (first[0].dtype, f"{name}[0]")

    def entry(i: int, k: int) -> str:
        key = k if names is None else repr(names[k])
        return f"{name}[{i}][{key}]" if per_layer else f"{name}[{i}]"

    for i, parts in enumerate(clients):
        if len(parts) != len(first):
            raise ValueError(f"{name}[{i}] has {len(parts)} entries; expected {len(first)} like {name}[0]")
        for k, t in enumerate(parts):
            where = entry(i, k)
            if tuple(t.shape) != ref_shapes[k]:
                raise ValueError(f"{where} has shape {tuple(t.shape)}; expected {ref_shapes[k]} like {name}[0]")
            if t.dtype != ref_dtype:
                raise TypeError(f"{where} has dtype {t.dtype}; expected {ref_dtype} like {dtype_ref}")
            if t.device != first[0].device:
                raise ValueError(f"{where} is on {t.device}; expected {first[0].device} like {name}[0]")
    rows = [[_flat_view(c[k], entry(i, k)) for i, c in enumerate(clients)] for k in range(len(first))]
    numpy_in = isinstance(x[0], np.ndarray) or (per_layer and _any_numpy(x[0]))
    if per_layer:
        form = dataclasses.replace(Layout.of(x[0], buffer_names=buffer_names), numpy=numpy_in)
        if names is not None:
            form = dataclasses.replace(form, names=tuple(names),
                                       shapes=tuple(tuple(t.shape) for t in first), dtypes=tuple(t.dtype for t in first))
    else:
        form = Layout("flat", (None,), (ref_shapes[0],), (first[0].dtype,), numpy_in)
    segs = Segments.of_lengths([r[0].numel() for r in rows])
    buffers = _client_buffers(parsed, name)
    if params is not None and params.buffers:
        check_client_buffers(buffers, dict(params.buffers), "params", name)
    if like is not None and like.buffers is not None:
        check_client_buffers(buffers, {n: v[0] for n, v in zip(like.buffers.names, like.buffers.values)}, like_name,
                             name)
    return _tied_as(ClientRows(rows, segs, len(clients), first[0].dtype, first[0].device, form, buffers=buffers),
                    ref_form)


def _tied_as(rows: ClientRows, ref_form: Layout | None) -> ClientRows:
    """``rows`` matched to a model with tied entries carry their names (what is matched to these rows drops them)."""
    if ref_form is None or not ref_form.aliases or rows.form.kind != "dict" or rows.form.aliases:
        return rows
    return dataclasses.replace(rows, form=dataclasses.replace(rows.form, aliases=ref_form.aliases))


_FLAT = methodcaller("view", -1)
_DICTS = (dict, OrderedDict)


def _wrap(v):
    """A numpy array as a tensor view (no copy; callers silence torch's read-only warning); anything else as is."""
    return torch.from_numpy(v) if type(v) is np.ndarray else v


def _model_buffers(like: "ClientRows | None", params: "ParamRows | None") -> tuple:
    """The models' buffers (name -> tensor dicts) the clients' are checked against -- the general path's
    check_client_buffers, against both models when both are given -- and their (name, shape, kind) for
    :func:`flat.dict_plan`'s key: worked out once per model object (its buffers are fixed when it is built)."""
    refs, keys = [], []
    for obj in (params, like):
        if obj is None:
            continue
        memo = obj.__dict__.get("_buffer_refs")
        if memo is None:
            if isinstance(obj, ParamRows):
                ref = dict(obj.buffers) if obj.buffers else None
            else:
                ref = None if obj.buffers is None else {n: v[0] for n, v in zip(obj.buffers.names, obj.buffers.values)}
            memo = obj.__dict__["_buffer_refs"] = (
                ref, None if ref is None else tuple((n, t.shape, t.is_floating_point()) for n, t in ref.items()))
        if memo[0] is not None:
            refs.append(memo[0])
            keys.append(memo[1])
    return refs, tuple(keys)


def _tensor_dicts(x: Sequence, name: str, names: tuple | None, buffer_names, like: "ClientRows | None",
                  params: "ParamRows | None") -> ClientRows | None:
    """The hot path of :func:`client_rows` for what real-model rounds send: M state_dicts of plain tensors with the
    same keys in the same order (the first client's, whose parameter entries are ``names`` in order). The general
    path's checks are made over all entries at once (from their facts read in C, :mod:`fastagg._facts`, else over
    whole lists of attributes), no message built; on anything else, or a check failing, it returns None and the
    general path runs, which accepts or names the client and entry at fault."""
    first = x[0]
    if type(first) not in _DICTS or not first or names is None:
        return None
    keys = tuple(first)
    if any(type(c) not in _DICTS or tuple(c) != keys for c in x):
        return None
    types0 = set(map(type, first.values()))
    numpy_in = np.ndarray in types0
    if numpy_in:  # numpy entries (Flower's, FLARE's replies) wrapped without copies, one warnings guard for all
        try:
            with warnings.catch_warnings():  # torch warns on read-only arrays; fastagg never writes to them
                warnings.simplefilter("ignore", UserWarning)
                x = [dict(zip(keys, map(_wrap, c.values()))) for c in x]
        except (TypeError, ValueError, RuntimeError):
            return None  # (an object array, a byte-swapped one...: the general path names it)
        first = x[0]
        types0 = set(map(type, first.values()))
    if types0 != {torch.Tensor}:
        return None
    m = len(x)
    vals_of = [list(c.values()) for c in x]
    vals0, every = vals_of[0], list(chain.from_iterable(vals_of))
    f = _facts.facts(every)
    if f is not None:
        f = f.reshape(m, len(keys), _facts.NCOLUMNS)
    plan = dict_plan(keys, vals0, names, buffer_names, None if like is None else like.dtype,
                     *_model_buffers(like, params), None if f is None or not f[0, :, _facts.OK].all() else f[0])
    if plan is None or plan.ref_dtype not in SUPPORTED_DTYPES:
        return None
    device = vals0[plan.pidx[0]].device
    if device.type == "meta":
        return None
    take_p, take_b = plan.take_p, plan.take_b
    ps_of = [list(take_p(v)) for v in vals_of]
    bs_of = [list(take_b(v)) for v in vals_of]
    entries = [list(col) for col in zip(*ps_of)]
    if f is not None:
        spans = dicts_by_facts(f, plan, int(f[0, plan.pidx[0], _facts.DEVICE]))
        if spans is None and not f[:, :, _facts.OK].all():  # (an entry the facts do not cover: checked below)
            spans = dicts_by_attributes(every, ps_of, bs_of, entries, vals_of, plan, device)
    else:
        spans = dicts_by_attributes(every, ps_of, bs_of, entries, vals_of, plan, device)
    if spans is None:
        return None
    for k in plan.flat_at:
        entries[k] = [t.view(-1) for t in entries[k]]
    buffers = Buffers(plan.bnames, [list(col) for col in zip(*bs_of)]) if plan.bidx else None
    form = plan.form if not numpy_in else dataclasses.replace(plan.form, numpy=True)
    return ClientRows(EntryRows(entries, spans), Segments.of_lengths(plan.lens), m, plan.ref_dtype, device, form,
                      buffers=buffers)


def check_buffer(t: torch.Tensor, ref: torch.Tensor, what: str, ref_name: str) -> None:
    """A client's buffer ``t`` can update the model's ``ref``: the same shape (no broadcasting), and a real number
    of a kind ``ref`` can hold (a floating value is refused where ``ref`` is an integer counter)."""
    if tuple(t.shape) != tuple(ref.shape):
        raise ValueError(f"{what} has shape {tuple(t.shape)}; expected {tuple(ref.shape)} like {ref_name}")
    if t.is_complex() or (t.is_floating_point() and not ref.is_floating_point()):
        raise TypeError(f"{what} has dtype {t.dtype}; {ref_name}'s is {ref.dtype} (a count, not a measurement)"
                        if not t.is_complex() else f"{what} has dtype {t.dtype}; expected real numbers like "
                        f"{ref_name}")


def check_client_buffers(buffers: "Buffers | None", ref: dict, ref_name: str, name: str) -> None:
    """Every client's buffers against the model's (``ref``: name -> tensor) before anything is written."""
    if buffers is None:
        return
    for n, values in zip(buffers.names, buffers.values):
        if n in ref:
            for i, t in enumerate(values):
                check_buffer(t, ref[n], f"{name}[{i}][{n!r}]", ref_name)


def _client_buffers(parsed: list, name: str) -> Buffers | None:
    """Every client's buffers by name (the first client's names; every client must have the same ones)."""
    names = tuple(parsed[0][1])
    if not names:
        if any(p[1] for p in parsed):
            raise ValueError(f"{name}[0] has no buffers but other clients do; every client needs the same entries")
        return None
    values = [[] for _ in names]
    for i, (_, bnames, bvals) in enumerate(parsed):
        if tuple(sorted(bnames)) != tuple(sorted(names)):
            raise ValueError(f"{name}[{i}] has buffers {_short(sorted(bnames))}; expected {_short(sorted(names))} "
                             f"like {name}[0]")
        by = dict(zip(bnames, bvals))
        for k, n in enumerate(names):
            t = by[n]
            if i and tuple(t.shape) != tuple(values[k][0].shape):
                raise ValueError(f"{name}[{i}][{n!r}] has shape {tuple(t.shape)}; expected "
                                 f"{tuple(values[k][0].shape)} like {name}[0]")
            values[k].append(t)
    return Buffers(names, values)


def _is_listlike(x: Any) -> bool:
    return not isinstance(x, (torch.Tensor, np.ndarray))


def _any_numpy(x: Any) -> bool:
    vals = x.values() if isinstance(x, Mapping) else x
    return any(isinstance(v, np.ndarray) for v in vals) if not isinstance(x, torch.nn.Module) else False


def param_rows(params: Any, *, name: str = "params", buffers_count: bool = False) -> ParamRows:
    """Validate the global model (flat tensor/array, per-layer list, state_dict or module) as writable views.

    Views are detached (a model's parameters may require grad; fastagg writes them as torch.optim does, outside
    autograd), every entry must own its memory (no entry overlaps another or itself), and a module's or
    state_dict's buffers are kept apart (``ParamRows.buffers``) -- unless ``buffers_count``: floating buffers are
    then parameters (stepped by the rule, as Flower's strategies step them); integer ones stay buffers."""
    fast = param_dict_entries(params, buffers_count=buffers_count, supported=SUPPORTED_DTYPES)
    if fast is not None:  # a state_dict of plain tensors: checked over the whole dict, its layout planned once
        names, ts, bnames, bs, form = fast
        flat = [t.detach().view(-1) for t in ts]
        return ParamRows(flat, Segments.of_lengths([t.numel() for t in flat]), ts[0].dtype, ts[0].device, form,
                         params, [(n, b.detach()) for n, b in zip(bnames, bs)])
    if isinstance(params, (torch.Tensor, np.ndarray)):
        t = as_tensor(params, name)
        if t.ndim != 1:
            raise ValueError(f"{name} must be a 1-D (flat) vector or a per-layer list, got shape {tuple(t.shape)}")
        if isinstance(params, np.ndarray) and not params.flags.writeable:
            raise ValueError(f"{name} is a read-only numpy array; it is updated in place")
        named, bufs = [(None, t)], []
    else:
        named, bufs = split_entries(params, where=name, buffers_count=buffers_count)
        tied = {a for a, _ in tied_aliases(params)}
        if tied:  # tied entries (one tensor under two names) are one entry: written once
            named, bufs = [(k, v) for k, v in named if k not in tied], [(k, v) for k, v in bufs if k not in tied]
        if not named:
            raise ValueError(f"{name} has no floating entries")
        for k, (key, v) in enumerate(named + bufs):
            if isinstance(v, np.ndarray) and not v.flags.writeable:
                raise ValueError(f"{name}[{key if key is not None else k}] is a read-only numpy array; it is updated "
                                 "in place")
    parts = [as_tensor(v, name if key is None else f"{name}[{key!r}]") for key, v in named]
    first = parts[0]
    flat_input = len(parts) == 1 and isinstance(params, (torch.Tensor, np.ndarray))
    wheres = [name if flat_input else f"{name}[{key!r}]" if key is not None else f"{name}[{k}]"
              for k, (key, _) in enumerate(named)]
    for where, t in zip(wheres, parts):
        _check_dtype(t, where)
        if t.dtype != first.dtype:
            raise TypeError(f"{where} has dtype {t.dtype}; expected {first.dtype} like {wheres[0]}")
        if t.device != first.device:
            raise ValueError(f"{where} is on {t.device}; expected {first.device} like {wheres[0]}")
    flat = [_flat_view(t, w) for w, t in zip(wheres, parts)]
    buffers = [(n, as_tensor(b, f"{name}[{n!r}]").detach()) for n, b in bufs]
    check_writes([(w, t) for w, t in zip(wheres, flat)] + [(f"{name}[{n!r}]", b) for n, b in buffers])
    form = Layout.of(params, buffers=buffers_count)
    return ParamRows(flat, Segments.of_lengths([t.numel() for t in flat]), first.dtype, first.device, form, params,
                     buffers)


def check_params_match(p: ParamRows, rows: ClientRows, *, name: str = "params", clients: str = "deltas") -> None:
    """params must have the clients' size and device."""
    if p.segments.numel != rows.numel:
        raise ValueError(f"{name} has {p.segments.numel} elements; expected {rows.numel} (the size of each of {clients})")
    if p.device != rows.device:
        raise ValueError(f"{name} is on {p.device}; expected {rows.device} like {clients}")


def attach_base(rows: ClientRows, base: Any, *, name: str = "base") -> tuple[ClientRows, dict]:
    """Client models ``rows`` whose updates are ``model - base``, with ``base`` given in the clients' form (matched by
    entry name for state_dicts). Returns the rows with the base attached and the base's buffers by name."""
    b = client_rows([base], name=name, like=rows, like_name="the client models")
    if b.dtype != rows.dtype:
        raise TypeError(f"{name} has dtype {b.dtype}; expected {rows.dtype} like the client models")
    if b.device != rows.device:
        raise ValueError(f"{name} is on {b.device}; expected {rows.device} like the client models")
    if b.segments != rows.segments:
        raise ValueError(f"{name} has entry sizes {list(b.segments.lens)}; the client models have "
                         f"{list(rows.segments.lens)}")
    bufs = {} if b.buffers is None else dict(zip(b.buffers.names, (v[0] for v in b.buffers.values)))
    return dataclasses.replace(rows, base=[seg[0] for seg in b.rows]), bufs


def subset_rows(rows: ClientRows, keep: list) -> ClientRows:
    """The clients ``keep`` (indices) of ``rows``, as views: no copy (their buffers are not carried)."""
    return dataclasses.replace(rows, rows=[[seg[i] for i in keep] for seg in rows.rows], num_clients=len(keep),
                               matrix=None, buffers=None)


def with_base(rows: ClientRows, p: ParamRows) -> ClientRows:
    """Client models whose deltas are ``model - params``: attach params as the base, segment by segment.

    The two segmentations are reconciled without copies: a flat side is sliced at the other side's
    layer boundaries; two per-layer sides must have the same layer sizes.
    """
    check_params_match(p, rows, clients="models")
    if p.dtype != rows.dtype:
        raise TypeError(f"params has dtype {p.dtype}; expected {rows.dtype} like models (deltas are models - params)")
    if len(p.segments) > 1 and len(rows.segments) > 1 and p.segments.lens != rows.segments.lens:
        raise ValueError(f"params has layer sizes {list(p.segments.lens)}; expected {list(rows.segments.lens)} like models")
    if len(rows.segments) >= len(p.segments):
        base = rows.segments.slice(p.parts[0]) if len(p.segments) == 1 else list(p.parts)
        return dataclasses.replace(rows, base=base)
    segs = p.segments
    flat_rows = rows.rows[0]
    new_rows = [[r[o : o + n] for r in flat_rows] for o, n in zip(segs.offs, segs.lens)]
    return dataclasses.replace(rows, rows=new_rows, segments=segs, base=list(p.parts), matrix=None)


def round_reads(rows: ClientRows) -> list | Rows:
    """What a stats pass over ``rows`` reads, for the aliasing checks: (name, tensor) pairs, or the rows named only
    if an error needs it (``_aliasing.Rows``; the base of ``models=`` is the params themselves: read by the stats
    pass, written only by the apply pass after it)."""
    if rows.matrix is not None:
        return [("deltas", rows.matrix)]
    m = rows.num_clients
    spans = rows.rows.spans if isinstance(rows.rows, EntryRows) else None
    return Rows([r for seg in row_entries(rows) for r in seg], lambda j: f"client {j % m}'s entry {j // m}",
                arrays=None if spans is None else (rows.device, *spans))
