"""Streaming aggregation: fold one client at a time into O(d) state, so a server never holds M updates.

FedExP needs only ``sum_i n_i delta_i``, ``sum_i n_i ||delta_i||^2``, ``sum_i n_i`` and M, so the streamed
step is exact (the same formula as the batched call; equal to float32 rounding).
"""
from __future__ import annotations

import dataclasses
import math
import threading
import time
import zlib
from typing import Any

import torch

from . import ops
from ._aliasing import check_writes
from ._checks import check_number, check_on_nonfinite, expect_like
from ._docs import share_docs
from .backends import resolve
from .flat import Layout
from .ops import round_reads
from .passes import RoundStats, run_stats, sum_stats
from .rows import Buffers, ClientRows, attach_base, client_rows, compute_dtype, param_rows


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
    """

    def __init__(self, like: Any, *, backend: str = "auto"):
        rows = client_rows([like], name="like")
        self._like = rows
        self._form: Layout = rows.form
        self._numel = rows.numel
        self._dtype = rows.dtype
        self.device = rows.device
        self._backend_name = backend
        self._backend = resolve(backend, rows.device)
        cdt = compute_dtype(rows.dtype)
        self._sum = torch.zeros(rows.numel, dtype=cdt, device=rows.device)
        self._scratch = torch.empty_like(self._sum)
        self._buffer_names = rows.buffers.names if rows.buffers is not None else ()
        self._lock = threading.RLock()
        queue_lock = threading.Lock()  # guards the adds waiting to be folded (add)
        self._queue = threading.Condition(queue_lock)  # a fold ended
        self._arrived = threading.Condition(queue_lock)  # an add was queued
        self._pending: list = []
        self._folding = False  # a thread is folding the queue
        self._last_group, self._last_fold_s = 1, 0.0  # how many adds the last fold took, and its seconds
        self.reset()

    def reset(self) -> None:
        """Forget every client (start a new round)."""
        with self._lock:
            self._sum.zero_()
            self._sq_norms: list = []
            self._weighted_sq = torch.zeros((), dtype=torch.float64, device=self.device)
            self._buffer_sums = [None] * len(self._buffer_names)
            self.total_weight = 0.0
            self._ids: list = []  # each folded client's id (None when add() was given none)
            self._named: set = set()  # the ids that are not None: a resend is found in O(1)

    @property
    def num_clients(self) -> int:
        return len(self._sq_norms)

    @property
    def weighted_sum(self) -> Any:
        """``sum_i n_i delta_i`` in the form of one update (views of the internal buffer; do not modify)."""
        return self._form.unflatten(self._sum.numpy() if self._form.numpy else self._sum)

    @property
    def weighted_sq_norm_sum(self) -> torch.Tensor:
        return self._weighted_sq

    @property
    def sq_norms(self) -> torch.Tensor:
        """``||delta_i||^2`` of every client added so far, float64 ``(M,)``."""
        if not self._sq_norms:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        return torch.stack(self._sq_norms)

    @property
    def client_ids(self) -> list:
        """The ids given to :meth:`add` (None for clients added without one), in the order they were folded."""
        return list(self._ids)

    def add(self, delta: Any, weight: float = 1.0, *, base: Any = None, on_nonfinite: str = "raise",
            client_id: Any = None) -> bool:
        """Fold one client in: ``sum += weight * delta``; ``sq_sum += weight * ||delta||^2``.

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
        folder waits up to a tenth of that fold's time (1 ms at most) for as many to queue. A call interrupted while
        it waits (a signal) withdraws its client.
        """
        check_on_nonfinite(on_nonfinite)
        w = check_number(weight, "weight")
        _check_id(client_id)
        what = "delta" if base is None else "model"
        rows = client_rows([delta], name=what, like=self._like, like_name="the accumulator's `like`")
        expect_like(what, "the accumulator's `like`", numel=(rows.numel, self._numel),
                    dtype=(rows.dtype, self._dtype), device=(rows.device, self.device))
        base_bufs = None
        if base is not None:
            rows, base_bufs = attach_base(rows, base)
        fold = _Fold(rows, w, client_id, on_nonfinite, self._client_buffers(rows, w, base_bufs))
        if self._lock._is_owned():  # re-entered by the thread holding the lock: fold here (a folder would wait on it)
            self._fold([fold], rows, atomic=False)
        else:
            self._join_or_fold(fold)
        if fold.error is not None:
            raise fold.error
        return fold.folded

    def _join_or_fold(self, fold: "_Fold") -> None:
        """Queue ``fold``; wait while another thread folds the queue (it may take this one along), else become the
        one that folds: take the lock, then every add queued by then, in one sweep (flat combining).

        When the last fold took several adds, their threads are about to queue their next ones: the new folder
        waits for as many (at most a tenth of the last fold's time, 1 ms at most; PostgreSQL's commit_delay with
        commit_siblings, for the same reason), so the adds keep folding together instead of one alone, then the rest.
        """
        with self._queue:
            self._pending.append(fold)
            self._arrived.notify()
            mine = False  # this thread is the folder
            try:
                while not fold.done and self._folding:
                    self._queue.wait()
                if fold.done:
                    return
                self._folding = mine = True
                deadline = time.perf_counter() + min(0.1 * self._last_fold_s, 1e-3)
                while len(self._pending) < self._last_group:
                    left = deadline - time.perf_counter()
                    if left <= 0 or not self._arrived.wait(left):
                        break
            except BaseException:  # interrupted while waiting (a signal): withdraw the client unless a folder has it
                if fold in self._pending:
                    self._pending.remove(fold)
                if mine:
                    self._folding = False
                    self._queue.notify_all()
                raise
        group: list = []
        try:
            with self._lock:
                with self._queue:
                    group, self._pending = self._pending, []
                t0 = time.perf_counter()
                self._fold_group(group)
                self._last_group, self._last_fold_s = len(group), time.perf_counter() - t0
        finally:
            with self._queue:
                # interrupted (a signal) before or while folding: the others' adds go to the next folder, this
                # thread's own client is withdrawn unless it was folded
                undone = [f for f in group if not f.done and f is not fold]
                self._pending[:0] = undone
                if fold in self._pending:
                    self._pending.remove(fold)
                self._folding = False
                self._queue.notify_all()

    def add_many(self, deltas: Any, weights: Any = None, *, base: Any = None, on_nonfinite: str = "raise",
                 client_ids: Any = None) -> list:
        """Fold several clients in one sweep: ``sum += sum_j w_j delta_j`` reads the running sum and writes it once
        for all of them (``add`` per client reads and writes it once per client: k clients cost k + 2 d-vectors of
        traffic here against 3k). ``deltas``: the clients' updates as a list (or an ``[k, d]`` tensor);
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
        for f in folds:
            if f.client_id is not None and (f.client_id in self._named or f.client_id in seen):
                refuse(f, "was already folded into this round", nonfinite=False)
                continue
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
            coef = torch.tensor([f.weight for f in live], dtype=torch.float64, device=self.device)
            _, sq, bad, msq = run_stats(rows, coef, self._backend, mean_init=self._sum, mean_out=self._scratch)
            sq_new = self._weighted_sq + (coef * sq).sum()
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
                refuse(live[j], "contains NaN or Inf", nonfinite=True)
            live = [f for j, f in enumerate(live) if j not in flagged]
            rows = _stack([f.rows for f in live]) if live else None
        if not live:
            return
        self._sum, self._scratch = self._scratch, self._sum
        self._sq_norms += list(sq.unbind())
        self._weighted_sq = sq_new
        for f in live:
            self._buffer_sums = [b if s is None else s + b for s, b in zip(self._buffer_sums, f.buffers)]
            self.total_weight += f.weight
            self._ids.append(f.client_id)
            if f.client_id is not None:
                self._named.add(f.client_id)
            f.finish(folded=True)

    def merge(self, other: "Accumulator") -> None:
        """Fold in every client of ``other`` (an accumulator of the same ``like``: size, dtype, device, buffers):
        afterwards this one is as if it had seen both sets of clients (the sums added in another order: equal to
        rounding). For hierarchical aggregation: edge accumulators merged at the root. ``other`` is not changed; a
        client id present in both is refused, and nothing changes then."""
        if not isinstance(other, Accumulator):
            raise TypeError(f"merge takes an Accumulator, got {type(other).__name__}")
        if other is self:
            raise ValueError("an accumulator cannot merge itself (its clients would count twice)")
        expect_like("the other accumulator", "this accumulator", numel=(other._numel, self._numel),
                    dtype=(other._dtype, self._dtype), device=(other.device, self.device))
        if other._buffer_names != self._buffer_names:
            raise ValueError(f"the other accumulator's buffers are {list(other._buffer_names)}; this one's "
                             f"{list(self._buffer_names)}")
        first, second = sorted((self, other), key=id)  # one lock order for any two accumulators
        with first._lock, second._lock:
            twice = other._named & self._named
            if twice:
                raise ValueError(f"clients {sorted(map(repr, twice))[:5]} are in both accumulators; nothing was merged")
            new_sum = self._sum + other._sum
            new_sq = self._weighted_sq + other._weighted_sq
            if not bool(torch.isfinite(new_sum).all() & torch.isfinite(new_sq)):
                raise ValueError("the merged sums overflow; nothing was merged")
            self._sum.copy_(new_sum)
            self._weighted_sq = new_sq
            self._sq_norms += list(other._sq_norms)
            self._buffer_sums = [o if s is None else s if o is None else s + o
                                 for s, o in zip(self._buffer_sums, other._buffer_sums)]
            self.total_weight += other.total_weight
            self._ids += list(other._ids)
            self._named |= other._named

    def state_dict(self) -> dict:
        """A half-finished round: the sums, every folded client's squared norm and id, the total weight, the
        buffers' sums, and what they must match (size, dtype). With :meth:`load_state_dict` a restarted server
        resumes the round without asking the folded clients again (their ids are refused if they resend)."""
        with self._lock:
            state = {"format": 2, "numel": self._numel, "dtype": str(self._dtype), "buffers": list(self._buffer_names),
                     "sum": self._sum.detach().cpu().clone(), "sq_norms": self.sq_norms.cpu().clone(),
                     "weighted_sq": float(self._weighted_sq), "total_weight": float(self.total_weight),
                     "client_ids": list(self._ids),
                     "buffer_sums": [None if b is None else b.cpu().clone() for b in self._buffer_sums]}
        state["crc32"] = _state_crc(state)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s round. Everything is checked (format, size, dtype, buffers, finite sums,
        norms >= 0, as many norms as ids, a total weight >= 0, and the CRC-32 of it all, so a flipped byte in a
        saved file is caught) before anything changes. Format 1 (saved before the checksum existed) loads without
        it."""
        if not isinstance(state, dict) or state.get("format") not in (1, 2):
            raise ValueError("not an Accumulator state_dict (format 1 or 2)")
        for key in ("numel", "dtype", "buffers", "sum", "sq_norms", "weighted_sq", "total_weight", "client_ids",
                    "buffer_sums") + (("crc32",) if state["format"] == 2 else ()):
            if key not in state:
                raise ValueError(f"the state_dict has no {key!r}")
        if state["numel"] != self._numel or state["dtype"] != str(self._dtype):
            raise ValueError(f"the state_dict is of {state['numel']} {state['dtype']} elements; this accumulator "
                             f"holds {self._numel} {self._dtype}")
        if list(state["buffers"]) != list(self._buffer_names):
            raise ValueError(f"the state_dict's buffers are {state['buffers']}; this accumulator's "
                             f"{list(self._buffer_names)}")
        total, sq, ids = state["sum"], state["sq_norms"], list(state["client_ids"])
        if not isinstance(total, torch.Tensor) or total.shape != self._sum.shape or total.dtype != self._sum.dtype:
            raise ValueError(f"the state_dict's sum must be a {self._sum.dtype} tensor of {self._numel} elements")
        if not isinstance(sq, torch.Tensor) or sq.dim() != 1 or len(sq) != len(ids):
            raise ValueError("the state_dict's sq_norms must be one per client id")
        ok = bool(torch.isfinite(total).all()) and bool(torch.isfinite(sq).all() & (sq >= 0).all())
        ws, tw = float(state["weighted_sq"]), float(state["total_weight"])
        if not (ok and math.isfinite(ws) and ws >= 0 and math.isfinite(tw) and tw >= 0):
            raise ValueError("the state_dict holds a non-finite or negative sum, norm or weight")
        for i in ids:
            _check_id(i)
        named = [i for i in ids if i is not None]
        if len(set(named)) != len(named):
            raise ValueError("the state_dict's client ids repeat")
        bufs = state["buffer_sums"]
        if len(bufs) != len(self._buffer_names):
            raise ValueError("the state_dict's buffer sums do not match its buffers")
        if state["format"] == 2 and _state_crc(state) != state["crc32"]:
            raise ValueError("the state_dict's checksum does not match its contents (a corrupted file?)")
        with self._lock:
            self._sum.copy_(total.to(self.device))
            self._sq_norms = [v.to(torch.float64).to(self.device) for v in sq.unbind()] if len(sq) else []
            self._weighted_sq = torch.tensor(ws, dtype=torch.float64, device=self.device)
            self.total_weight = tw
            self._ids = ids
            self._named = set(named)
            self._buffer_sums = [None if b is None else b.to(device=self.device, dtype=torch.float64) for b in bufs]

    def _client_buffers(self, rows, w: float, base: dict | None = None, client: int = 0) -> list:
        """``w * b`` (with a base: ``w * (b - base_b)``) in float64 for each buffer of client ``client`` of
        ``rows``, in ``like``'s buffer order."""
        if not self._buffer_names:
            return []
        if rows.buffers is None:
            raise ValueError(f"delta has no buffers; the accumulator's `like` has {', '.join(self._buffer_names)}")
        given = dict(zip(rows.buffers.names, (v[client] for v in rows.buffers.values)))
        out = []
        for n in self._buffer_names:
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
        if self._scratch is None:
            self._scratch = torch.empty_like(self._sum)
        return self._scratch

    def _take_spare(self, dtype: torch.dtype | None) -> torch.Tensor | None:
        """Hand the spare buffer to a step as its mean output (caller holds the lock): a step at the end of a round
        then needs no fresh d-vector (at 1e9 parameters, 4 GB less and no first touch of it). A functional step's
        result keeps it (a later add allocates a new spare); a server optimizer gives it back when its step is
        done (:meth:`_return_spare`). None when the step wants another dtype."""
        if self._scratch is None or (dtype is not None and dtype != self._scratch.dtype):
            return None
        spare, self._scratch = self._scratch, None
        return spare

    def _return_spare(self, spare: torch.Tensor) -> None:
        """A spare lent to a step (as its mean) comes back once the step is done with it."""
        with self._lock:
            if self._scratch is None and spare.shape == self._sum.shape and spare.dtype == self._sum.dtype \
                    and spare.device == self._sum.device and spare.data_ptr() != self._sum.data_ptr():
                self._scratch = spare

    def _state_reads(self) -> list:
        """(name, tensor) of the accumulator's state a step reads, for the aliasing checks of what the step writes
        (params that are a view of the sum would change the round's sums behind the accumulator's back)."""
        return [("the accumulator's sum (weighted_sum)", self._sum)]

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._sum.dtype

    def round_stats(self, backend_of, *, aux=None, aux_coef: float = 0.0, mean_out=None,
                    mean_dtype: torch.dtype | None = None) -> RoundStats:
        """The stats pass over the accumulated sums (``mean = weighted_sum / total_weight``), with every added
        client's squared norm and the buffers' weighted averages. Used by the steps below and by the server
        optimizers."""
        with self._lock:
            self._check_ready()
            stats = sum_stats(self.weighted_sum, self._weighted_sq, self.total_weight, self.num_clients, backend_of,
                              name="accumulator", aux=aux, aux_coef=aux_coef, mean_out=mean_out,
                              mean_dtype=mean_dtype)
            stats.sq_norms = self.sq_norms
            if self._buffer_names:
                stats.buffers = Buffers(self._buffer_names, [])
                stats.buffer_sums = [s / self.total_weight for s in self._buffer_sums]
            return stats

    def _from_sums(self, rule, *, params, on_nonfinite, want_eval, group=None) -> ops.RoundResult:
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
            res = ops.apply_and_package(stats, eta, params=p, want_eval=want_eval, on_nonfinite=on_nonfinite,
                                        backend=self._backend)
        res.nonfinite = torch.zeros(stats.num_clients, dtype=torch.bool, device=self.device)
        res.sq_norms = stats.sq_norms
        if self._form.numpy:
            res.sq_norms, res.nonfinite = stats.sq_norms.numpy(), res.nonfinite.numpy()
        return res

    @share_docs
    def fedexp_step(self, eps=None, *, eps_mode: str = "paper", params=None, on_nonfinite: str = "raise",
                    group=None) -> ops.RoundResult:
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
        rule = ops.fedexp_rule(eps, eps_mode)
        return self._from_sums(rule, params=params, on_nonfinite=on_nonfinite, want_eval=True, group=group)

    def fedavg_step(self, lr: float = 1.0, *, params=None, on_nonfinite: str = "raise",
                    group=None) -> ops.RoundResult:
        """FedAvg from the accumulated sums: ``params <- params + lr * weighted_sum / total_weight`` (``group``: as
        in :meth:`fedexp_step`)."""
        return self._from_sums(ops.fixed_rule(lr), params=params, on_nonfinite=on_nonfinite, want_eval=False,
                               group=group)


@dataclasses.dataclass(eq=False)
class _Fold:
    """One client on its way into the sums, and how that ended: ``folded``, or ``error`` (raised by its adder)."""

    rows: ClientRows
    weight: float
    client_id: Any
    on_nonfinite: str
    buffers: list  # its weighted buffers, float64 (state_dict clients)
    name: str | None = None  # how an error names it (add's: "delta (client N)")
    done: bool = False
    folded: bool = False
    error: BaseException | None = None

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


def _state_crc(state: dict) -> int:
    """CRC-32 of a round state's tensors (their bytes, in place) and of everything else in it (its repr)."""
    crc = zlib.crc32(repr([state[k] for k in ("format", "numel", "dtype", "buffers", "weighted_sq", "total_weight",
                                              "client_ids")]).encode())
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
