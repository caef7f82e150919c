"""The one input path: a round's input turned into the round's statistics (:class:`~fastagg.passes.RoundStats`).

A round's input is any of: client updates as tensors, an ``[M, d]`` matrix, lists or state_dicts, numpy arrays;
full client models with their ``base``; compressed updates (:mod:`fastagg.compress`); an
:class:`~fastagg.Accumulator` the updates were folded into; this rank's clients (or this rank's slice of every
client, ``sharded``) of a torch.distributed group; every client for a robust rule or a DP mechanism. Both public
APIs read it here -- the functional steps (:func:`functional_stats`, for :mod:`fastagg.ops`) and the server
optimizers (:func:`round_stats`, for :mod:`fastagg.server`) -- and get back the statistics the rule and the apply
pass read::

    input -> rows (fastagg.rows: ClientRows, one row-pointer table) -> stats pass (backend.round_stats: mean,
    ||delta_i||^2, ||mean||^2, non-finite flags; or a fold of compressed codes; or an Accumulator's sums; or a
    robust / DP estimate) -> RoundStats

Every check runs before the stats pass writes anything; with a group, a failure is told to every rank first
(:func:`fastagg.distributed.fail_step`), so no rank waits on a collective another has left.

The two APIs differ in two ways, on purpose, and the difference is stated here once:

- compressed clients with a NaN/Inf scale or value: the functional step folds every client and the round is not
  finite (raised, or skipped whole); an optimizer folds them into an Accumulator, which leaves them out under
  ``on_nonfinite="skip"`` as it does any client added to it;
- checks against ``params``: the functional step matches the clients to ``params`` by entry
  (:func:`fastagg.rows.check_params_match`) and takes ``mean_out`` / ``eval_out`` buffers from the caller; an
  optimizer checks the clients' device and size against the params it holds and reuses its own buffers.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import _buffers
from ._aliasing import check_writes
from ._checks import check_on_nonfinite, normalized_weights, out_buffer
from .backends import resolve
from .compress.fold import (CompressedRows, check_batch, compressed_list, dense_rows, fold, nonfinite_scales,
                            numel_of, tensors_of)
from .flat import Layout
from .passes import RoundStats, client_stats, round_dtype
from .rows import (ClientRows, ParamRows, attach_base, check_params_match, client_rows, param_rows, round_reads,
                   with_base)
from .stream import Accumulator

__all__ = ["Target", "round_stats", "give_back", "functional_stats", "no_clients_given"]


def _distributed():
    """:mod:`fastagg.distributed`, loaded by the first round over a torch.distributed group, so that ``import
    fastagg`` stays light (tests/test_user_habits.py pins it): the one function-level import of the input path, a
    downward one (docs/ARCHITECTURE.md, "Lazy imports")."""
    from . import distributed

    return distributed


def no_clients_given(x: Any) -> bool:
    """An empty list of clients, or a [0, d] matrix: a rank of a group with no client this round."""
    if isinstance(x, (list, tuple)):
        return len(x) == 0
    return isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim == 2 and x.shape[0] == 0


@dataclasses.dataclass(eq=False)
class Target:
    """What a server optimizer's round is read for: the params it steps and what its rule needs. Built for each
    stats pass by ``_target`` in fastagg/server/base.py; :func:`round_stats` fills ``robust`` and ``borrowed``."""

    params: ParamRows
    backend: Any                    # the resolved backend module (fastagg.backends.resolve)
    backend_name: str
    on_nonfinite: str
    mean_dtype: torch.dtype         # the optimizer's compute dtype
    mean_buffer: Callable           # (name, dtype, numel) -> a reused d-vector, or None (a size error follows)
    written: Callable               # () -> (name, tensor) of everything the step writes (aliasing checks)
    group: Any = None               # a torch.distributed group (fastagg.distributed), or None
    sharded: bool = False           # with a group: each rank holds one slice of every client
    aggregate: Any = None           # a fastagg.robust rule or fastagg.privacy mechanism reading every client
    aggregate_stats: Callable | None = None  # its stats: fastagg.robust.robust_stats or privacy.mechanisms.dp_stats
    # () -> (vector, coef): the vector whose combination mean + sign * coef * vector the pass measures, or
    # (None, 0); asked only after the input passed its checks (FedExP-M's creates its buffer v on first use)
    aux_of: Callable = lambda: (None, 0.0)
    needs_client_norms: bool = False  # the rule reads the clients' norms (an Accumulator must keep them)
    reads_sum: bool = False         # the apply reads an Accumulator's sum itself: the stats pass writes no mean
    lend_spare: bool = False        # an Accumulator may lend its spare sum as the mean (no buffer kept here)
    what: str = "the step"          # for messages: the optimizer's step
    robust: Any = None              # out: the robust rule's / DP mechanism's result
    borrowed: list = dataclasses.field(default_factory=list)  # out: (accumulator, spare) pairs to give back

    @property
    def sync(self) -> bool:
        return self.on_nonfinite == "raise"


def round_stats(t: Target, deltas: Any, weights: Any, *, name: str = "deltas", base: Any = None,
                sign: float = 1.0) -> RoundStats:
    """An optimizer's round statistics from ``deltas`` (any input form above), weighted by ``weights``;
    ``base``: ``deltas`` are full models measured from it. ``sign`` (-1 for pseudo-gradients) flips the aux term
    the pass measures."""
    updates = compressed_list(deltas, name)
    if updates is not None:
        deltas = updates
        if base is not None:
            raise TypeError("base= does not apply to compressed updates: they are the updates themselves")
        if t.aggregate is not None:  # robust rules and DP read every client: dequantized rows, one each
            deltas = dense_rows(deltas, [f"{name}[{i}]" for i in range(len(deltas))],
                                numel=t.params.segments.numel, device=t.params.device, dtype=t.params.dtype)
        elif t.group is not None:  # every rank folds its own clients where they lie, then one all_reduce
            return _group_compressed_stats(t, deltas, weights, name, sign)
        else:
            deltas, weights = _accumulated(t, deltas, weights, name), None
    if t.aggregate is not None and name != "control_deltas":
        return _robust_stats(t, deltas, weights, name, base, sign)
    try:
        if isinstance(deltas, Accumulator) and t.needs_client_norms:
            deltas._need_norms(t.what)
        rows = _checked_rows(t, deltas, weights, name, base)
    except Exception as e:  # noqa: BLE001 (with a group: every other rank learns at once, then this one raises)
        if t.group is not None:
            kind = "sharded" if t.sharded else "accumulator" if isinstance(deltas, Accumulator) else "clients"
            _distributed().fail_step(t.group, kind, e, t.params.device)
        raise
    aux, aux_coef = t.aux_of()
    aux_coef = sign * aux_coef
    if base is not None:
        name = "models"
    if isinstance(deltas, Accumulator):
        return _accumulator_stats(t, deltas, name, aux, aux_coef)
    numel = rows.numel
    if t.group is not None and t.sharded:  # this rank's slice of every client
        return _distributed().sharded_stats(rows, weights, t.backend, group=t.group, name=name, aux=aux,
                                            aux_coef=aux_coef, sync=t.sync, mean_dtype=t.mean_dtype,
                                            mean_out=t.mean_buffer(name, t.mean_dtype, numel))
    if t.group is not None:  # the clients of every rank
        return _distributed().all_stats(rows, weights, t.backend, group=t.group, name=name, aux=aux,
                                        aux_coef=aux_coef, sync=t.sync, mean_dtype=t.mean_dtype,
                                        mean_out=t.mean_buffer(name, t.mean_dtype, numel),
                                        scratch=t.mean_buffer("norm scratch", t.mean_dtype, numel),
                                        model_buffers=t.params.buffers)
    return client_stats(rows, weights, t.backend, name=name, aux=aux, aux_coef=aux_coef, sync=t.sync,
                        mean_dtype=t.mean_dtype, mean_out=t.mean_buffer(name, t.mean_dtype, numel))


def give_back(borrowed: list) -> None:
    """Give the accumulators back the spare buffers a step used as its mean (``Target.borrowed``; the step is
    over): a server that steps on the same accumulator round after round then allocates no model-sized buffer
    again."""
    while borrowed:
        acc, spare = borrowed.pop()
        acc._return_spare(spare)


def _checked_rows(t: Target, deltas: Any, weights: Any, name: str, base: Any) -> ClientRows | None:
    """This rank's input, validated against the params: the clients' rows (None for an Accumulator, checked
    instead)."""
    p = t.params
    if isinstance(deltas, Accumulator):
        if t.sharded:
            raise TypeError("a sharded optimizer takes each client's slice, not an Accumulator")
        if weights is not None:
            raise TypeError("weights= does not apply to an Accumulator: pass weights to its add()")
        if deltas.device != p.device:
            raise ValueError(f"the accumulator is on {deltas.device}; the params are on {p.device}")
        if deltas.numel != p.segments.numel:
            raise ValueError(f"the accumulator holds {deltas.numel} elements per client; the optimizer's params "
                             f"have {p.segments.numel}")
        check_writes(t.written(), deltas._state_reads())
        return None
    if t.group is not None and not t.sharded and no_clients_given(deltas):
        if weights is not None and len(weights) != 0:
            raise ValueError(f"no {name} on this rank but {len(weights)} weights")
        # this rank sits the round out: a zero share
        return _distributed().no_clients(p.segments, p.form, p.dtype, p.device)
    if base is not None:
        name = "models"
    rows = client_rows(deltas, name=name, params=p)
    if base is not None:
        rows, _ = attach_base(rows, base)
    if rows.device != p.device:
        raise ValueError(f"{name} are on {rows.device}; the params are on {p.device}")
    if rows.numel != p.segments.numel:
        raise ValueError(f"{name} have {rows.numel} elements per client; the optimizer's params have "
                         f"{p.segments.numel}")
    check_writes(t.written(), round_reads(rows))
    return rows


def _accumulator_stats(t: Target, acc: Accumulator, name: str, aux: Any, aux_coef: float) -> RoundStats:
    """The stats of an Accumulator's sums: every rank's with a group; without a mean where the apply reads the sum
    itself; else into the accumulator's spare sum, lent for the step (no model-sized buffer kept by the optimizer),
    or the optimizer's reused buffer."""
    cdt = t.mean_dtype
    if t.group is not None:  # every rank folded its own clients
        return _distributed().accumulator_stats(acc, lambda device: t.backend, group=t.group, aux=aux,
                                                aux_coef=aux_coef, mean_out=t.mean_buffer(name, cdt, acc.numel))
    if t.reads_sum and aux is None and acc.compute_dtype == cdt:
        return acc.round_stats(lambda device: t.backend, keep_mean=False)
    with acc._lock:
        spare = acc._take_spare(cdt) if t.lend_spare else None
        if spare is not None:
            t.borrowed.append((acc, spare))
        return acc.round_stats(lambda device: t.backend, aux=aux, aux_coef=aux_coef,
                               mean_out=spare if spare is not None else t.mean_buffer(name, cdt, acc.numel))


def _group_compressed_stats(t: Target, deltas: list, weights: Any, name: str, sign: float) -> RoundStats:
    """This rank's compressed clients in a step over the ranks of ``group=``: checked, those with a NaN/Inf scale
    or value left out (``on_nonfinite="skip"``, as the local path's Accumulator leaves them out) or raised on, then
    folded where they lie in the group's one stats exchange (:func:`fastagg.distributed.all_stats`). Any failure
    is told to every rank first."""
    p = t.params
    names = [f"{name}[{i}]" for i in range(len(deltas))]
    try:
        if t.sharded:
            raise TypeError("sharded=True takes a slice of every client's float update; compressed updates are "
                            "whole vectors: use the default (each rank holds whole clients)")
        scans: dict = {}
        check_batch(deltas, names, numel=p.segments.numel, device=p.device, where="the params", scans=scans)
        bad = nonfinite_scales(deltas, names, scans)
        if bad and t.on_nonfinite == "raise":
            raise ValueError(f"{', '.join(names[j] for j in bad)} {'has' if len(bad) == 1 else 'have'} a NaN or "
                             "Inf scale or value; nothing was updated")
        left_out = set(bad)
        keep = [j for j in range(len(deltas)) if j not in left_out]
        if weights is not None:
            w = weights.detach().cpu().tolist() if isinstance(weights, torch.Tensor) else list(weights)
            if len(w) != len(deltas):
                raise ValueError(f"{len(w)} weights for {len(deltas)} {name}")
            weights = [w[j] for j in keep]
        rows = CompressedRows([deltas[j] for j in keep], [names[j] for j in keep], numel=p.segments.numel,
                              device=p.device, form=p.form)
    except Exception as e:  # noqa: BLE001 (every other rank learns at once, then this one raises)
        _distributed().fail_step(t.group, "clients", e, p.device)
        raise
    aux, aux_coef = t.aux_of()
    return _distributed().all_stats(rows, weights, t.backend, group=t.group, name=name, aux=aux,
                                    aux_coef=sign * aux_coef, sync=t.sync, mean_dtype=t.mean_dtype,
                                    mean_out=t.mean_buffer(name, t.mean_dtype, rows.numel),
                                    scratch=t.mean_buffer("norm scratch", t.mean_dtype, rows.numel),
                                    model_buffers=p.buffers)


def _accumulated(t: Target, deltas: list, weights: Any, name: str) -> Accumulator:
    """Compressed clients (fastagg.compress) folded where they lie into an Accumulator of the params' size, which
    the step then reads like any other (every rule, aux terms included). A client with a NaN/Inf scale raises, or
    with ``on_nonfinite="skip"`` is left out of the round."""
    p = t.params
    acc = Accumulator(like=torch.empty(p.segments.numel, dtype=p.dtype, device=p.device), backend=t.backend_name)
    ws = [1.0] * len(deltas) if weights is None else weights
    folded = acc.add_many(deltas, ws, on_nonfinite=t.on_nonfinite)
    if not any(folded):
        raise ValueError(f"every one of the {len(deltas)} {name} has a NaN or Inf scale or value, or codes "
                         "standing for values beyond float32; nothing was updated")
    return acc


def _robust_stats(t: Target, deltas: Any, weights: Any, name: str, base: Any, sign: float) -> RoundStats:
    """The round's statistics with the robust rule's (or DP mechanism's) estimate as the mean
    (:func:`fastagg.robust.robust_stats`, :func:`fastagg.privacy.mechanisms.dp_stats`); the non-finite clients it
    left out are reported in ``t.robust``, not raised on."""
    if isinstance(deltas, Accumulator):
        raise TypeError(f"aggregate={t.aggregate!r} needs every client's update; an Accumulator keeps only "
                        "their sum")
    rows = _checked_rows(t, deltas, weights, name, base)
    mean_out = t.mean_buffer(name, t.mean_dtype, rows.numel)
    label = "models" if base is not None else name
    stats, t.robust = t.aggregate_stats(rows, weights, t.aggregate, t.backend, name=label, mean_out=mean_out,
                                        mean_dtype=t.mean_dtype)
    aux, aux_coef = t.aux_of()
    if aux is not None:  # FedExP-M measures ||mean + beta v||^2
        v = stats.mean.to(torch.float64) + sign * aux_coef * aux.to(torch.float64)
        stats.mean_sq = v @ v
    return stats


# -- the functional steps (fastagg.ops) ----------------------------------------------------------------------------
def functional_stats(deltas: Any, models: Any, weights: Any, params: Any, *, on_nonfinite: str, backend_name: str,
                     group: Any = None, mean_out: Any = None, eval_out: Any = None) -> tuple:
    """The round statistics of :func:`fastagg.fedexp_step` / :func:`fastagg.fedavg_step`:
    ``(stats, params' rows or None, backend, eval buffer or None)``. ``models=`` are full client models measured
    from ``params``; ``mean_out`` / ``eval_out`` are the caller's buffers, checked against what the round reads and
    writes."""
    updates = compressed_list(deltas) if models is None else None
    if updates is not None:
        return _functional_compressed(updates, weights, params, on_nonfinite=on_nonfinite, backend_name=backend_name,
                                      group=group, mean_out=mean_out, eval_out=eval_out)
    try:
        check_on_nonfinite(on_nonfinite)
        if group is not None and models is None and params is not None and isinstance(deltas, (list, tuple)) \
                and not deltas:  # this rank holds no client this round (say, of compressed ones): a zero share
            p, name = param_rows(params), "deltas"
            rows = _distributed().no_clients(p.segments, p.form, p.dtype, p.device)
        else:
            rows, p, name = _functional_rows(deltas, models, params)
        cdt = round_dtype(rows.dtype, None if p is None else p.dtype)
        mean_buf, eval_buf = _round_outputs(p, mean_out, eval_out, rows.numel, cdt, rows.device, round_reads(rows))
        backend = resolve(backend_name, rows.device)
    except Exception as e:  # noqa: BLE001 (with a group: every other rank learns at once, then this one raises)
        if group is not None:
            _distributed().fail_step(group, "clients", e)
        raise
    if group is None:
        stats = client_stats(rows, weights, backend, name=name, mean_out=mean_buf, sync=on_nonfinite == "raise",
                             mean_dtype=cdt)
    else:  # the clients of every rank of a torch.distributed group (fastagg.distributed)
        stats = _distributed().all_stats(rows, weights, backend, group=group, name=name, mean_out=mean_buf,
                                         sync=on_nonfinite == "raise", mean_dtype=cdt)
    return stats, p, backend, eval_buf


def _functional_rows(deltas, models, params) -> tuple:
    """Client rows (with params attached as the base for ``models=``), params' rows, and the clients' name.
    Named clients (state_dicts) are matched to named params by entry name."""
    if (deltas is None) == (models is None):
        raise TypeError("pass exactly one of deltas= (client updates) or models= (full client models)")
    if models is not None:
        if params is None:
            raise TypeError("models= needs params= (the global model the client models started from)")
        p = param_rows(params)
        rows = client_rows(models, name="models", params=p)
        return with_base(rows, p), p, "models"
    p = param_rows(params) if params is not None else None
    rows = client_rows(deltas, name="deltas", params=p)
    if p is not None:
        check_params_match(p, rows)
    return rows, p, "deltas"


def _round_outputs(p: ParamRows | None, mean_out, eval_out, numel: int, cdt: torch.dtype, device, reads: list):
    """The round's mean and evaluation buffers (given or None), checked against what the round reads and writes."""
    mean_buf = out_buffer(mean_out, "mean_out", numel, cdt, device)
    eval_buf = None
    if eval_out is not None:
        if p is None:
            raise TypeError("eval_out= needs params= (the evaluation model is computed from the updated params)")
        eval_buf = out_buffer(eval_out, "eval_out", p.segments.numel, p.dtype, p.device)
    writes = [(f"params entry {k}", t) for k, t in enumerate(p.parts)] if p is not None else []
    writes += [(n, t) for n, t in (("mean_out", mean_buf), ("eval_out", eval_buf)) if t is not None]
    if writes:
        check_writes(writes, reads)
    return mean_buf, eval_buf


def _functional_compressed(deltas: list, weights, params, *, on_nonfinite, backend_name, group, mean_out,
                           eval_out) -> tuple:
    """The functional round on compressed clients (fastagg.compress): one sweep per format reads every client where
    it lies and writes the mean (``mean = sum_i p_i x~_i``, ``||x~_i||^2``, ``||mean||^2``). A client with a
    NaN/Inf scale or value makes the round non-finite (raised or skipped). With ``group``: each rank folds its own
    clients, then one all_reduce (all_stats)."""
    names = [f"deltas[{i}]" for i in range(len(deltas))]
    try:
        check_on_nonfinite(on_nonfinite)
        p = param_rows(params) if params is not None else None
        numel = p.segments.numel if p is not None else numel_of(deltas[0])
        dev = p.device if p is not None else deltas[0].device
        scans: dict = {}  # the sparse clients' C++ scan, shared by the two checks below
        check_batch(deltas, names, numel=numel, device=dev, where="the params" if p is not None else "deltas[0]",
                    scans=scans)
        cdt = round_dtype(torch.float32, None if p is None else p.dtype)
        reads = [(n + field, t) for n, u in zip(names, deltas) for field, t in tensors_of(u)]
        mean_buf, eval_buf = _round_outputs(p, mean_out, eval_out, numel, cdt, dev, reads)
        backend = resolve(backend_name, dev)
        if mean_buf is None:
            mean_buf = _buffers.empty(numel, cdt, dev)
    except Exception as e:  # noqa: BLE001 (with a group: every other rank learns at once, then this one raises)
        if group is not None:
            _distributed().fail_step(group, "clients", e)
        raise
    form = p.form if p is not None else Layout.of(mean_buf)
    if group is not None:
        rows = CompressedRows(deltas, names, numel=numel, device=dev, form=form)
        stats = _distributed().all_stats(rows, weights, backend, group=group, name="deltas", mean_out=mean_buf,
                                         sync=on_nonfinite == "raise", mean_dtype=cdt)
        return stats, p, backend, eval_buf
    m = len(deltas)
    coefs = normalized_weights(weights, m, dev, sync=on_nonfinite == "raise")
    nonfinite = torch.zeros(m, dtype=torch.bool, device=dev)
    bad = nonfinite_scales(deltas, names, scans)
    if bad:  # no kernel reads a NaN scale: the round is not finite, raised or skipped by the apply
        nonfinite[bad] = True
        mean_buf.zero_()
        sq = torch.full((m,), float("nan"), dtype=torch.float64, device=dev)
        msq = torch.full((), float("nan"), dtype=torch.float64, device=dev)
    else:
        sq, msq = fold(deltas, names, coefs, backend, init=None, out=mean_buf)
    stats = RoundStats(mean_buf, sq, nonfinite, msq, (coefs * sq).sum(), m, form, "deltas")
    stats.coefs = coefs
    return stats, p, backend, eval_buf
