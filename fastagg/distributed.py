"""Client-parallel server steps on torch.distributed: each rank holds some clients' updates, the ranks reduce their
fused statistics, and every rank takes the identical step.

Every fastagg server rule needs only additive quantities of a round: the weighted sum of the updates, the weighted
sum of their squared norms, the number of clients and whether any is non-finite. So a round whose M clients are
spread over R ranks is, exactly in exact arithmetic, the round of all M clients::

    p_i  = n_i / sum_j n_j               (over every rank's clients: the weights are gathered, M scalars)
    mean = sum_r sum_{i on r} p_i x_i     (one stats pass per rank, then one all_reduce of a d-vector)
    avg_sq = sum_r sum_{i on r} p_i ||x_i||^2,  ||mean||^2 from the reduced mean

Collectives per round, all on the caller's group (torch.distributed itself, no other transport): one all_gather of a
small header (numel, dtype, clients per rank: mismatched shapes are refused on every rank before any data moves)
that also carries the weights of up to 64 clients a rank (else one more all_gather for them), one all_reduce of the
d-vector and one all_gather of the per-client norms and finite flags (so every rank knows which global client was
bad and all skip or raise together), with each rank's share of ||mean||^2 (every rank measures 1/R of the reduced
mean). With one rank the step is today's single-process step, bit for bit. With several, the mean's sum runs in the
collective's order, so results agree with the single-process step to rounding (float32: ~1e-7 relative), and every
rank holds the same bits. A rank that dies or hangs makes the collectives fail after the group's timeout
(``init_process_group(timeout=...)``); the error says so and no rank has changed its params.

Every exchange opens with one fixed-size header that all ranks gather (:func:`_exchange`): the exchange's number on
this group (counted on every rank), its kind, and whether the rank failed to prepare its part (bad input: the rank
raises its own error, every other rank a ValueError naming it, promptly and before any data moves). Ranks whose
numbers or kinds differ are out of step (one skipped a step, or called another collective): every rank raises,
none combines updates of different rounds. State_dict entries and buffers are matched by key across ranks (a rank
that lists them in another order is reordered, one with other keys refused).

Use: ``fastagg.server.FedAdam(params, group=group)`` (any server optimizer), or ``group=`` on
``fastagg.fedexp_step`` / ``fastagg.fedavg_step``. ``clients on rank r`` are numbered after those of ranks < r.

Parameter-sharded (``FedAdam(my_slice, group=group, sharded=True)``, ZeRO-1 style): each rank owns a contiguous
slice of the flat parameters and of every state buffer, and is given every client's update for its slice (the
same clients and weights on every rank). The mean of a slice needs no collective; the per-client squared norms
and ||mean||^2 are sums over slices, so one all_reduce of M + 1 scalars (and the M finite flags) gives every rank
the round's eta, and each applies the step to its slice. State memory per rank is 1/R of the model's;
:func:`gather` assembles the full vector when asked (evaluation, checkpoints).
"""
from __future__ import annotations

import math
import zlib
from typing import Any

import torch

from ._checks import _weights_array, check_int, normalized_weights
from .checkpoint import flat_checkpoint, torch_checkpoint
from .compress.fold import CompressedRows
from .passes import RoundStats, client_stats, run_stats, sum_stats, weighted_f64
from .rows import Buffers, ClientRows, client_rows, compute_dtype

_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
WEIGHTS_INLINE = 64  # clients per rank whose weights travel with the shape check (one collective fewer)
# With one rank a step is the single-process step (same bits), no collective. Set False to run the collectives
# anyway: how a backend (NCCL on one GPU) is checked end to end on one device; results then agree to rounding.
ONE_RANK_IS_LOCAL = True


def world_size(group) -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group= needs an initialized torch.distributed process group (init_process_group)")
    return dist.get_world_size(group)


def _local(group) -> bool:
    """True when the step needs no collective: a group of one rank (unless ONE_RANK_IS_LOCAL is off)."""
    return world_size(group) == 1 and ONE_RANK_IS_LOCAL


def _collective(fn, *args, what: str, **kw):
    try:
        return fn(*args, **kw)
    except RuntimeError as e:  # gloo/NCCL: a peer died, closed its connection, or the group timed out
        raise RuntimeError(f"fastagg.distributed: the {what} across the group failed (a rank died, hung past the "
                           f"group's timeout, or left): {str(e).splitlines()[0] if str(e) else type(e).__name__}. "
                           "No params or state were changed.") from e


def _gather(t: torch.Tensor, group, what: str) -> list:
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    _collective(dist.all_gather, out, t, group=group, what=what)
    return out


def _device_for(group, device: torch.device) -> torch.device:
    """Where a collective's tensors live: NCCL moves CUDA tensors only, gloo CPU (or CUDA) ones."""
    import torch.distributed as dist

    backend = dist.get_backend(group)
    return device if backend == "nccl" else torch.device("cpu")


_KINDS = ("clients", "sharded", "accumulator", "gather")
_HEADER = 3 + 8 + WEIGHTS_INLINE  # exchange number, kind, failed flag, then each kind's values (weights last)
_exchanges: dict = {}  # group -> the number of exchanges this process has opened on it


def _exchange(group, kind: str, values: list, cdev: torch.device, what: str,
              error: BaseException | None = None) -> list:
    """The header gather that opens every exchange: ``values`` (at most _HEADER - 3 floats) from every rank, after
    checking that every rank is at the same exchange of the same kind and none failed to prepare its part. With
    ``error`` (this rank's own failure) the rank still takes part, so the others learn of it at once, then raises
    it."""
    number = _exchanges.get(id(group), 0) + 1
    _exchanges[id(group)] = number
    header = torch.zeros(_HEADER, dtype=torch.float64)
    header[0], header[1], header[2] = number, _KINDS.index(kind), 1.0 if error is not None else 0.0
    if values:
        header[3:3 + len(values)] = torch.as_tensor([float(v) for v in values], dtype=torch.float64)
    gathered = [h.cpu() for h in _gather(header.to(cdev), group, what)]
    steps = [(int(h[0]), int(h[1])) for h in gathered]
    if len(set(steps)) > 1:
        shown = ", ".join(f"rank {r}: exchange {n} ({_KINDS[k] if 0 <= k < len(_KINDS) else k})"
                          for r, (n, k) in enumerate(steps))
        raise RuntimeError(f"fastagg.distributed: the ranks are out of step ({shown}): a rank skipped a step or "
                           "called another collective. Nothing was updated on any rank; the group cannot continue "
                           "(create it anew)")
    if error is not None:
        raise error
    failed = [r for r, h in enumerate(gathered) if h[2] != 0]
    if failed:
        raise ValueError(f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} could not take part "
                         "in this step (its own error says why); nothing was updated on any rank")
    return [h[3:] for h in gathered]


def _agree(group, cdev: torch.device, error: BaseException | None) -> None:
    """Between a step's header and its data collective: every rank learns whether one failed in its own pass
    (then every rank raises, none waits in the data collective for a rank that left)."""
    import torch.distributed as dist

    flag = torch.tensor([1.0 if error is not None else 0.0], dtype=torch.float64, device=cdev)
    _collective(dist.all_reduce, flag, group=group, what="status check")
    if error is not None:
        raise error
    if float(flag) > 0:
        raise RuntimeError("fastagg.distributed: another rank failed in its part of this step (its own error says "
                           "why); nothing was updated on any rank")


def fail_step(group, kind: str, error: BaseException, device: torch.device | None = None) -> None:
    """This rank cannot take part in a step of ``kind`` (its input is bad): tell every other rank through the
    step's header exchange, then raise ``error``. Without a group of several ranks, raises at once."""
    if group is None or _local(group):
        raise error
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        cdev = device if device is not None and device.type == "cuda" else \
            torch.device("cuda", torch.cuda.current_device())
    else:
        cdev = torch.device("cpu")
    _exchange(group, kind, [], cdev, "step header", error=error)


def _key_order(form) -> list | None:
    """The entry indices of ``form`` sorted by key (the order every rank agrees on), or None when the entries are
    unnamed or already in that order."""
    if form.kind != "dict":
        return None
    order = sorted(range(len(form.names)), key=lambda k: str(form.names[k]))
    return None if order == list(range(len(order))) else order


def _layout_code(form) -> float:
    """A CRC-32 of the entries (name, shape, dtype) in key order: equal on ranks whose models match by key."""
    sig = form.signature()
    if form.kind == "dict":
        sig = sorted(sig, key=lambda e: str(e[0]))
    return float(zlib.crc32(repr(sig).encode()))


def _keyed(flat: torch.Tensor, form, order: list | None) -> torch.Tensor:
    """``flat`` (laid out as ``form``) with its entries in key order (a copy), or ``flat`` when already so."""
    if order is None:
        return flat
    offs, numels = form.offsets, form.numels
    return torch.cat([flat[offs[k]:offs[k] + numels[k]] for k in order])


def _unkeyed(keyed: torch.Tensor, out: torch.Tensor, form, order: list | None) -> None:
    """Write ``keyed`` (entries in key order) into ``out`` (laid out as ``form``)."""
    if order is None:
        if keyed.data_ptr() != out.data_ptr():
            out.copy_(keyed)
        return
    offs, numels = form.offsets, form.numels
    pos = 0
    for k in order:
        out[offs[k]:offs[k] + numels[k]].copy_(keyed[pos:pos + numels[k]])
        pos += numels[k]


def _same_layout(headers: list, index: int, what: str) -> None:
    if len({h[index] for h in headers}) > 1:
        raise ValueError(f"the ranks' {what} differ in their entries (keys, shapes or dtypes); nothing was updated")


def _same_shapes(headers: list, what: str) -> None:
    """Every rank's header starts (numel, dtype index): refuse on every rank alike when they differ."""
    if len({(h[0], h[1]) for h in headers}) > 1:
        shown = ", ".join(f"rank {r}: {h[0]} elements of {_DTYPES[h[1]]}" for r, h in enumerate(headers))
        raise ValueError(f"the ranks' {what} differ in size or dtype ({shown}); nothing was updated")


def _local_weights(weights: Any, m: int) -> tuple[torch.Tensor, str]:
    """This rank's raw weights as float64 [m] on the host (None: all 1), or a reason they cannot be read. Values
    are checked after the gather, on every rank alike, so that a bad weight makes every rank raise together."""
    if weights is None:
        return torch.ones(m, dtype=torch.float64), ""
    try:
        w = weights.detach().to("cpu", torch.float64) if isinstance(weights, torch.Tensor) else \
            torch.as_tensor(_weights_array(weights))
    except (TypeError, ValueError, RuntimeError) as e:
        return torch.zeros(m, dtype=torch.float64), f"weights must be numbers ({e})"
    if tuple(w.shape) != (m,):
        return torch.zeros(m, dtype=torch.float64), f"weights must have shape ({m},), got {tuple(w.shape)}"
    return w, ""


def no_clients(segments, form, dtype: torch.dtype, device: torch.device) -> ClientRows:
    """A rank's input when it holds no client this round: it takes part in the step with a zero contribution."""
    return ClientRows([[] for _ in segments.lens], segments, 0, dtype, device, form)


def all_stats(rows: ClientRows, weights: Any, backend, *, group, name: str, aux=None, aux_coef: float = 0.0,
              mean_out=None, sync: bool = True, mean_dtype: torch.dtype | None = None,
              scratch: torch.Tensor | None = None, model_buffers: list | None = None) -> RoundStats:
    """The round's statistics over every rank's clients (see the module docstring); the same on every rank.
    Weights given as None count 1 for each client (uniform over all ranks' clients). ``scratch``: a d-vector of the
    mean's dtype the norm pass may write (a server optimizer passes a reused one: a fresh one page-faults).

    A rank with no client this round (``rows`` from :func:`no_clients`) takes part with a zero contribution: its
    layout is not compared with the others', and when their clients carry buffers it adds zeros for the global
    model's buffers (``model_buffers``: (name, tensor) pairs), which must be the clients' (names and shapes)."""
    import torch.distributed as dist

    if _local(group) and not isinstance(rows, CompressedRows):  # (compressed clients take the general path)
        return client_stats(rows, weights, backend, name=name, aux=aux, aux_coef=aux_coef, mean_out=mean_out,
                            sync=sync, mean_dtype=mean_dtype)
    dev, m = rows.device, rows.num_clients
    cdev = _device_for(group, dev)
    dtype = mean_dtype or compute_dtype(rows.dtype)
    local_w, problem = _local_weights(weights, m)
    # what every rank must agree on, gathered before any data moves; up to WEIGHTS_INLINE weights ride along
    buffer_numel = sum(v[0].numel() for v in rows.buffers.values) if rows.buffers is not None else -1
    if m == 0:  # no clients here: whatever buffers the others' clients carry
        buffer_numel = -2
    values = [rows.numel, _DTYPES.index(dtype), m, int(bool(problem)), buffer_numel, _layout_code(rows.form),
              _buffer_code(rows.buffers)]
    if m <= WEIGHTS_INLINE:
        values += local_w.tolist()
    gathered = _exchange(group, "clients", values, cdev, "shape check")
    headers = [[int(v) for v in h[:5].tolist()] + [float(h[5]), float(h[6])] for h in gathered]
    rank = dist.get_rank(group)
    _same_shapes(headers, name)
    bad_ranks = [r for r, h in enumerate(headers) if h[3]]
    if bad_ranks:
        raise ValueError(problem if problem else f"rank {bad_ranks[0]}'s weights cannot be read; nothing was updated")
    holding = [h for h in headers if h[2] > 0]  # ranks with clients: an empty rank adapts to them
    if len({h[4] for h in holding}) > 1:
        shown = ", ".join(f"rank {r}: {h[4] if h[4] >= 0 else 'none'}" for r, h in enumerate(headers) if h[2] > 0)
        raise ValueError(f"the ranks' {name} differ in their buffers (elements per client: {shown}); nothing was "
                         "updated")
    _same_layout(holding, 5, name)
    _same_layout(holding, 6, f"{name}' buffers")
    counts = [h[2] for h in headers]
    others_buffers = holding and holding[0][4] >= 0
    empty_buffers = None
    total, top, first = sum(counts), max(counts), sum(counts[:rank])
    if top <= WEIGHTS_INLINE:
        every = torch.cat([g[7:7 + c] for g, c in zip(gathered, counts)])
    else:  # a rank holds more clients than the header carries: their weights in a gather of their own
        padded = torch.zeros(top, dtype=torch.float64, device=cdev)
        padded[:m] = local_w.to(cdev)
        every = torch.cat([g[:c].cpu() for g, c in zip(_gather(padded, group, "weights gather"), counts)])
    # the single-process coefficients of all clients in rank order (raises alike on every rank for a bad weight)
    coefs_all = normalized_weights(every, total, dev)
    coefs = coefs_all[first:first + m].contiguous()
    error = None
    try:  # this rank's pass; a failure here is told to the others before the d-vector collective
        if m and isinstance(rows, CompressedRows):  # compressed clients: folded where they lie
            partial, sq, bad = rows.stats(coefs, backend, mean_out=mean_out, mean_dtype=dtype)
        elif m:
            partial, sq, bad, _ = run_stats(rows, coefs, backend, mean_out=mean_out, mean_dtype=dtype)
        else:
            partial = mean_out.zero_() if mean_out is not None else torch.zeros(rows.numel, dtype=dtype, device=dev)
            sq, bad = torch.zeros(0, dtype=torch.float64, device=dev), torch.zeros(0, dtype=torch.bool, device=dev)
            if others_buffers:
                empty_buffers = _zero_buffers(model_buffers, holding[0][4], holding[0][6], name)
        order = _key_order(rows.form)  # the d-vector is summed entry by entry in key order: a rank listing the
        keyed = _keyed(partial, rows.form, order)  # same keys in another order is reordered, not summed crosswise
        moved = keyed if cdev == dev else keyed.to(cdev)
    except Exception as e:  # noqa: BLE001 (re-raised below, after the others know)
        error = e
    _agree(group, cdev, error)
    _collective(dist.all_reduce, moved, group=group, what="all_reduce of the mean")
    reduced = moved if cdev == dev else moved.to(dev)
    _unkeyed(reduced, partial, rows.form, order)
    mean = partial
    # ||mean (+ aux_coef aux)||^2: each rank measures its 1/R chunk of the reduced mean in key order (the same
    # elements and bits on every rank) with the stats kernel; the R partial sums travel with the clients' norms
    lo, hi = bounds(mean.numel(), len(counts), rank)
    chunk = reduced[lo:hi] if aux is None else \
        reduced[lo:hi] + aux_coef * _keyed(aux.reshape(-1), rows.form, order)[lo:hi].to(mean.dtype)
    part = torch.zeros((), dtype=torch.float64, device=dev)
    if hi > lo:
        _, chunk_sq, _, _ = run_stats(client_rows([chunk], name="mean"), torch.ones(1, dtype=torch.float64, device=dev),
                                      backend, mean_dtype=mean.dtype,
                                      mean_out=None if scratch is None else scratch[lo:hi])
        part = chunk_sq[0]
    pack = torch.zeros(top + 1, 2, dtype=torch.float64, device=cdev)
    pack[:m, 0], pack[:m, 1], pack[top, 0] = sq.to(cdev), bad.to(cdev, torch.float64), part.to(cdev)
    parts = _gather(pack, group, "norms gather")
    gathered = torch.cat([g[:c] for g, c in zip(parts, counts)]).to(dev)
    sq_all, bad_all = gathered[:, 0].contiguous(), gathered[:, 1] > 0
    mean_sq = torch.zeros((), dtype=torch.float64, device=dev)
    for g in parts:  # rank order: the same sum on every rank
        mean_sq = mean_sq + g[top, 0].to(dev)
    stats = RoundStats(mean, sq_all, bad_all, mean_sq, (coefs_all * sq_all).sum(), total, rows.form, name)
    stats.coefs = coefs_all
    if rows.buffers is not None:  # BatchNorm statistics: sum_i p_i b_i over every rank's clients, in float64
        stats.buffers, stats.buffer_sums = Buffers(rows.buffers.names, []), _reduced_buffers(rows.buffers, coefs,
                                                                                              group, cdev, dev)
    elif empty_buffers is not None:  # this rank adds zeros to the others' buffer sums
        names, shapes = empty_buffers
        parts = [torch.zeros(t.numel(), dtype=torch.float64, device=dev) for t in shapes]
        stats.buffers = Buffers(tuple(names), [])
        stats.buffer_sums = _all_reduce_by_name(parts, list(names), shapes, group, cdev, dev)
    return stats


def _zero_buffers(model_buffers: list | None, numel: int, code: float, name: str) -> tuple:
    """(names, tensors) of the global model's buffers, for a rank without clients to add zeros to the other ranks'
    buffer sums; they must be the clients' buffers (the same names and shapes), else the step cannot be taken."""
    bufs = list(model_buffers or [])
    if sum(t.numel() for _, t in bufs) != numel or _buffer_code(Buffers(tuple(n for n, _ in bufs),
                                                                        [[t] for _, t in bufs])) != code:
        raise ValueError(f"this rank has no {name} this round and the other ranks' clients carry buffers that are not "
                         "the global model's (names and shapes), so it cannot add its zero share; nothing was updated")
    return [n for n, _ in bufs], [t for _, t in bufs]


def _buffer_code(buffers: Buffers | None) -> float:
    """A CRC-32 of the buffers' names and shapes in name order (0 for none)."""
    if buffers is None:
        return 0.0
    return float(zlib.crc32(repr(sorted((str(n), tuple(v[0].shape)) for n, v in zip(buffers.names,
                                                                                      buffers.values))).encode()))


def _reduced_buffers(buffers: Buffers, coefs: torch.Tensor, group, cdev, dev) -> list:
    """Each buffer's ``sum_i p_i b_i`` over this rank's clients, added across the group (one all_reduce, the buffers
    in name order on every rank), in this rank's buffer order."""
    parts = [weighted_f64([v.reshape(-1) for v in values], coefs, dev, (values[0].numel(),))
             for values in buffers.values]
    return _all_reduce_by_name(parts, list(buffers.names), [v[0] for v in buffers.values], group, cdev, dev)


def _all_reduce_by_name(parts: list, names: list, shapes_of: list, group, cdev, dev) -> list:
    """``parts`` (float64 vectors, one per buffer ``names[k]``) summed across the group with the buffers in name
    order on every rank; returned in this rank's order, each shaped like ``shapes_of[k]``."""
    import torch.distributed as dist

    order = sorted(range(len(names)), key=lambda k: str(names[k]))
    flat = torch.cat([parts[k] for k in order]).to(cdev)
    _collective(dist.all_reduce, flat, group=group, what="all_reduce of the buffers")
    flat = flat.to(dev)
    out, pos = [None] * len(parts), 0
    for k in order:
        n = parts[k].numel()
        out[k] = flat[pos:pos + n].view(shapes_of[k].shape)
        pos += n
    return out


def sharded_stats(rows: ClientRows, weights: Any, backend, *, group, name: str, aux=None, aux_coef: float = 0.0,
                  mean_out=None, sync: bool = True, mean_dtype: torch.dtype | None = None) -> RoundStats:
    """Statistics of every client over the whole model when this rank holds one slice of every client's update:
    the slice's mean locally, the norms and ||mean||^2 summed over the slices (one all_reduce of scalars)."""
    import torch.distributed as dist

    if _local(group):
        return client_stats(rows, weights, backend, name=name, aux=aux, aux_coef=aux_coef, mean_out=mean_out,
                            sync=sync, mean_dtype=mean_dtype)
    dev, m = rows.device, rows.num_clients
    cdev = _device_for(group, dev)
    local_w, problem = _local_weights(weights, m)
    # every rank must hold the same clients with the same weights, compared exactly (a sum-based check is fooled
    # by a permutation): the header carries the count, then every rank's weights are gathered and compared bitwise
    headers = _exchange(group, "sharded", [m, int(bool(problem))], cdev, "client check")
    if any(h[1] for h in headers):
        raise ValueError(problem or "another rank's weights cannot be read; nothing was updated")
    counts = [int(h[0]) for h in headers]
    if len(set(counts)) > 1:
        shown = ", ".join(f"rank {r}: {c} clients" for r, c in enumerate(counts))
        raise ValueError(f"sharded ranks must hold the same clients and weights ({shown}); nothing was updated")
    every = [w.cpu() for w in _gather(local_w.to(cdev), group, "weights check")]
    differ = [r for r, w in enumerate(every) if not torch.equal(w, every[0])]
    if differ:
        raise ValueError(f"sharded ranks must hold the same clients with the same weights in the same order; rank "
                         f"{differ[0]}'s weights differ from rank 0's; nothing was updated")
    coefs = normalized_weights(local_w, m, dev)
    mean, sq, bad, msq = run_stats(rows, coefs, backend, aux=aux, aux_coef=aux_coef, mean_out=mean_out,
                                   mean_dtype=mean_dtype or compute_dtype(rows.dtype))
    pack = torch.cat([sq, bad.to(torch.float64), msq.reshape(1)]).to(cdev)
    _collective(dist.all_reduce, pack, group=group, what="all_reduce of the norms")
    pack = pack.to(dev)
    sq_all, bad_all, mean_sq = pack[:m].contiguous(), pack[m:2 * m] > 0, pack[2 * m]
    stats = RoundStats(mean, sq_all, bad_all, mean_sq, (coefs * sq_all).sum(), m, rows.form, name)
    # model buffers (BatchNorm statistics) this rank owns are averaged here: every rank holds the same clients
    stats.coefs, stats.buffers = coefs, rows.buffers
    return stats


def gather(t: torch.Tensor, group) -> torch.Tensor:
    """The full flat vector from every rank's contiguous slice ``t`` (1-D; slices may differ in length), in rank
    order, on every rank: the sharded model for evaluation or a checkpoint."""
    if _local(group):
        return t.detach().reshape(-1).clone()
    flat = t.detach().reshape(-1)
    cdev = _device_for(group, flat.device)
    if flat.dtype not in _DTYPES:
        fail_step(group, "gather", TypeError(f"gather takes a floating slice, got {flat.dtype}"), flat.device)
    headers = _exchange(group, "gather", [flat.numel(), _DTYPES.index(flat.dtype)], cdev, "slice sizes")
    dtypes = [_DTYPES[int(h[1])] for h in headers]
    if len(set(dtypes)) > 1:  # refused on every rank: slices of other sizes per element would be read as garbage
        shown = ", ".join(f"rank {r}: {d}" for r, d in enumerate(dtypes))
        raise TypeError(f"gather: the ranks' slices differ in dtype ({shown})")
    sizes = [int(h[0]) for h in headers]
    padded = torch.zeros(max(sizes), dtype=flat.dtype, device=cdev)
    padded[:flat.numel()] = flat.to(cdev)
    parts = _gather(padded, group, "gather of the slices")
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]).to(flat.device)


def bounds(numel: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s slice of ``numel`` elements over ``world`` ranks (as even as possible:
    the first ``numel % world`` ranks hold one element more)."""
    base, extra = divmod(numel, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard(t: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous slice of a flat vector (:func:`bounds`), a view: the inverse of :func:`gather`."""
    import torch.distributed as dist

    flat = t.reshape(-1)
    start, stop = bounds(flat.numel(), world_size(group), dist.get_rank(group))
    return flat[start:stop]


def reshard(state_dicts: list, world: int) -> list:
    """Checkpoints of a sharded optimizer (one ``state_dict()`` per rank, in rank order) re-cut for ``world`` ranks
    (1: an unsharded optimizer's). Every vector buffer is joined in rank order and split by :func:`bounds`; the
    round counter and the hyperparameters must agree across the ranks.

    Checked before anything is built, each with a ValueError naming the problem: checkpoints given out of rank order
    or one rank twice (each records its rank and world size), a slice whose size is not the one :func:`bounds`
    gives its rank, a vector buffer whose length disagrees with its slice, and malformed input."""
    if not isinstance(state_dicts, (list, tuple)) or not state_dicts:
        raise ValueError(f"reshard needs a list of the ranks' state_dicts, got {type(state_dicts).__name__}")
    world = check_int(world, "reshard's world size", minimum=1)

    flat = []
    for r, sd in enumerate(state_dicts):
        if not isinstance(sd, dict):
            raise ValueError(f"state_dicts[{r}] is a {type(sd).__name__}, not a state_dict")
        try:
            flat.append(flat_checkpoint(sd))
        except (TypeError, ValueError) as e:
            raise type(e)(f"state_dicts[{r}]: {e}") from e
    state_dicts = flat
    for r, sd in enumerate(state_dicts):
        if not isinstance(sd["state"], dict) or not all(isinstance(v, torch.Tensor) for v in sd["state"].values()):
            raise ValueError(f"state_dicts[{r}]['state'] must map buffer names to tensors")
        layout = sd["layout"]
        try:
            ok = len(layout) == 1 and len(layout[0][1]) == 1 and int(layout[0][1][0]) >= 0
        except (TypeError, ValueError, IndexError):
            ok = False
        if not ok:
            raise ValueError(f"rank {r}'s state_dict is not of a flat slice (layout {layout!r})")
    first = state_dicts[0]
    old_world = len(state_dicts)
    tags = [sd.get("shard") for sd in state_dicts]
    if any(t is not None for t in tags):
        for r, t in enumerate(tags):
            if not isinstance(t, dict) or t.get("world") != old_world:
                raise ValueError(f"state_dicts[{r}] is from a group of {t.get('world') if isinstance(t, dict) else '?'} "
                                 f"ranks; {old_world} state_dicts were given")
        ranks = [t.get("rank") for t in tags]
        if sorted(ranks) != list(range(old_world)):
            twice = sorted({x for x in ranks if ranks.count(x) > 1})
            raise ValueError(f"the state_dicts hold rank {twice[0]} twice" if twice else
                             f"the state_dicts' ranks are {ranks}; expected 0..{old_world - 1}")
        if ranks != list(range(old_world)):
            raise ValueError(f"the state_dicts are out of rank order ({ranks}); give them in rank order")
    sizes = [int(sd["layout"][0][1][0]) for sd in state_dicts]
    numel = sum(sizes)
    for r, sd in enumerate(state_dicts):
        for key in ("optimizer", "hyperparameters"):
            if sd.get(key) != first.get(key):
                raise ValueError(f"rank {r}'s state_dict differs from rank 0's in {key!r}")
        lo, hi = bounds(numel, old_world, r)
        if sizes[r] != hi - lo:
            raise ValueError(f"rank {r}'s slice holds {sizes[r]} elements; rank {r} of {old_world} holds {hi - lo} "
                             f"of {numel} (out of order, or not one sharded model's slices)")
        if set(sd["state"]) != set(first["state"]):
            raise ValueError(f"rank {r}'s state_dict holds buffers {sorted(sd['state'])}; rank 0's "
                             f"{sorted(first['state'])}")
        for k, v in sd["state"].items():
            if v.dim() == 0:
                if not torch.equal(v, first["state"][k]):
                    raise ValueError(f"rank {r}'s {k!r} is {v.item()}; rank 0's {first['state'][k].item()}")
            elif v.dim() != 1 or v.numel() != sizes[r]:
                raise ValueError(f"rank {r}'s buffer {k!r} has shape {tuple(v.shape)}; its slice holds {sizes[r]} "
                                 "elements")
    out = []
    for rank in range(world):
        start, stop = bounds(numel, world, rank)
        state = {}
        for k, v in first["state"].items():
            state[k] = v.clone() if v.dim() == 0 else \
                torch.cat([sd["state"][k].reshape(-1) for sd in state_dicts])[start:stop].clone()
        name, _, dtype = first["layout"][0]
        sd = {**first, "layout": [(name, (stop - start,), dtype)], "state": state}
        sd.pop("shard", None)
        if world > 1:
            sd["shard"] = {"rank": rank, "world": world}
        out.append(torch_checkpoint(sd))
    return out


def accumulator_stats(acc, backend_of, *, group, aux=None, aux_coef: float = 0.0, mean_out=None,
                      mean_dtype: torch.dtype | None = None) -> RoundStats:
    """The round of every rank's :class:`~fastagg.Accumulator` (each folded its own clients): the weighted sums,
    total weights, counts and squared-norm sums are added across the group (one all_reduce of the d-vector, one of
    three scalars; the per-client norms gathered), then the stats of the sums. The accumulators are not changed; a
    rank may hold no client as long as some rank does."""
    import torch.distributed as dist

    with acc._lock:
        if _local(group):
            return acc.round_stats(backend_of, aux=aux, aux_coef=aux_coef, mean_out=mean_out, mean_dtype=mean_dtype)
        dev, m = acc.device, acc.num_clients
        cdev = _device_for(group, dev)
        like_bufs = acc._like.buffers.values if acc._buffer_names else []
        buffers = Buffers(acc._buffer_names, like_bufs) if like_bufs else None
        gathered = _exchange(group, "accumulator", [acc.numel, _DTYPES.index(acc._sum.dtype), m,
                                                    sum(v[0].numel() for v in like_bufs), _layout_code(acc._form),
                                                    _buffer_code(buffers)], cdev, "shape check")
        headers = [[int(v) for v in h[:4].tolist()] + [float(h[4]), float(h[5])] for h in gathered]
        _same_shapes(headers, "accumulators")
        if len({h[3] for h in headers}) > 1:
            shown = ", ".join(f"rank {r}: {h[3]}" for r, h in enumerate(headers))
            raise ValueError(f"the ranks' accumulators differ in their buffers (elements: {shown}); nothing was "
                             "updated")
        _same_layout(headers, 4, "accumulators")
        _same_layout(headers, 5, "accumulators' buffers")
        counts = [h[2] for h in headers]
        if sum(counts) == 0:
            raise ValueError("every rank's accumulator is empty: add() at least one client first")
        order = _key_order(acc._form)  # summed entry by entry in key order (see all_stats)
        keyed = _keyed(acc._sum, acc._form, order)
        total = keyed.to(cdev, copy=keyed is acc._sum)
        _collective(dist.all_reduce, total, group=group, what="all_reduce of the weighted sums")
        if order is not None:
            local = torch.empty_like(acc._sum)
            _unkeyed(total.to(dev), local, acc._form, order)
            total = local
        norms = acc.client_norms  # (False: NaN norms, which only a rule that reads them would see; it refuses)
        scalars = torch.tensor([acc.total_weight, float(acc.weighted_sq_norm_sum) if norms else math.nan],
                               dtype=torch.float64, device=cdev)
        _collective(dist.all_reduce, scalars, group=group, what="all_reduce of the weights")
        top = max(counts)
        padded = torch.zeros(top, dtype=torch.float64, device=cdev)
        padded[:m] = acc.sq_norms.to(cdev) if norms else math.nan
        sq_all = torch.cat([g[:c] for g, c in zip(_gather(padded, group, "norms gather"), counts)]).to(dev)
        weight, sq_sum = float(scalars[0]), scalars[1].to(dev)
        if not weight > 0:
            raise ValueError("the accumulators' total weight is 0: at least one client needs a positive weight")
        # NaN: some rank keeps no norms (kept norms are finite, checked as folded): None on every rank alike
        stats = sum_stats(total.to(dev), sq_sum if bool(torch.isfinite(sq_sum)) else None, weight,
                          sum(counts), backend_of, name="accumulator", aux=aux,
                          aux_coef=aux_coef, mean_out=mean_out, mean_dtype=mean_dtype)
        stats.sq_norms = sq_all
        if like_bufs:  # BatchNorm statistics: sum_i n_i b_i added across the group (by name), then / the total weight
            sums = [torch.zeros(v[0].numel(), dtype=torch.float64, device=dev) if s is None
                    else s.reshape(-1).to(torch.float64) for s, v in zip(acc._buffer_sums, like_bufs)]
            summed = _all_reduce_by_name(sums, list(acc._buffer_names), [v[0] for v in like_bufs], group, cdev, dev)
            stats.buffers = Buffers(acc._buffer_names, [])
            stats.buffer_sums = [b / weight for b in summed]
        return stats
