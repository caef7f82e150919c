"""Streaming aggregation: fold one client at a time into O(d) state, so a server never holds M updates.

FedExP needs only ``sum_i n_i delta_i``, ``sum_i n_i ||delta_i||^2``, ``sum_i n_i`` and M, so the streamed
step is exact (the same formula as the batched call; equal to float32 rounding).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import weakref
import zlib
from typing import Any

import torch

from . import result
from ._aliasing import check_writes
from ._checks import check_number, check_on_nonfinite, expect_like
from ._docs import share_docs
from .backends import resolve
from .combining import FlatCombiner
from .compress.fold import check_batch, compressed_list, fold, nonfinite_scales
from .compress.fold import FORMATS as COMPRESSED
from .flat import Layout
from .passes import RoundStats, run_stats, sum_stats
from .rows import Buffers, ClientRows, attach_base, check_buffer, client_rows, compute_dtype, param_rows, round_reads


class Accumulator:
    """Running sums of weighted client updates.

    State (on ``like``'s device): ``weighted_sum = sum_i n_i delta_i`` (float32; float64 for float64 data),
    ``weighted_sq_norm_sum = sum_i n_i ||delta_i||^2`` (float64, 0-d), ``total_weight = sum_i n_i``, the
    number of clients, and each client's ``||delta_i||^2`` (M scalars). For state_dict / module updates, the
    weighted sums of their buffers (BatchNorm running statistics) too, in float64; steps average them.

    ``add`` reads each delta once and writes the new sum into a second buffer, which replaces the first only
    if the delta was finite and the new sum is: a rejected client (NaN/Inf, or a weighted update that would
    overflow the sum) leaves the accumulator exactly as it was. Memory: two d-vectors; traffic per client: read
    delta, read sum, write sum. Deciding acceptance reads one flag to the host (on CUDA, ``add``'s only sync).
    ``add`` and the steps may be called from several threads: they take a lock; adds that arrive while one is
    being folded are folded together after it, in one sweep (see :meth:`add`).

    Example::

        acc = fastagg.Accumulator(like=w)
        for delta_i, n_i in arriving_updates:
            acc.add(delta_i, weight=n_i)
        res = acc.fedexp_step(eps=1e-3, params=w)

    ``client_norms=False`` keeps no client norms (``sq_norms`` and ``weighted_sq_norm_sum`` then raise, and so does
    a step by a rule that reads them: FedExP and its family): for the FedAvg family (FedAvg, FedAvgM, the
    Adam family, FedACG, SCAFFOLD), whose steps need only the sum. A compressed fold then skips the clients'
    squares where the kernel can (a third of a BLOCKWISE8 code-book fold on the CPU).
    """

    def __init__(self, like: Any, *, backend: str = "auto", client_norms: bool = True):
        if not isinstance(client_norms, bool):
            raise TypeError(f"client_norms must be True or False, got {client_norms!r}")
        self._client_norms = client_norms
        rows = client_rows([like], name="like")
        # like's description (layout, dtype, device, buffers' shapes), not its values: an accumulator must not keep
        # a model-sized tensor alive that its owner replaced or handed away (fastagg.nvflare hands its params over)
        self._like = dataclasses.replace(rows, rows=[[] for _ in rows.rows], matrix=None)
        self._form: Layout = rows.form
        self._numel = rows.numel
        self._dtype = rows.dtype
        self.device = rows.device
        self._backend_name = backend
        self._backend = resolve(backend, rows.device)
        cdt = compute_dtype(rows.dtype)
        self._buffer_names = rows.buffers.names if rows.buffers is not None else ()
        self._largest_sq = torch.finfo(cdt).max ** 2 if cdt != torch.float64 else float("inf")
        self._buffer_like = {} if rows.buffers is None else \
            {n: v[0] for n, v in zip(rows.buffers.names, rows.buffers.values)}
        self._lock = threading.RLock()  # held while folding or stepping
        # concurrent adds: queued, then folded together by whichever thread takes the lock (fastagg/combining.py)
        # through a weak reference: a cycle (self -> combiner -> self) would keep both d-vectors alive until
        # Python's cycle collector ran, so a server making an Accumulator per step grew by ~16 KB a step
        me = weakref.ref(self)
        self._combiner = FlatCombiner(self._lock, lambda group: me()._fold_group(group),
                                      lambda fold: me()._round.has_token(fold.token))
        self._round = _Round.empty(torch.zeros(rows.numel, dtype=cdt, device=rows.device),
                                   torch.empty(rows.numel, dtype=cdt, device=rows.device), len(self._buffer_names))

    def reset(self) -> None:
        """Forget every client (start a new round). The new sum's zeros are written when it is first read: a round
        of compressed clients writes it in its first fold without reading it, so never needs them."""
        with self._lock:
            r = self._round
            fresh = r.scratch if r.scratch is not None else torch.empty_like(r.sum)
            # one assignment: old or new round
            self._round = dataclasses.replace(_Round.empty(fresh, r.sum, len(self._buffer_names)), unwritten=True)

    @property
    def _sum(self) -> torch.Tensor:
        return self._written_sum()

    def _written_sum(self) -> torch.Tensor:
        """The round's sum buffer, its zeros written first if the round is new (see reset)."""
        r = self._round
        if r.unwritten:
            with self._lock:
                r = self._round
                if r.unwritten:
                    r.sum.zero_()
                    self._round = r = dataclasses.replace(r, unwritten=False)
        return r.sum

    # the round's state, read from the round last committed (see _Round)
    _scratch = property(lambda self: self._round.scratch)
    _weighted_sq = property(lambda self: self._round.weighted_sq)
    _buffer_sums = property(lambda self: list(self._round.buffer_sums))
    _ids = property(lambda self: self._round.ids())
    total_weight = property(lambda self: self._round.total_weight,
                            doc="``sum_i n_i`` over the clients folded in (float).")

    @property
    def _folding(self) -> bool:
        """Adds are waiting to be folded (their threads wait for the lock, then one folds them all)."""
        return bool(self._combiner.pending)

    @property
    def _pending(self) -> list:
        """The adds queued, waiting to be folded."""
        return self._combiner.pending

    @property
    def num_clients(self) -> int:
        return self._round.n

    @property
    def weighted_sum(self) -> Any:
        """``sum_i n_i delta_i`` in the form of one update (views of the internal buffer; do not modify)."""
        total = self._sum
        return self._form.unflatten(total.numpy() if self._form.numpy else total)

    @property
    def client_norms(self) -> bool:
        """Whether the clients' squared norms are kept (the constructor's ``client_norms``)."""
        return self._client_norms

    @property
    def weighted_sq_norm_sum(self) -> torch.Tensor:
        """``sum_i n_i ||delta_i||^2``, float64 0-d (with ``client_norms=True``)."""
        self._need_norms("weighted_sq_norm_sum")
        return self._round.weighted_sq

    @property
    def sq_norms(self) -> torch.Tensor:
        """``||delta_i||^2`` of every client added so far, float64 ``(M,)`` (with ``client_norms=True``)."""
        self._need_norms("sq_norms")
        return self._norms(self._round)

    def _norms(self, r: "_Round") -> torch.Tensor:
        norms = r.norms()
        if not norms:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        return torch.stack(norms)

    def _need_norms(self, what: str) -> None:
        if not self._client_norms:
            raise RuntimeError(f"{what} needs the clients' norms; this accumulator was built with client_norms=False "
                               "(for rules that step on the sum alone: the FedAvg family; keep them with "
                               "client_norms=True)")

    @property
    def client_ids(self) -> list:
        """The ids given to :meth:`add` (None for clients added without one), in the order they were folded."""
        return self._round.ids()

    def add(self, delta: Any, weight: float = 1.0, *, base: Any = None, on_nonfinite: str = "raise",
            client_id: Any = None, scale: float = 1.0) -> bool:
        """Fold one client in: ``sum += weight * delta``; ``sq_sum += weight * ||delta||^2``.

        ``scale`` (default 1) folds ``scale * delta`` in its place (``sum += weight * scale * delta``, ``sq_sum +=
        weight * scale^2 ||delta||^2``) while the round's total weight grows by ``weight`` alone: the asynchronous
        server's staleness discount (a stale update counts for less, without lifting the fresh ones), applied in
        the fold's coefficient, never as a pass of its own.

        ``delta`` has the form, size, dtype and device of ``like`` (state_dicts are matched by entry name);
        ``weight`` is a finite number >= 0 (example count). With ``base`` (the model the client started from, in
        the same form), ``delta`` is the client's full model and its update ``delta - base`` is formed inside the
        kernel, never stored (buffers too: their advance ``b - base_b`` is what is summed). A delta with NaN/Inf, or
        one whose weighted update would overflow the running sum, raises ``ValueError``
        (``on_nonfinite="raise"``) or is dropped (``"skip"``); either way the accumulator is unchanged by it.
        Returns True when the client was folded in. ``client_id`` (a str or int) makes the fold idempotent: a client
        whose id was already folded (this round, or before a restart that reloaded :meth:`state_dict`) is refused
        with a ValueError and changes nothing.

        Several threads may add at once. Adds that arrive while another is being folded wait for it and are then
        folded together, by whichever of them gets the lock first, in one sweep over the running sum (as
        :meth:`add_many`: k clients cost k + 2 d-vectors of traffic instead of 3k); each call still returns (or
        raises) for its own client only, once it is folded or refused. After a fold of several adds, the next
        folder waits up to a tenth of that fold's time (1 ms at most) for as many to queue.

        A signal (Ctrl-C, a timer whose handler raises) may interrupt a call anywhere: the accumulator stays usable
        and consistent (the round's sums, client count and ids change together, in one assignment, or not at
        all). A call interrupted while it waits withdraws its client; one interrupted after its client was
        folded raises, and the client stays folded (``client_ids`` shows it); the other threads' adds go on.
        """
        check_on_nonfinite(on_nonfinite)
        w = check_number(weight, "weight")
        sc = check_number(scale, "scale")
        _check_id(client_id)
        if isinstance(delta, COMPRESSED):
            if base is not None:
                raise TypeError("base= does not apply to a compressed update: it is the update itself")
            return self._add_compressed([delta], [w], [client_id], on_nonfinite, sc, names=["delta"])[0]
        what = "delta" if base is None else "model"
        rows = client_rows([delta], name=what, like=self._like, like_name="the accumulator's `like`")
        expect_like(what, "the accumulator's `like`", numel=(rows.numel, self._numel),
                    dtype=(rows.dtype, self._dtype), device=(rows.device, self.device))
        base_bufs = None
        if base is not None:
            rows, base_bufs = attach_base(rows, base)
        fold = _Fold(rows, w, client_id, on_nonfinite, self._client_buffers(rows, w, base_bufs), scale=sc)
        if self._lock._is_owned():  # re-entered by the thread holding the lock: fold here (a folder would wait on it)
            try:
                self._fold([fold], rows, atomic=False)
            finally:
                self._combiner.settle([fold])
        else:
            self._combiner.join_or_fold(fold)
        if fold.error is not None:
            raise fold.error
        return fold.folded

    def add_many(self, deltas: Any, weights: Any = None, *, base: Any = None, on_nonfinite: str = "raise",
                 client_ids: Any = None) -> list:
        """Fold several clients in one sweep: ``sum += sum_j w_j delta_j`` reads the running sum and writes it once
        for all of them (``add`` per client reads and writes it once per client: k clients cost k + 2 d-vectors of
        traffic here against 3k). ``deltas``: the clients' updates as a list (or an ``[k, d]`` tensor); a list
        may hold compressed updates (:mod:`fastagg.compress`), beside float tensors or numpy arrays of the flat
        size (a mixed round, folded in one call; any float dtype, converted on load into the sums' dtype as the
        codes are);
        ``weights``: k numbers (default 1 each); ``client_ids``: k ids or None; ``base``: as in :meth:`add` (the
        deltas are then full models, their updates formed in the kernel). A client with NaN/Inf raises (the
        accumulator unchanged) or, with ``on_nonfinite="skip"``, is left out while the others are folded. Returns
        one bool per client: whether it was folded."""
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
            _check_id(i)
        named = [i for i in ids if i is not None]
        if len(set(named)) != len(named):
            raise ValueError("add_many got the same client id twice")
        updates = compressed_list(items)  # float tensors beside them are folded in the same call (a mixed round)
        if updates is not None:
            if base is not None:
                raise TypeError("base= does not apply to compressed updates: they are the updates themselves")
            return self._add_compressed(updates, ws, ids, on_nonfinite, 1.0, names=[f"deltas[{j}]" for j in range(k)])
        what = "deltas" if base is None else "models"
        rows = client_rows(items, name=what, like=self._like, like_name="the accumulator's `like`")
        expect_like(what, "the accumulator's `like`", numel=(rows.numel, self._numel),
                    dtype=(rows.dtype, self._dtype), device=(rows.device, self.device))
        base_bufs = None
        if base is not None:
            rows, base_bufs = attach_base(rows, base)
        folds = [_Fold(_one_client(rows, j), ws[j], ids[j], on_nonfinite,
                       self._client_buffers(rows, ws[j], base_bufs, j), name=f"{what}[{j}]") for j in range(k)]
        with self._lock:
            self._fold(folds, rows, atomic=True)
        return [f.folded for f in folds]

    def _fold_group(self, group: list) -> None:
        """Fold queued adds (caller holds the lock): those whose rows line up (the same segments, and the same base
        for full models: the model every client started from) in one sweep each, the rest one by one."""
        alike: dict = {}
        for f in group:
            alike.setdefault(_layout_key(f.rows), []).append(f)
        for folds in alike.values():
            if len(folds) > 1:
                try:
                    self._fold(folds, _stack([f.rows for f in folds]), atomic=False)
                except Exception:  # noqa: BLE001 (what failed is found client by client below, each its own error)
                    pass
        for f in group:
            if not f.done:
                try:
                    self._fold([f], f.rows, atomic=False)
                except Exception as e:  # noqa: BLE001 (raised in the thread that added this client)
                    f.finish(error=e)

    def _fold(self, folds: list, rows: ClientRows, *, atomic: bool) -> None:
        """Fold clients (``rows``, one per fold, in order) in one sweep of the stats kernel (caller holds the lock).
        A client is refused when its id was folded before, it overlaps the buffer the sum is written to, it holds
        NaN/Inf, or it would overflow the sums; ``atomic``: any refusal that raises raises here with nothing folded
        (add_many); else each fold records its own outcome (add)."""
        def refuse(f: _Fold, why: str, *, nonfinite: bool) -> None:
            if nonfinite and f.on_nonfinite == "skip":
                f.finish(folded=False)
                return
            who = f"client {f.client_id!r}" if not nonfinite else f.name or f"delta (client {self.num_clients})"
            err = ValueError(f"{who} {why}; the accumulator is unchanged" + ("" if atomic or len(folds) == 1
                                                                              else " by it"))
            if atomic:
                raise err
            f.finish(error=err)

        live, seen = [], set()
        total = self._round.total_weight
        for f in folds:
            if f.client_id is not None and (self._round.has_id(f.client_id) or f.client_id in seen):
                refuse(f, "was already folded into this round", nonfinite=False)
                continue
            if not math.isfinite(total + f.weight):  # huge finite weights: the one that would overflow is refused
                refuse(f, f"has weight {f.weight:g}, which would overflow the round's total weight {total:g}",
                       nonfinite=True)
                continue
            total += f.weight
            try:
                check_writes([("the accumulator's sum", self._spare())], round_reads(f.rows))
            except ValueError as e:
                if atomic:
                    raise
                f.finish(error=e)
                continue
            if f.client_id is not None:
                seen.add(f.client_id)
            live.append(f)
        if len(live) != len(folds):
            rows = _stack([f.rows for f in live]) if live else None
        while live:
            coef = torch.tensor([f.weight * f.scale for f in live], dtype=torch.float64, device=self.device)
            sq_coef = torch.tensor([f.weight * f.scale * f.scale for f in live], dtype=torch.float64,
                                   device=self.device)
            _, sq, bad, msq = run_stats(rows, coef, self._backend, mean_init=self._sum, mean_out=self._spare())
            sq_new = self._weighted_sq + (sq_coef * sq).sum()
            # an update whose own norm passes the dtype's largest value cannot be stepped even alone (at lr 1):
            # folded in, it would make every later step of the round refuse, so it is refused like NaN here
            bad = bad | (sq > self._largest_sq)
            fine = ~bad.any() & torch.isfinite(msq) & torch.isfinite(sq_new)
            for f in live:
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
                    self._fold([f], f.rows, atomic=False)
                return
            for j in sorted(flagged):
                refuse(live[j], "contains NaN or Inf" if not bool(sq[j] > self._largest_sq) else
                       "is so large that no step could take it (its norm passes the dtype's largest value)",
                       nonfinite=True)
            live = [f for j, f in enumerate(live) if j not in flagged]
            rows = _stack([f.rows for f in live]) if live else None
        if not live:
            return
        r = self._round
        buffer_sums = list(r.buffer_sums)
        for f in live:
            buffer_sums = [b if s is None else s + b for s, b in zip(buffer_sums, f.buffers)]
        spare = self._spare()
        r = self._round
        committed = r.extended([(norm * (f.scale * f.scale), f.client_id, f.token) for norm, f in zip(sq.unbind(), live)],
                               sum=spare, scratch=r.sum, weighted_sq=sq_new, buffer_sums=tuple(buffer_sums),
                               total_weight=r.total_weight + sum(f.weight for f in live))
        self._round = committed  # the one write that folds them: a signal lands before it or after it
        for f in live:
            f.finish(folded=True)

    def _add_compressed(self, updates: list, weights: list, ids: list, on_nonfinite: str, scale: float, *,
                        names: list) -> list:
        """Fold compressed updates (fastagg.compress) in one sweep per format that reads them where they lie
        (csrc/quantized.h): ``sum += sum_i w_i scale x~_i``, ``sq_sum += sum_i w_i scale^2 ||x~_i||^2``. A
        malformed update (wrong size, block, an invalid code, a scale <= 0, sparse indices out of range or not
        strictly increasing) raises naming it, nothing folded; one with a NaN/Inf scale or value raises too, or
        (``"skip"``) is left out (False) while the others are folded; sums that would overflow raise, or
        (``"skip"``) fold none of this call."""
        scans: dict = {}  # the sparse updates' C++ scan, shared by the two checks
        check_batch(updates, names, numel=self._numel, device=self.device, where="the accumulator's `like`",
                    scans=scans)
        if self._buffer_names:
            raise ValueError(f"a compressed update carries no buffers; the accumulator's `like` has "
                             f"{', '.join(self._buffer_names)} (accumulate the parameters alone)")
        folded = [True] * len(updates)
        try:
            skipped = nonfinite_scales(updates, names, scans)
            if skipped and on_nonfinite == "raise":
                raise ValueError(f"{', '.join(names[j] for j in skipped)} has a NaN or Inf scale or value, or codes "
                                 "standing for values beyond float32")
            for j in skipped:
                folded[j] = False
            live = [j for j in range(len(updates)) if folded[j]]
            if not live:
                return folded
            with self._lock:
                r = self._round
                for j in live:
                    if ids[j] is not None and r.has_id(ids[j]):
                        raise ValueError(f"client {ids[j]!r} was already folded into this round")
                total = r.total_weight + sum(weights[j] for j in live)
                if not math.isfinite(total):
                    if on_nonfinite == "skip":
                        return [False] * len(updates)
                    raise ValueError(f"the weights would overflow the round's total weight {r.total_weight:g}")
                coef = torch.tensor([weights[j] * scale for j in live], dtype=torch.float64, device=self.device)
                spare = self._spare()
                sq, msq = fold([updates[j] for j in live], [names[j] for j in live], coef, self._backend,
                               init=None if r.zero else r.sum, out=spare, norms=self._client_norms)
                if sq is None:  # not kept (client_norms=False): the sum alone must stay finite
                    sq = torch.full((len(live),), math.nan, dtype=torch.float64, device=self.device)
                    sq_new, fits = r.weighted_sq, torch.isfinite(msq)
                else:
                    sq_coef = torch.tensor([weights[j] * scale * scale for j in live], dtype=torch.float64,
                                           device=self.device)
                    sq_new = r.weighted_sq + (sq_coef * sq).sum()
                    fits = torch.isfinite(msq) & torch.isfinite(sq_new) & (sq <= self._largest_sq).all()
                if not bool(fits):
                    if on_nonfinite == "skip":
                        return [False] * len(updates)
                    raise ValueError("the update(s) would overflow the running sums")
                self._round = r.extended([(norm * (scale * scale), ids[j], None) for norm, j in zip(sq.unbind(), live)],
                                         sum=spare, scratch=r.sum, weighted_sq=sq_new, total_weight=total)
        except ValueError as e:
            raise ValueError(f"{e}; the accumulator is unchanged") from None
        return folded

    def merge(self, other: "Accumulator") -> None:
        """Fold in every client of ``other`` (an accumulator of the same ``like``: entries matched by key, size, dtype,
        device, buffers): afterwards this one is as if it had seen both sets of clients (the sums added in another
        order: equal to rounding). For hierarchical aggregation: edge accumulators merged at the root. ``other`` is
        not changed; a client id present in both is refused, and nothing changes then."""
        if not isinstance(other, Accumulator):
            raise TypeError(f"merge takes an Accumulator, got {type(other).__name__}")
        if other is self:
            raise ValueError("an accumulator cannot merge itself (its clients would count twice)")
        if self._client_norms and not other._client_norms:
            raise ValueError("the other accumulator keeps no client norms (client_norms=False); this one does: build "
                             "this one with client_norms=False too, or keep the norms in both")
        expect_like("the other accumulator", "this accumulator", numel=(other._numel, self._numel),
                    dtype=(other._dtype, self._dtype), device=(other.device, self.device))
        slices = self._entry_slices(other._form.signature(), "the other accumulator")
        take_buffer = self._buffer_order(list(other._buffer_names), "the other accumulator")
        first, second = sorted((self, other), key=id)  # one lock order for any two accumulators
        with first._lock, second._lock:
            self._written_sum(), other._written_sum()
            r, o = self._round, other._round
            twice = [i for i in o.ids() if i is not None and r.has_id(i)]
            if twice:
                raise ValueError(f"clients {sorted(map(repr, twice))[:5]} are in both accumulators; nothing was merged")
            new_sum = r.sum + _reordered(o.sum, slices)
            new_sq = r.weighted_sq + o.weighted_sq
            total = r.total_weight + o.total_weight
            if not (bool(torch.isfinite(new_sum).all() & torch.isfinite(new_sq)) and math.isfinite(total)):
                raise ValueError("the merged sums overflow; nothing was merged")
            theirs = [o.buffer_sums[k] for k in take_buffer]
            merged = tuple(b if a is None else a if b is None else a + b for a, b in zip(r.buffer_sums, theirs))
            self._round = r.extended([(norm, i, None) for norm, i in zip(o.norms(), o.ids())], sum=new_sum,
                                     weighted_sq=new_sq, buffer_sums=merged, total_weight=total)

    def _entry_slices(self, signature: tuple, what: str) -> list | None:
        """How to read a flat vector laid out as ``signature`` (name, shape, dtype per entry) in this accumulator's
        entry order: None when it already is, else one (offset, numel) per entry of this layout. State_dicts are
        matched by key (the same keys in another order are reordered); anything else must match entry by entry."""
        mine = self._form.signature()
        theirs = tuple((n, tuple(shape), str(dt)) for n, shape, dt in signature)
        if theirs == mine:
            return None
        if self._form.kind == "dict" and all(n is not None for n, _, _ in theirs):
            by_name = {}
            off = 0
            for n, shape, dt in theirs:
                numel = math.prod(shape)
                by_name[n] = (off, numel, shape, dt)
                off += numel
            missing = [n for n, _, _ in mine if n not in by_name]
            extra = [n for n in by_name if n not in {m for m, _, _ in mine}]
            if not missing and not extra:
                out = []
                for n, shape, dt in mine:
                    o, numel, their_shape, their_dt = by_name[n]
                    if (their_shape, their_dt) != (shape, dt):
                        raise ValueError(f"{what}'s entry {n!r} has shape {their_shape} dtype {their_dt}; this "
                                         f"accumulator's has shape {shape} dtype {dt}")
                    out.append((o, numel))
                return out
            raise ValueError(f"{what} has entries {sorted(extra)[:4]} this accumulator does not, and lacks "
                             f"{sorted(missing)[:4]}" if extra and missing else
                             f"{what} has entries this accumulator does not: {sorted(extra)[:4]}" if extra else
                             f"{what} lacks this accumulator's entries {sorted(missing)[:4]}")
        for k, (a, b) in enumerate(zip(theirs, mine)):
            if a != b:
                raise ValueError(f"{what}'s entry {a[0] if a[0] is not None else k} has shape {a[1]} dtype {a[2]}; "
                                 f"this accumulator's has shape {b[1]} dtype {b[2]}")
        raise ValueError(f"{what} has {len(theirs)} entries; this accumulator has {len(mine)}")

    def _buffer_order(self, names: list, what: str) -> list:
        """For each of this accumulator's buffers, its index among ``names`` (buffers matched by name)."""
        if sorted(map(str, names)) != sorted(map(str, self._buffer_names)) or len(set(names)) != len(names):
            raise ValueError(f"{what}'s buffers are {list(names)}; this accumulator's {list(self._buffer_names)}")
        return [list(names).index(n) for n in self._buffer_names]

    def __reduce_ex__(self, protocol):
        raise TypeError("an Accumulator cannot be pickled or copied (it holds a lock and its backend): save "
                        "acc.state_dict() and restore it with load_state_dict() into an Accumulator(like=...)")

    def state_dict(self) -> dict:
        """A half-finished round: the sums, every folded client's squared norm and id, the total weight, the
        buffers' sums, and what they must match (the entries by key, shape and dtype). With :meth:`load_state_dict`
        a restarted server resumes the round without asking the folded clients again (their ids are refused if they
        resend)."""
        with self._lock:
            self._written_sum()
            r = self._round
            state = {"format": 3, "numel": self._numel, "dtype": str(self._dtype), "buffers": list(self._buffer_names),
                     "layout": [list(e) for e in self._form.signature()],
                     "sum": r.sum.detach().cpu().clone(),
                     # (client_norms=False: zeros, and the flag, so that an accumulator keeping norms refuses them)
                     "sq_norms": self._norms(r).cpu().clone() if self._client_norms else
                     torch.zeros(r.n, dtype=torch.float64),
                     "weighted_sq": float(r.weighted_sq) if self._client_norms else 0.0,
                     "total_weight": float(r.total_weight), "client_ids": r.ids(),
                     "buffer_sums": [None if b is None else b.cpu().clone() for b in r.buffer_sums]}
            if not self._client_norms:
                state["client_norms"] = False
        state["crc32"] = _state_crc(state)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s round. Everything is checked (format, entries by key, size, dtype, buffers by
        name, finite sums, norms >= 0, as many norms as ids, a finite total weight >= 0, and the CRC-32 of it all, so
        a flipped byte in a saved file is caught) before anything changes. Formats 1 and 2 (saved before the
        checksum, and before the entries' keys were kept) load with the checks they allow."""
        if not isinstance(state, dict) or state.get("format") not in (1, 2, 3):
            raise ValueError("not an Accumulator state_dict (format 1, 2 or 3)")
        fmt = state["format"]
        for key in ("numel", "dtype", "buffers", "sum", "sq_norms", "weighted_sq", "total_weight", "client_ids",
                    "buffer_sums") + (("crc32",) if fmt >= 2 else ()) + (("layout",) if fmt >= 3 else ()):
            if key not in state:
                raise ValueError(f"the state_dict has no {key!r}")
        if state.get("client_norms", True) is not True and state.get("client_norms") is not False:
            raise ValueError(f"the state_dict's client_norms must be True or False, got {state['client_norms']!r}")
        if self._client_norms and state.get("client_norms", True) is False:
            raise ValueError("the state_dict keeps no client norms (saved with client_norms=False); this accumulator "
                             "keeps them: load it into an Accumulator(like=..., client_norms=False)")
        if state["numel"] != self._numel or state["dtype"] != str(self._dtype):
            raise ValueError(f"the state_dict is of {state['numel']} {state['dtype']} elements; this accumulator "
                             f"holds {self._numel} {self._dtype}")
        total = _state_tensor(state["sum"], "sum", dtype=self._sum.dtype, shape=tuple(self._sum.shape))
        sq = _state_tensor(state["sq_norms"], "sq_norms")
        for key in ("buffers", "client_ids", "buffer_sums") + (("layout",) if fmt >= 3 else ()):
            if not isinstance(state[key], (list, tuple)):
                raise ValueError(f"the state_dict's {key} must be a list, got {type(state[key]).__name__}")
        ids = list(state["client_ids"])
        if sq.dim() != 1 or len(sq) != len(ids):
            raise ValueError("the state_dict's sq_norms must be one per client id")
        try:
            ws = check_number(state["weighted_sq"], "weighted_sq", minimum=0.0)
            tw = check_number(state["total_weight"], "total_weight", minimum=0.0)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the state_dict holds a non-finite or negative sum, norm or weight ({e})") from None
        if not (bool(torch.isfinite(total).all()) and bool(torch.isfinite(sq).all() & (sq >= 0).all())):
            raise ValueError("the state_dict holds a non-finite or negative sum, norm or weight")
        for i in ids:
            _check_id(i)
        named = [i for i in ids if i is not None]
        if len(set(named)) != len(named):
            raise ValueError("the state_dict's client ids repeat")
        bufs = list(state["buffer_sums"])
        if len(bufs) != len(state["buffers"]):
            raise ValueError("the state_dict's buffer sums do not match its buffers")
        if fmt >= 2 and _state_crc(state) != state["crc32"]:
            raise ValueError("the state_dict's checksum does not match its contents (a corrupted file?)")
        if fmt >= 3:  # entries and buffers matched by key
            try:
                layout = tuple((n, tuple(int(v) for v in shape), str(dt)) for n, shape, dt in state["layout"])
            except (TypeError, ValueError):
                raise ValueError("the state_dict's layout must list (name, shape, dtype) per entry") from None
            slices = self._entry_slices(layout, "the state_dict")
            order = self._buffer_order(list(state["buffers"]), "the state_dict")
        else:
            slices, order = None, list(range(len(bufs)))
            if list(state["buffers"]) != list(self._buffer_names):
                raise ValueError(f"the state_dict's buffers are {state['buffers']}; this accumulator's "
                                 f"{list(self._buffer_names)}")
        buffer_sums = []
        for name, k in zip(self._buffer_names, order):
            b = bufs[k]
            if b is not None:
                b = _state_tensor(b, f"buffer sum {name!r}", shape=tuple(self._buffer_like[name].shape))
                if not bool(torch.isfinite(b).all()):
                    raise ValueError(f"the state_dict's buffer sum {name!r} is not finite")
                b = b.to(device=self.device, dtype=torch.float64)
            buffer_sums.append(b)
        with self._lock:
            r = self._round
            target = r.scratch if r.scratch is not None else torch.empty_like(r.sum)
            target.copy_(_reordered(total, slices).to(self.device))
            norms = [v.to(torch.float64).to(self.device) for v in sq.unbind()]
            fresh = dataclasses.replace(_Round.empty(target, r.sum, len(self._buffer_names)), zero=False)
            self._round = fresh.extended([(norm, i, None) for norm, i in zip(norms, ids)],
                                         weighted_sq=torch.tensor(ws, dtype=torch.float64, device=self.device),
                                         buffer_sums=tuple(buffer_sums), total_weight=tw)

    def _client_buffers(self, rows, w: float, base: dict | None = None, client: int = 0) -> list:
        """``w * b`` (with a base: ``w * (b - base_b)``) in float64 for each buffer of client ``client`` of
        ``rows``, in ``like``'s buffer order. Each buffer must have ``like``'s shape, and a floating value is refused
        where ``like``'s buffer is an integer (a counter): checked here, before anything is folded."""
        if not self._buffer_names:
            return []
        if rows.buffers is None:
            raise ValueError(f"delta has no buffers; the accumulator's `like` has {', '.join(self._buffer_names)}")
        given = dict(zip(rows.buffers.names, (v[client] for v in rows.buffers.values)))
        out = []
        for n in self._buffer_names:
            ref = self._buffer_like[n]
            for what, t in [("buffer", given[n])] + ([] if base is None or n not in base else [("base", base[n])]):
                check_buffer(t, ref, f"{what} {n!r}", "the accumulator's `like`")
            v = given[n].to(device=self.device, dtype=torch.float64)
            if base is not None:
                if n not in base:
                    raise ValueError(f"base has no buffer {n!r}; the model has")
                v = v - base[n].to(device=self.device, dtype=torch.float64)
            out.append(w * v)
        return out

    def _check_ready(self) -> None:
        if self.num_clients == 0:
            raise ValueError("the accumulator is empty: add() at least one client first")
        if not self.total_weight > 0:
            raise ValueError("the accumulator's total weight is 0: at least one client needs a positive weight")

    def _spare(self) -> torch.Tensor:
        """The buffer an add writes the new sum into (then swapped with the sum: a refused client leaves the sum
        as it was); allocated again here after a step took it as its mean."""
        r = self._round
        if r.scratch is None:
            self._round = r = dataclasses.replace(r, scratch=torch.empty_like(r.sum))
        return r.scratch

    def _take_spare(self, dtype: torch.dtype | None) -> torch.Tensor | None:
        """Hand the spare buffer to a step as its mean output (caller holds the lock): a step at the end of a round
        then needs no fresh d-vector (at 1e9 parameters, 4 GB less and no first touch of it). A functional step's
        result keeps it (a later add allocates a new spare); a server optimizer gives it back when its step is
        done (:meth:`_return_spare`). None when the step wants another dtype."""
        r = self._round
        if r.scratch is None or (dtype is not None and dtype != r.scratch.dtype):
            return None
        self._round = dataclasses.replace(r, scratch=None)
        return r.scratch

    def _return_spare(self, spare: torch.Tensor) -> None:
        """A spare lent to a step (as its mean) comes back once the step is done with it."""
        with self._lock:
            r = self._round
            if r.scratch is None and spare.shape == r.sum.shape and spare.dtype == r.sum.dtype \
                    and spare.device == r.sum.device and spare.data_ptr() != r.sum.data_ptr():
                self._round = dataclasses.replace(r, scratch=spare)

    def _state_reads(self) -> list:
        """(name, tensor) of the accumulator's state a step reads, for the aliasing checks of what the step writes
        (params that are a view of the sum would change the round's sums behind the accumulator's back)."""
        return [("the accumulator's sum (weighted_sum)", self._sum)]

    @property
    def numel(self) -> int:
        return self._numel

    def __repr__(self) -> str:
        r = self._round  # one snapshot: the count and the weight agree
        return (f"Accumulator(numel={self._numel}, dtype={self._sum.dtype}, device={self.device}, "
                f"clients={r.n}, total_weight={r.total_weight:g}, backend={self._backend.name!r}"
                + ("" if self._client_norms else ", client_norms=False") + ")")

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._sum.dtype

    def round_stats(self, backend_of, *, aux=None, aux_coef: float = 0.0, mean_out=None,
                    mean_dtype: torch.dtype | None = None, keep_mean: bool = True) -> RoundStats:
        """The stats pass over the accumulated sums (``mean = weighted_sum / total_weight``), with every added
        client's squared norm and the buffers' weighted averages. Used by the steps below and by the server
        optimizers. ``keep_mean=False``: the mean is not written; ``stats.mean_sum`` is the flat sum (valid until
        the accumulator changes) and ``stats.mean_scale`` 1 / total_weight."""
        with self._lock:
            self._check_ready()
            r = self._round
            stats = sum_stats(self.weighted_sum, r.weighted_sq if self._client_norms else None, r.total_weight,
                              self.num_clients, backend_of, name="accumulator", aux=aux, aux_coef=aux_coef,
                              mean_out=mean_out, mean_dtype=mean_dtype, keep_mean=keep_mean)
            if not keep_mean:
                stats.mean_sum = self._written_sum()
            stats.sq_norms = self._norms(r) if self._client_norms else \
                torch.full((r.n,), math.nan, dtype=torch.float64, device=self.device)
            if self._buffer_names:
                stats.buffers = Buffers(self._buffer_names, [])
                stats.buffer_sums = [None if s is None else s / r.total_weight for s in r.buffer_sums]
            return stats

    def _from_sums(self, rule, *, params, on_nonfinite, want_eval, group=None) -> result.RoundResult:
        check_on_nonfinite(on_nonfinite)
        p = None
        if params is not None:
            p = param_rows(params)
            if p.segments.numel != self._numel:
                raise ValueError(f"params has {p.segments.numel} elements; expected {self._numel} like the "
                                 "accumulator's `like`")
        with self._lock:
            if p is not None:
                check_writes([(f"params entry {k}", t) for k, t in enumerate(p.parts)], self._state_reads())
            mean_dtype = None if p is None else compute_dtype(p.dtype)
            if group is None:
                stats = self.round_stats(lambda device: self._backend, mean_dtype=mean_dtype,
                                         mean_out=self._take_spare(mean_dtype or self._sum.dtype))
            else:  # every rank's accumulator (fastagg.distributed)
                from .distributed import accumulator_stats

                stats = accumulator_stats(self, lambda device: self._backend, group=group, mean_dtype=mean_dtype)
            eta = rule(stats.avg_sq, stats.mean_sq, stats.num_clients)
            res = result.apply_and_package(stats, eta, params=p, want_eval=want_eval, on_nonfinite=on_nonfinite,
                                        backend=self._backend)
        res.nonfinite = torch.zeros(stats.num_clients, dtype=torch.bool, device=self.device)
        res.sq_norms = stats.sq_norms
        if self._form.numpy:
            res.sq_norms, res.nonfinite = stats.sq_norms.numpy(), res.nonfinite.numpy()
        return res

    @share_docs
    def fedexp_step(self, eps=None, *, eps_mode: str = "paper", params=None, on_nonfinite: str = "raise",
                    group=None) -> result.RoundResult:
        """FedExP from the accumulated sums (see :func:`fastagg.fedexp_step_from_sums`)::

            mean = weighted_sum / total_weight
            eta  = max(1, (weighted_sq_norm_sum / total_weight) / (2 (||mean||^2 + eps)))

        Args:
            {eps}
            {eps_mode}
            {params}
            {on_nonfinite}
            group: a torch.distributed group whose every rank folded its own clients into its accumulator: the
                step is over all of them, the same on every rank (:mod:`fastagg.distributed`).
        """
        rule = result.fedexp_rule(eps, eps_mode)
        self._need_norms("fedexp_step")
        return self._from_sums(rule, params=params, on_nonfinite=on_nonfinite, want_eval=True, group=group)

    def fedavg_step(self, lr: float = 1.0, *, params=None, on_nonfinite: str = "raise",
                    group=None) -> result.RoundResult:
        """FedAvg from the accumulated sums: ``params <- params + lr * weighted_sum / total_weight`` (``group``: as
        in :meth:`fedexp_step`)."""
        return self._from_sums(result.fixed_rule(lr), params=params, on_nonfinite=on_nonfinite, want_eval=False,
                               group=group)


class _Log:
    """The clients of a round in fold order, append-only: their squared norms, ids and fold tokens, with the
    positions of the ids and tokens (membership in O(1)). Only the first ``n`` entries of a :class:`_Round` count;
    entries past it are what an interrupted fold appended before its round was committed, dropped by the next
    fold (so a fold costs O(its clients), not O(the round))."""

    def __init__(self):
        self.norms: list = []
        self.ids: list = []
        self.tokens: list = []
        self.id_pos: dict = {}
        self.token_pos: dict = {}

    def truncate(self, n: int) -> None:
        # the lists may differ in length past n (an append interrupted half-way); a key is in a table only once it
        # is in its list, so the lists' tails name every table entry to drop
        for keys, table in ((self.ids, self.id_pos), (self.tokens, self.token_pos)):
            for key in keys[n:]:
                if key is not None and table.get(key, -1) >= n:
                    del table[key]
        del self.norms[n:], self.ids[n:], self.tokens[n:]

    def append(self, norm: torch.Tensor, client_id: Any, token: int | None) -> None:
        i = len(self.ids)
        self.norms.append(norm)
        self.ids.append(client_id)
        self.tokens.append(token)
        if client_id is not None:
            self.id_pos[client_id] = i
        if token is not None:
            self.token_pos[token] = i


@dataclasses.dataclass(frozen=True)
class _Round:
    """Everything a round has folded. It is never changed, only replaced by a new one in a single assignment, so
    a call interrupted anywhere (a signal) leaves the old round or the new one, never a mix: the sums, the client
    count and the ids always agree. ``scratch`` is the spare sum buffer (None while a step holds it as its mean);
    the first ``n`` entries of ``log`` are the round's clients (see :class:`_Log`); a fold's token there tells an add
    that it was folded by a folder that was interrupted before it could say so."""

    sum: torch.Tensor
    scratch: torch.Tensor | None
    n: int
    log: _Log
    weighted_sq: torch.Tensor
    buffer_sums: tuple
    total_weight: float
    zero: bool = False  # the sum is all zeros (a new round): a compressed fold writes it, reading nothing
    unwritten: bool = False  # ... and its buffer does not hold them yet (Accumulator._sum writes them when read)

    @classmethod
    def empty(cls, zeros: torch.Tensor, scratch: torch.Tensor | None, num_buffers: int) -> "_Round":
        """A round of no client over ``zeros`` (all zeros: the caller zeroed it)."""
        return cls(zeros, scratch, 0, _Log(), torch.zeros((), dtype=torch.float64, device=zeros.device),
                   (None,) * num_buffers, 0.0, zero=True)

    def ids(self) -> list:
        return self.log.ids[:self.n]

    def norms(self) -> list:
        return self.log.norms[:self.n]

    def has_id(self, client_id: Any) -> bool:
        return self.log.id_pos.get(client_id, self.n) < self.n

    def has_token(self, token: int) -> bool:
        return self.log.token_pos.get(token, self.n) < self.n

    def extended(self, entries: list, **changes) -> "_Round":
        """This round with ``entries`` ((norm, id, token) each) folded in, and ``changes`` to its other fields;
        appends to the shared log (past this round's ``n``: invisible until the new round is assigned)."""
        self.log.truncate(self.n)
        for norm, client_id, token in entries:
            self.log.append(norm, client_id, token)
        fields = {"sum": self.sum, "scratch": self.scratch, "log": self.log, "weighted_sq": self.weighted_sq,
                  "buffer_sums": self.buffer_sums, "total_weight": self.total_weight}  # (dataclasses.replace: slow)
        fields.update(changes)
        return _Round(n=self.n + len(entries), **fields)


_tokens = itertools.count()


@dataclasses.dataclass(eq=False)
class _Fold:
    """One client on its way into the sums, and how that ended: ``folded``, or ``error`` (raised by its adder)."""

    rows: ClientRows
    weight: float
    client_id: Any
    on_nonfinite: str
    buffers: list  # its weighted buffers, float64 (state_dict clients)
    name: str | None = None  # how an error names it (add's: "delta (client N)")
    scale: float = 1.0  # the update folded is scale * delta (the round's weight grows by weight alone)
    done: bool = False
    folded: bool = False
    error: BaseException | None = None
    token: int = dataclasses.field(default_factory=lambda: next(_tokens))

    def finish(self, *, folded: bool = False, error: BaseException | None = None) -> None:
        self.folded, self.error, self.done = folded, error, True


def _one_client(rows: ClientRows, j: int) -> ClientRows:
    """Client j of ``rows`` as rows of one client (views, no copy; the same base)."""
    return dataclasses.replace(rows, rows=[[seg[j]] for seg in rows.rows], num_clients=1, matrix=None, buffers=None)


def _layout_key(rows: ClientRows) -> tuple:
    """Rows with equal keys stack into one sweep: their segments, and where their base lies."""
    base = None if rows.base is None else tuple((t.data_ptr(), t.numel(), t.stride(0)) for t in rows.base)
    return rows.segments.lens, base


def _stack(parts: list) -> ClientRows:
    """Rows of one client each (equal :func:`_layout_key`, dtype and device) as the rows of all of them, in order."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return dataclasses.replace(first, rows=[[p.rows[s][0] for p in parts] for s in range(len(first.rows))],
                               num_clients=len(parts), matrix=None, buffers=None)


def _reordered(flat: torch.Tensor, slices: list | None) -> torch.Tensor:
    """``flat`` read in another entry order (``Accumulator._entry_slices``)."""
    if slices is None:
        return flat
    return torch.cat([flat[o:o + n] for o, n in slices])


def _state_tensor(t: Any, name: str, *, dtype: torch.dtype | None = None, shape: tuple | None = None) -> torch.Tensor:
    """A tensor of a saved round, checked: real floating point, readable (not on the meta device), of ``dtype`` and
    ``shape`` where given."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"the state_dict's {name} must be a tensor, got {type(t).__name__}")
    if t.device.type == "meta":
        raise ValueError(f"the state_dict's {name} is on the meta device (it holds no values)")
    if not t.is_floating_point():
        raise ValueError(f"the state_dict's {name} has dtype {t.dtype}; expected a real floating point tensor")
    if dtype is not None and t.dtype != dtype or shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"the state_dict's {name} must be a {dtype or 'floating point'} tensor of shape "
                         f"{shape if shape is not None else 'any'}, got {t.dtype} of shape {tuple(t.shape)}")
    return t


def _state_crc(state: dict) -> int:
    """CRC-32 of a round state's tensors (their bytes, in place) and of everything else in it (its repr)."""
    keys = ("format", "numel", "dtype", "buffers", "weighted_sq", "total_weight", "client_ids") + \
        (("layout",) if state.get("format", 0) >= 3 else ()) + (("client_norms",) if "client_norms" in state else ())
    crc = zlib.crc32(repr([state[k] for k in keys]).encode())
    for t in [state["sum"], state["sq_norms"], *state["buffer_sums"]]:
        if t is None:
            crc = zlib.crc32(b"None", crc)
        elif isinstance(t, torch.Tensor):
            crc = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
        else:
            raise ValueError(f"the state_dict holds a {type(t).__name__} where a tensor belongs")
    return crc


def _check_id(client_id: Any) -> None:
    if client_id is not None and (not isinstance(client_id, (str, int)) or isinstance(client_id, bool)):
        raise TypeError(f"client_id must be a str or an int, got {type(client_id).__name__}")


__all__ = ["Accumulator"]
