"""The Accumulator's adds and merge. ``add`` / ``add_many`` check their clients, then float clients are folded here
(compressed ones in :mod:`.compressed`): ``sum += sum_j w_j scale_j delta_j``, ``sq_sum += sum_j w_j scale_j^2
||delta_j||^2`` in one sweep of the stats kernel, written into the spare buffer and committed (one assignment of a
new :class:`~.rounds.Round`) only when every client folded is finite and the sums are; concurrent adds are grouped
by layout (the queue itself is :mod:`fastagg.combining`'s). ``merge`` adds another accumulator's round."""
from __future__ import annotations

import dataclasses
import math
from operator import attrgetter, methodcaller
from typing import Any

import numpy as np
import torch

from .. import _facts
from .._aliasing import check_writes
from .._checks import check_number, check_on_nonfinite, expect_like
from ..compress.fold import FORMATS as COMPRESSED
from ..compress.fold import compressed_list
from ..passes import run_stats
from ..rows import ClientRows, EntryRows, attach_base, check_buffer, client_rows, round_reads
from .compressed import add_compressed
from .layout import buffer_order, entry_slices, reordered
from .rounds import Fold, check_id


def rows_of(acc, items: list, what: str, base: Any) -> tuple:
    """``items`` (deltas, or full models with ``base``) as rows matching ``acc``'s ``like``, and ``base``'s buffers
    (None without a base)."""
    rows = client_rows(items, name=what, like=acc._like, like_name="the accumulator's `like`")
    expect_like(what, "the accumulator's `like`", numel=(rows.numel, acc._numel),
                dtype=(rows.dtype, acc._dtype), device=(rows.device, acc.device))
    base_bufs = None
    if base is not None:
        rows, base_bufs = _attached(acc, rows, base)
    return rows, base_bufs


_ID, _PTR, _SHAPE, _STRIDE = id, methodcaller("data_ptr"), attrgetter("shape"), methodcaller("stride")
_BASE_COLUMNS = [_facts.DTYPE, _facts.DEVICE, *range(_facts.NDIM, _facts.NUMEL), _facts.DATA]


def _attached(acc, rows: ClientRows, base: Any) -> tuple:
    """``attach_base(rows, base)``, its checked result kept for the next add with the same base: a state_dict of
    plain tensors whose entries are the same tensor objects at the same addresses with the same shapes and strides
    (then the kept views read exactly what new ones would: the kept views hold their storage, so no other tensor can
    take those addresses), matched to rows of the same layout. Every client of a round passes the round's model as
    ``base``; parsing it per add cost ~0.5 ms at 122 entries."""
    if type(base) is not dict or set(map(type, base.values())) != {torch.Tensor}:
        return attach_base(rows, base)
    vals = list(base.values())
    f = _facts.facts(vals)
    if f is not None and f[:, _facts.OK].all() and (f[:, _facts.FLAGS] & _facts.CONTIGUOUS).all():
        # contiguous: the shape fixes the strides; the facts' dtype, device, shape and address columns in one bytes
        where = ("facts", f[:, _BASE_COLUMNS].tobytes())
    else:
        where = (tuple(map(_PTR, vals)), tuple(map(_SHAPE, vals)), tuple(map(_STRIDE, vals)))
    key = (tuple(base), tuple(map(_ID, vals)), where, rows.segments, rows.dtype, rows.device, rows.form)
    memo = acc._base_memo
    if memo is not None and memo[0] == key:
        return dataclasses.replace(rows, base=memo[1]), memo[2]
    rows, bufs = attach_base(rows, base)
    acc._base_memo = (key, rows.base, bufs)
    return rows, bufs


def add_one(acc, delta: Any, weight: float, *, base: Any, on_nonfinite: str, client_id: Any, scale: float) -> bool:
    """:meth:`fastagg.Accumulator.add`: checks one client, then folds it here (under the lock already) or through
    the combiner's queue (compressed: :func:`.compressed.add_compressed`)."""
    check_on_nonfinite(on_nonfinite)
    w = check_number(weight, "weight")
    sc = check_number(scale, "scale")
    check_id(client_id)
    if isinstance(delta, COMPRESSED):
        if base is not None:
            raise TypeError("base= does not apply to a compressed update: it is the update itself")
        return add_compressed(acc, [delta], [w], [client_id], on_nonfinite, sc, names=["delta"])[0]
    rows, base_bufs = rows_of(acc, [delta], "delta" if base is None else "model", base)
    fold = Fold(rows, w, client_id, on_nonfinite, client_buffers(acc, rows, w, base_bufs), scale=sc)
    if acc._lock._is_owned():  # re-entered by the thread holding the lock: fold here (a folder would wait on it)
        try:
            fold_clients(acc, [fold], rows, atomic=False)
        finally:
            acc._combiner.settle([fold])
    else:
        acc._combiner.join_or_fold(fold)
    if fold.error is not None:
        raise fold.error
    return fold.folded


def add_many(acc, deltas: Any, weights: Any, *, base: Any, on_nonfinite: str, client_ids: Any) -> list:
    """:meth:`fastagg.Accumulator.add_many`: checks the clients, then folds them all in one sweep, atomically
    (compressed or mixed: :func:`.compressed.add_compressed`)."""
    check_on_nonfinite(on_nonfinite)
    items = list(deltas) if not isinstance(deltas, torch.Tensor) or deltas.dim() > 1 else [deltas]
    k = len(items)
    if k == 0:
        return []
    ws = [1.0] * k if weights is None else [check_number(w, f"weights[{i}]") for i, w in enumerate(weights)]
    ids = [None] * k if client_ids is None else list(client_ids)
    if len(ws) != k or len(ids) != k:
        raise ValueError(f"add_many got {k} clients, {len(ws)} weights and {len(ids)} client ids")
    for i in ids:
        check_id(i)
    named = [i for i in ids if i is not None]
    if len(set(named)) != len(named):
        raise ValueError("add_many got the same client id twice")
    updates = compressed_list(items)  # float tensors beside them are folded in the same call (a mixed round)
    if updates is not None:
        if base is not None:
            raise TypeError("base= does not apply to compressed updates: they are the updates themselves")
        return add_compressed(acc, updates, ws, ids, on_nonfinite, 1.0, names=[f"deltas[{j}]" for j in range(k)])
    what = "deltas" if base is None else "models"
    rows, base_bufs = rows_of(acc, items, what, base)
    base_row = _base_row(acc, base_bufs)  # (the base's buffers converted once, not once a client)
    folds = [Fold(one_client(rows, j), ws[j], ids[j], on_nonfinite,
                  client_buffers(acc, rows, ws[j], base_bufs, j, base_row=base_row), name=f"{what}[{j}]")
             for j in range(k)]
    with acc._lock:
        fold_clients(acc, folds, rows, atomic=True)
    return [f.folded for f in folds]


def merge(acc, other) -> None:
    """:meth:`fastagg.Accumulator.merge` once ``other`` is known to be another Accumulator: checks that its round
    matches ``acc``'s, then commits the two rounds' sums added, under both locks."""
    if acc._client_norms and not other._client_norms:
        raise ValueError("the other accumulator keeps no client norms (client_norms=False); this one does: build "
                         "this one with client_norms=False too, or keep the norms in both")
    expect_like("the other accumulator", "this accumulator", numel=(other._numel, acc._numel),
                dtype=(other._dtype, acc._dtype), device=(other.device, acc.device))
    slices = entry_slices(acc._form, other._form.signature(), "the other accumulator")
    take_buffer = buffer_order(acc._buffer_names, list(other._buffer_names), "the other accumulator")
    first, second = sorted((acc, other), key=id)  # one lock order for any two accumulators
    with first._lock, second._lock:
        acc._written_sum(), other._written_sum()
        r, o = acc._round, other._round
        twice = [i for i in o.ids() if i is not None and r.has_id(i)]
        if twice:
            raise ValueError(f"clients {sorted(map(repr, twice))[:5]} are in both accumulators; nothing was merged")
        new_sum = r.sum + reordered(o.sum, slices)
        new_sq = r.weighted_sq + o.weighted_sq
        total = r.total_weight + o.total_weight
        if not (bool(torch.isfinite(new_sum).all() & torch.isfinite(new_sq)) and math.isfinite(total)):
            raise ValueError("the merged sums overflow; nothing was merged")
        theirs = [o.buffer_sums[k] for k in take_buffer]
        merged = tuple(b if a is None else a if b is None else a + b for a, b in zip(r.buffer_sums, theirs))
        acc._round = r.extended([(norm, i, None) for norm, i in zip(o.norms(), o.ids())], sum=new_sum,
                                weighted_sq=new_sq, buffer_sums=merged, total_weight=total)


def client_buffers(acc, rows, w: float, base: dict | None = None, client: int = 0, *,
                   base_row: torch.Tensor | None = None) -> list:
    """``w * b`` (with a base: ``w * (b - base_b)``) in float64 for each buffer of client ``client`` of
    ``rows``, in ``like``'s buffer order. Each buffer must have ``like``'s shape, and a floating value is refused
    where ``like``'s buffer is an integer (a counter): checked here, before anything is folded. The buffers are
    converted together (one float64 row for all of them, the base's row subtracted, one product): the values are
    views of that row, elementwise what a buffer-by-buffer conversion gives. ``base_row``: the base's buffers
    already converted and checked (:func:`_base_row`; several clients of one base)."""
    if not acc._buffer_names:
        return []
    if rows.buffers is None:
        raise ValueError(f"delta has no buffers; the accumulator's `like` has {', '.join(acc._buffer_names)}")
    given = dict(zip(rows.buffers.names, (v[client] for v in rows.buffers.values)))
    names = acc._buffer_names
    missing = [n for n in names if n not in given]
    if missing:
        raise ValueError(f"delta has no buffer {missing[0]!r}; the accumulator's `like` has it (every client sends "
                         "the model's buffers)")
    refs, sizes, shaped_at, flat = _buffer_layout(acc)
    vals = [given[n] for n in names]
    bases = None if base is None or any(n not in base for n in names) else [base[n] for n in names]
    if not (_like_refs(vals, refs) and (bases is None or base_row is not None or _like_refs(bases, refs))) or (
            base is not None and bases is None):
        _check_buffers_one_by_one(given, base, names, refs)  # raises, naming the buffer
    row = torch.empty(sum(sizes), dtype=torch.float64, device=acc.device)
    views = list(row.split(sizes))  # (1-D pieces: only the buffers of another shape get a view of their own)
    for k in shaped_at:
        views[k] = views[k].view(refs[k].shape)
    with torch.no_grad():  # (a buffer sent with requires_grad is a value like any other)
        torch._foreach_copy_(views, vals)
        if bases is not None:
            row -= base_row if base_row is not None else _buffer_row(acc, bases)
        row.mul_(w)
    return BufferRow(row, views)


def _buffer_row(acc, values: list) -> torch.Tensor:
    """``values`` (shaped as ``like``'s buffers, in its order) in one float64 row."""
    refs, sizes, _, flat = _buffer_layout(acc)
    row = torch.empty(sum(sizes), dtype=torch.float64, device=acc.device)
    pieces = list(row.split(sizes))  # a 0-d or 1-D value copies into its 1-D piece as it is
    with torch.no_grad():
        torch._foreach_copy_(pieces if flat else [v.view(r.shape) for v, r in zip(pieces, refs)], values)
    return row


def _base_row(acc, base: dict | None) -> torch.Tensor | None:
    """The base's buffers as one float64 row, when they are all there and like ``like``'s (else None: each
    client's :func:`client_buffers` checks them and names what is wrong)."""
    if not acc._buffer_names or base is None or any(n not in base for n in acc._buffer_names):
        return None
    bases = [base[n] for n in acc._buffer_names]
    return _buffer_row(acc, bases) if _like_refs(bases, _buffer_layout(acc)[0]) else None


def _buffer_layout(acc) -> tuple:
    """``like``'s buffers in order, their sizes, which of them are not 1-D, and whether all are 0-d or 1-D: the
    same for every add, worked out at the first."""
    lay = acc.__dict__.get("_buffer_layout")
    if lay is None:
        refs = [acc._buffer_like[n] for n in acc._buffer_names]
        lay = acc._buffer_layout = (refs, [r.numel() for r in refs], [k for k, r in enumerate(refs) if r.dim() != 1],
                                    all(r.dim() <= 1 for r in refs))
    return lay


class BufferRow(list):
    """A client's weighted buffers: ``views`` (shaped as the model's buffers) of one float64 ``row``, which checks
    finiteness in one call instead of one a buffer."""

    def __init__(self, row: torch.Tensor, views: list) -> None:
        super().__init__(views)
        self.row = row

    def finite(self) -> torch.Tensor:
        return torch.isfinite(self.row).all()


def _like_refs(values: list, refs: list) -> bool:
    """Every tensor of ``values`` has its ref's shape, is real, and is an integer where its ref is (the checks of
    ``check_buffer`` over whole lists, from the values' facts read in C where :mod:`fastagg._facts` is used: one
    masked compare; False sends the caller to the one-by-one checks that name the buffer)."""
    want = _refs_facts(refs) if len(values) == len(refs) else None
    f = None if want is None else _facts.facts(values)
    if f is not None:
        return not ((f ^ want[0]) & want[1]).any()
    if any(type(v) is not torch.Tensor for v in values):
        return False
    if [v.shape for v in values] != [r.shape for r in refs]:
        return False
    return not any(v.is_complex() or (v.is_floating_point() and not r.is_floating_point())
                   for v, r in zip(values, refs))


_REFS_FACTS: dict = {}  # the refs' dtype and shape facts (bytes) -> (values, masks)


def _refs_facts(refs: list) -> tuple | None:
    """(values, masks) [len(refs), NCOLUMNS]: a buffer's facts pass :func:`_like_refs` exactly when ``(facts ^
    values) & masks`` is zero (known, the ref's shape, not complex, not floating where the ref is an integer); None
    where the facts cannot say (no module, a ref the facts do not know: more than 8 dimensions...). Planned once
    per distinct (dtypes, shapes) of the refs, read afresh each call (a ref resized in place plans anew)."""
    f = _facts.facts(refs)
    if f is None or not f[:, _facts.OK].all():
        return None
    key = f[:, _REF_COLUMNS].tobytes()
    got = _REFS_FACTS.get(key)
    if got is None:
        val, mask = _facts.expect_shapes(f[:, _facts.NDIM:_facts.NUMEL])
        mask[:, _facts.FLAGS] = _facts.COMPLEX | np.where(f[:, _facts.FLAGS] & _facts.FLOATING, 0, _facts.FLOATING)
        if len(_REFS_FACTS) >= 64:
            _REFS_FACTS.clear()
        got = _REFS_FACTS[key] = (val, mask)
    return got


_REF_COLUMNS = [_facts.DTYPE, *range(_facts.NDIM, _facts.NUMEL)]


def _check_buffers_one_by_one(given: dict, base: dict | None, names: list, refs: list) -> None:
    for n, ref in zip(names, refs):
        for what, t in [("buffer", given[n])] + ([] if base is None or n not in base else [("base", base[n])]):
            check_buffer(t, ref, f"{what} {n!r}", "the accumulator's `like`")
        if base is not None and n not in base:
            raise ValueError(f"base has no buffer {n!r}; the model has")


def fold_group(acc, group: list) -> None:
    """Fold queued adds (caller holds the lock): those whose rows line up (the same segments, and the same base
    for full models: the model every client started from) in one sweep each, the rest one by one."""
    alike: dict = {}
    for f in group:
        alike.setdefault(layout_key(f.rows), []).append(f)
    for folds in alike.values():
        if len(folds) > 1:
            try:
                fold_clients(acc, folds, stack([f.rows for f in folds]), atomic=False)
            except Exception:  # noqa: BLE001 (what failed is found client by client below, each its own error)
                pass
    for f in group:
        if not f.done:
            try:
                fold_clients(acc, [f], f.rows, atomic=False)
            except Exception as e:  # noqa: BLE001 (raised in the thread that added this client)
                f.finish(error=e)


def fold_clients(acc, folds: list, rows: ClientRows, *, atomic: bool) -> None:
    """Fold clients (``rows``, one per fold, in order) in one sweep of the stats kernel (caller holds the lock).
    A client is refused when its id was folded before, it overlaps the buffer the sum is written to, it holds
    NaN/Inf, or it would overflow the sums; ``atomic``: any refusal that raises raises here with nothing folded
    (add_many); else each fold records its own outcome (add)."""
    def refuse(f: Fold, why: str, *, nonfinite: bool) -> None:
        if nonfinite and f.on_nonfinite == "skip":
            f.finish(folded=False)
            return
        who = f"client {f.client_id!r}" if not nonfinite else f.name or f"delta (client {acc.num_clients})"
        err = ValueError(f"{who} {why}; the accumulator is unchanged" + ("" if atomic or len(folds) == 1
                                                                          else " by it"))
        if atomic:
            raise err
        f.finish(error=err)

    live, seen = [], set()
    total = acc._round.total_weight
    try:  # every client's rows against the sum at once; only when one overlaps, client by client below to name it
        check_writes([("the accumulator's sum", acc._spare())], round_reads(rows))
        overlap_free = True
    except ValueError:
        overlap_free = False
    for f in folds:
        if f.client_id is not None and (acc._round.has_id(f.client_id) or f.client_id in seen):
            refuse(f, "was already folded into this round", nonfinite=False)
            continue
        if not math.isfinite(total + f.weight):  # huge finite weights: the one that would overflow is refused
            refuse(f, f"has weight {f.weight:g}, which would overflow the round's total weight {total:g}",
                   nonfinite=True)
            continue
        total += f.weight
        try:
            if not overlap_free:
                check_writes([("the accumulator's sum", acc._spare())], round_reads(f.rows))
        except ValueError as e:
            if atomic:
                raise
            f.finish(error=e)
            continue
        if f.client_id is not None:
            seen.add(f.client_id)
        live.append(f)
    if len(live) != len(folds):
        rows = stack([f.rows for f in live]) if live else None
    while live:
        coef = torch.tensor([f.weight * f.scale for f in live], dtype=torch.float64, device=acc.device)
        sq_coef = torch.tensor([f.weight * f.scale * f.scale for f in live], dtype=torch.float64,
                               device=acc.device)
        _, sq, bad, msq = run_stats(rows, coef, acc._backend, mean_init=acc._sum, mean_out=acc._spare())
        sq_new = acc._weighted_sq + (sq_coef * sq).sum()
        # an update whose own norm passes the dtype's largest value cannot be stepped even alone (at lr 1):
        # folded in, it would make every later step of the round refuse, so it is refused like NaN here
        bad = bad | (sq > acc._largest_sq)
        fine = ~bad.any() & torch.isfinite(msq) & torch.isfinite(sq_new)
        for f in live:
            if isinstance(f.buffers, BufferRow):
                fine = fine & f.buffers.finite()
            else:
                for b in f.buffers:
                    fine = fine & torch.isfinite(b).all()
        if bool(fine):  # one host read per sweep
            break
        flagged = set(bad.nonzero().flatten().tolist())
        if not flagged:  # the sums would overflow, or a buffer is not finite: find which client, one by one
            if len(live) == 1:
                what = "would overflow the running sums" if not live[0].buffers or \
                    all(bool(torch.isfinite(b).all()) for b in live[0].buffers) else "contains NaN or Inf"
                refuse(live[0], what, nonfinite=True)
                return
            if atomic and any(f.on_nonfinite == "raise" for f in live):
                raise ValueError("the clients would overflow the running sums; the accumulator is unchanged")
            for f in live:
                fold_clients(acc, [f], f.rows, atomic=False)
            return
        for j in sorted(flagged):
            refuse(live[j], "contains NaN or Inf" if not bool(sq[j] > acc._largest_sq) else
                   "is so large that no step could take it (its norm passes the dtype's largest value)",
                   nonfinite=True)
        live = [f for j, f in enumerate(live) if j not in flagged]
        rows = stack([f.rows for f in live]) if live else None
    if not live:
        return
    r = acc._round
    buffer_sums = _buffer_sums(acc, list(r.buffer_sums), [f.buffers for f in live])
    spare = acc._spare()
    r = acc._round
    committed = r.extended([(norm * (f.scale * f.scale), f.client_id, f.token) for norm, f in zip(sq.unbind(), live)],
                           sum=spare, scratch=r.sum, weighted_sq=sq_new, buffer_sums=tuple(buffer_sums),
                           total_weight=r.total_weight + sum(f.weight for f in live))
    acc._round = committed  # the one write that folds them: a signal lands before it or after it
    for f in live:
        f.finish(folded=True)


def _buffer_sums(acc, sums: list, added: list) -> list:
    """``sums`` (the round's buffer sums, or Nones before the first fold) plus each of ``added`` (clients'
    weighted buffers) in order, elementwise ``((s + b_0) + b_1) + ...`` as a buffer-by-buffer loop adds them; when
    every client's buffers are one float64 row (:class:`BufferRow`), the adds are a row's each, not a buffer's."""
    if added and all(isinstance(b, BufferRow) for b in added) and (
            all(s is None for s in sums) or all(s is not None for s in sums)):
        refs, sizes, shaped_at, _ = _buffer_layout(acc)
        if sums and sums[0] is not None:
            total = torch.cat([s.reshape(-1) for s in sums]) + added[0].row
        else:
            total = added[0].row.clone()
        for b in added[1:]:
            total += b.row
        out = list(total.split(sizes))
        for k in shaped_at:
            out[k] = out[k].view(refs[k].shape)
        return out
    for b in added:
        sums = [v if s is None else s + v for s, v in zip(sums, b)]
    return sums


def one_client(rows: ClientRows, j: int) -> ClientRows:
    """Client j of ``rows`` as rows of one client (views, no copy; the same base). Rows of state_dict entries stay
    entries (no 1-D view made), with their checked spans when they have them."""
    if isinstance(rows.rows, EntryRows):
        m, spans = rows.num_clients, rows.rows.spans
        one = EntryRows([[e[j]] for e in rows.rows.entries],
                        None if spans is None else (spans[0][j::m], spans[1][j::m]))
        return dataclasses.replace(rows, rows=one, num_clients=1, matrix=None, buffers=None)
    return dataclasses.replace(rows, rows=[[seg[j]] for seg in rows.rows], num_clients=1, matrix=None, buffers=None)


def layout_key(rows: ClientRows) -> tuple:
    """Rows with equal keys stack into one sweep: their segments, and where their base lies."""
    base = None if rows.base is None else tuple((t.data_ptr(), t.numel(), t.stride(0)) for t in rows.base)
    return rows.segments.lens, base


def stack(parts: list) -> ClientRows:
    """Rows of one client each (equal :func:`layout_key`, dtype and device) as the rows of all of them, in order."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if all(isinstance(p.rows, EntryRows) for p in parts):
        return dataclasses.replace(first, rows=EntryRows([[p.rows.entries[s][0] for p in parts]
                                                          for s in range(len(first.rows))]),
                                   num_clients=len(parts), matrix=None, buffers=None)
    return dataclasses.replace(first, rows=[[p.rows[s][0] for p in parts] for s in range(len(first.rows))],
                               num_clients=len(parts), matrix=None, buffers=None)
