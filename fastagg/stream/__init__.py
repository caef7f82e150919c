"""Streaming aggregation: fold one client at a time into O(d) state, so a server never holds M updates.

FedExP needs only ``sum_i n_i delta_i``, ``sum_i n_i ||delta_i||^2``, ``sum_i n_i`` and M, so the streamed
step is exact (the same formula as the batched call; equal to float32 rounding).

The :class:`Accumulator` below keeps thin methods over the package's modules: :mod:`.rounds` (a round's state,
replaced whole by each fold), :mod:`.fold` (``add`` / ``add_many`` / ``merge``, and the fold of float clients),
:mod:`.compressed` (the fold of compressed clients), :mod:`.steps` (the stats pass over the sums, the functional
steps), :mod:`.layout` (another layout's entries matched to this one's) and :mod:`.checkpoint` (the saved round,
its format and CRC-32). The concurrent adds' queue is :mod:`fastagg.combining`'s.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from .. import result
from .._docs import share_docs
from ..backends import resolve
from ..combining import FlatCombiner
from ..flat import Layout, tied_aliases
from ..passes import RoundStats
from ..rows import client_rows, compute_dtype
from . import checkpoint, fold, steps
from .rounds import Round


def _like_rows(like: Any):
    """``like`` as rows of one client; a model's tied entries (one tensor under two names) are one entry, as the
    optimizer's are (:func:`fastagg.flat.tied_aliases`)."""
    tied = tied_aliases(like)
    if tied and isinstance(like, Mapping):
        like = {k: v for k, v in like.items() if k not in {a for a, _ in tied}}
    rows = client_rows([like], name="like")
    if tied:
        rows = dataclasses.replace(rows, form=dataclasses.replace(rows.form, aliases=tied))
    return rows


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
        rows = _like_rows(like)
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
        self._base_memo = None  # the last add's checked base (fold._attached)
        # concurrent adds: queued, then folded together by whichever thread takes the lock (fastagg/combining.py)
        # through a weak reference: a cycle (self -> combiner -> self) would keep both d-vectors alive until
        # Python's cycle collector ran, so a server making an Accumulator per step grew by ~16 KB a step
        me = weakref.ref(self)
        self._combiner = FlatCombiner(self._lock, lambda group: me()._fold_group(group),
                                      lambda f: me()._round.has_token(f.token))
        self._round = Round.empty(torch.zeros(rows.numel, dtype=cdt, device=rows.device),
                                   torch.empty(rows.numel, dtype=cdt, device=rows.device), len(self._buffer_names))

    def reset(self) -> None:
        """Forget every client (start a new round). The new sum's zeros are written when it is first read: a round
        of compressed clients writes it in its first fold without reading it, so never needs them."""
        with self._lock:
            r = self._round
            fresh = r.scratch if r.scratch is not None else torch.empty_like(r.sum)
            # one assignment: old or new round
            self._round = dataclasses.replace(Round.empty(fresh, r.sum, len(self._buffer_names)), unwritten=True)

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

    # the round's state, read from the round last committed (see rounds.Round)
    _scratch = property(lambda self: self._round.scratch)
    _weighted_sq = property(lambda self: self._round.weighted_sq)
    _buffer_sums = property(lambda self: list(self._round.buffer_sums))
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
        return self._round.norm_tensor(self.device)

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
        return fold.add_one(self, delta, weight, base=base, on_nonfinite=on_nonfinite, client_id=client_id, scale=scale)

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
        return fold.add_many(self, deltas, weights, base=base, on_nonfinite=on_nonfinite, client_ids=client_ids)

    def _fold_group(self, group: list) -> None:
        """Fold queued adds (caller holds the lock; the combiner calls it): see :func:`.fold.fold_group`."""
        fold.fold_group(self, group)

    def merge(self, other: "Accumulator") -> None:
        """Fold in every client of ``other`` (an accumulator of the same ``like``: entries matched by key, size, dtype,
        device, buffers): afterwards this one is as if it had seen both sets of clients (the sums added in another
        order: equal to rounding). For hierarchical aggregation: edge accumulators merged at the root. ``other`` is
        not changed; a client id present in both is refused, and nothing changes then."""
        if not isinstance(other, Accumulator):
            raise TypeError(f"merge takes an Accumulator, got {type(other).__name__}")
        if other is self:
            raise ValueError("an accumulator cannot merge itself (its clients would count twice)")
        fold.merge(self, other)

    def __reduce_ex__(self, protocol):
        raise TypeError("an Accumulator cannot be pickled or copied (it holds a lock and its backend): save "
                        "acc.state_dict() and restore it with load_state_dict() into an Accumulator(like=...)")

    def state_dict(self) -> dict:
        """A half-finished round: the sums, every folded client's squared norm and id, the total weight, the
        buffers' sums, and what they must match (the entries by key, shape and dtype). With :meth:`load_state_dict`
        a restarted server resumes the round without asking the folded clients again (their ids are refused if they
        resend)."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s round. Everything is checked (format, entries by key, size, dtype, buffers by
        name, finite sums, norms >= 0, as many norms as ids, a finite total weight >= 0, and the CRC-32 of it all, so
        a flipped byte in a saved file is caught) before anything changes. Formats 1 and 2 (saved before the
        checksum, and before the entries' keys were kept) load with the checks they allow."""
        checkpoint.load_state_dict(self, state)

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
        return steps.round_stats(self, backend_of, aux=aux, aux_coef=aux_coef, mean_out=mean_out,
                                 mean_dtype=mean_dtype, keep_mean=keep_mean)

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
        return steps.from_sums(self, rule, params=params, on_nonfinite=on_nonfinite, want_eval=True, group=group)

    def fedavg_step(self, lr: float = 1.0, *, params=None, on_nonfinite: str = "raise",
                    group=None) -> result.RoundResult:
        """FedAvg from the accumulated sums: ``params <- params + lr * weighted_sum / total_weight`` (``group``: as
        in :meth:`fedexp_step`)."""
        return steps.from_sums(self, result.fixed_rule(lr), params=params, on_nonfinite=on_nonfinite,
                               want_eval=False, group=group)


__all__ = ["Accumulator"]
