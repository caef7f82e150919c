"""The two passes every server step is made of, shared by the functional ops, the accumulator and the stateful
optimizers:

1. a stats pass (:func:`client_stats`, or :func:`sum_stats` from sums) that reads the client rows once and
   gives the mean, per-client squared norms and non-finite flags, ``||mean||^2`` and the weighted mean
   squared norm;
2. the rule's scalars on the device (``fedexp_rule.py`` for FedExP), :func:`check_finite`, then the rule's apply pass (a
   backend's ``momentum_apply`` or ``adam_apply``), which does nothing to params or state when the round is
   not finite.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from itertools import chain
from operator import attrgetter, methodcaller
from typing import Any

import torch

from . import _buffers, _facts
from ._checks import check_int, check_number, normalized_weights
from .flat import Layout
from .rows import Buffers, ClientRows, ParamRows, client_rows, compute_dtype


@dataclasses.dataclass
class RoundStats:
    """What the stats pass gives (tensors on the clients' device; scalars 0-d float64)."""

    mean: torch.Tensor | None     # [d], compute dtype; None: not written (mean = mean_scale * mean_sum, below)
    sq_norms: torch.Tensor | None  # [M] float64 (None from sums alone)
    nonfinite: torch.Tensor       # [M] bool ([1] from sums: the sum itself)
    mean_sq: torch.Tensor         # ||mean||^2, or ||mean + aux_coef * aux||^2 when aux was given
    avg_sq: torch.Tensor          # sum_i p_i ||delta_i||^2
    num_clients: int
    form: Layout                  # one client's form, to give results back in it
    name: str                     # what the clients were called ("deltas", "models", "weighted_sum")
    coefs: torch.Tensor | None = None   # [M] float64 p_i (None from sums alone)
    buffers: Buffers | None = None      # the clients' buffers, averaged apart (buffer_updates)
    buffer_sums: list | None = None     # from an Accumulator: sum_i p_i buffer_i per buffer (same order as names)
    mean_sum: torch.Tensor | None = None    # with mean None: the sum the mean is 0 + mean_scale * mean_sum of
    mean_scale: torch.Tensor | None = None  # 0-d float64 (an apply pass reads the sum scaled: momentum_apply)


def round_dtype(rows_dtype: torch.dtype, params_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype of a round's mean, math and state: the params' compute dtype when there are params (float64
    params stay float64-exact whatever the clients send; float32 params with float64 deltas sum them in float32),
    else the clients' (float64 for float64, float32 otherwise). Client rows are converted on load."""
    return compute_dtype(params_dtype if params_dtype is not None else rows_dtype)


def run_stats(rows: ClientRows, coefs: torch.Tensor, backend, *, mean_init=None, aux=None, aux_coef: float = 0.0,
              mean_out: torch.Tensor | None = None, mean_dtype: torch.dtype | None = None, noise: tuple | None = None,
              keep_mean: bool = True):
    """One stats pass: ``(mean, sq_norms, nonfinite, mean_sq)`` with ``mean = init + sum_i coefs_i x_i``
    (``noise = (sigma, seed, round)``: plus ``sigma`` times fastagg.privacy's Gaussian noise, added as the mean is
    written; ``mean_sq`` is then the noised mean's). ``keep_mean=False``: the mean is not written (None), in the
    rows' compute dtype."""
    dev = rows.device
    if mean_out is None and keep_mean:
        mean_out = _buffers.empty(rows.numel, mean_dtype or compute_dtype(rows.dtype), dev)
    sq = torch.empty(rows.num_clients, dtype=torch.float64, device=dev)
    bad = torch.empty(rows.num_clients, dtype=torch.bool, device=dev)
    msq = torch.empty((), dtype=torch.float64, device=dev)
    kw = {} if noise is None else {"noise": noise}  # (backends wrapped by fastagg.testing take the same keywords)
    backend.round_stats(rows=rows, weights=coefs, mean_init=mean_init, aux=aux, aux_coef=aux_coef, mean_out=mean_out,
                        sq_norms_out=sq, nonfinite_out=bad, mean_sq_out=msq, **kw)
    return mean_out, sq, bad, msq


def client_stats(rows: ClientRows, weights: Any, backend, *, name: str, aux=None, aux_coef: float = 0.0,
                 mean_out=None, sync: bool = True, mean_dtype: torch.dtype | None = None) -> RoundStats:
    """Stats of M client rows with weights normalized over the participants (``sync``: see normalized_weights)."""
    coefs = normalized_weights(weights, rows.num_clients, rows.device, sync=sync)
    mean, sq, bad, msq = run_stats(rows, coefs, backend, aux=aux, aux_coef=aux_coef, mean_out=mean_out,
                                   mean_dtype=mean_dtype)
    stats = RoundStats(mean, sq, bad, msq, (coefs * sq).sum(), rows.num_clients, rows.form, name)
    stats.coefs, stats.buffers = coefs, rows.buffers
    return stats


def sum_stats(weighted_sum: Any, weighted_sq_norm_sum: Any, total_weight: Any, num_clients: Any, backend_of, *,
              name: str = "weighted_sum", aux=None, aux_coef: float = 0.0, mean_out=None,
              mean_dtype: torch.dtype | None = None, keep_mean: bool = True) -> RoundStats:
    """Stats from sums alone: ``mean = weighted_sum / total_weight``, ``avg_sq = weighted_sq_norm_sum / total``.

    ``backend_of(device)`` resolves the backend once the sum's device is known. ``weighted_sq_norm_sum=None``: not
    known (an accumulator keeping no client norms): ``avg_sq`` is NaN, which only a rule that reads it would see.
    ``keep_mean=False``: the mean is not written (``mean`` None, ``mean_scale = 1 / total_weight``; the caller sets
    ``mean_sum``), for an apply pass that reads the sum scaled.
    """
    num_clients = check_int(num_clients, "num_clients", minimum=1)
    total = check_number(total_weight, "total_weight", minimum=0.0, allow_equal=False)
    rows = client_rows([weighted_sum], name=name)
    dev = rows.device
    if weighted_sq_norm_sum is None:
        sq_sum = torch.tensor(math.nan, dtype=torch.float64, device=dev)
    elif isinstance(weighted_sq_norm_sum, torch.Tensor):
        t = weighted_sq_norm_sum
        if t.numel() != 1 or t.is_complex() or t.device.type == "meta":
            raise ValueError(f"weighted_sq_norm_sum must be a number or a real one-element tensor, got "
                             f"{t.dtype} of shape {tuple(t.shape)} on {t.device}")
        if t.device.type == "cpu" and not float(t) >= 0:  # on a GPU, checked on the device (the round is refused)
            raise ValueError(f"weighted_sq_norm_sum must be a finite number >= 0, got {float(t)!r}")
        sq_sum = t.detach().to(device=dev, dtype=torch.float64).reshape(())
    else:
        sq_sum = torch.tensor(check_number(weighted_sq_norm_sum, "weighted_sq_norm_sum"), dtype=torch.float64,
                              device=dev)
    coefs = torch.full((1,), 1.0 / total, dtype=torch.float64, device=dev)
    mean, _, bad, msq = run_stats(rows, coefs, backend_of(dev), aux=aux, aux_coef=aux_coef, mean_out=mean_out,
                                  mean_dtype=mean_dtype, keep_mean=keep_mean)
    avg_sq = sq_sum / total
    if weighted_sq_norm_sum is not None:
        bad = bad | ~torch.isfinite(avg_sq) | (avg_sq < 0)
    stats = RoundStats(mean, None, bad, msq, avg_sq, int(num_clients), rows.form, name)
    if not keep_mean:
        stats.mean_scale = coefs.reshape(())
    return stats


def step_fits(step_size: torch.Tensor, mean_sq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Device bool: the step size is finite in ``dtype`` and so is ``step_size * ||mean||`` (a bound on every
    element of ``step_size * mean``). A step size finite in float64 but not in float32 (FedExP with eps = 0 and
    cancelling clients, lr = 1e39) would write Inf: such a round is refused like a round with a NaN client."""
    big = torch.finfo(dtype).max
    return torch.isfinite(step_size.to(dtype)) & (step_size.abs() * mean_sq.clamp_min(0).sqrt() <= big)


def check_finite(stats: RoundStats, eta: torch.Tensor, on_nonfinite: str, *, dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
    """The round's device flag; with ``on_nonfinite="raise"`` a ValueError naming the bad clients instead.

    The round is finite when every client is, eta and ``||mean||^2`` are, and (``dtype``: the params' compute
    dtype) the step fits that dtype (:func:`step_fits`). ``"raise"`` reads the flag to the host: the one sync of
    such a call.
    """
    finite = round_is_finite(stats.nonfinite, eta, stats.mean_sq)
    if dtype is not None:
        finite = finite & step_fits(eta, stats.mean_sq, dtype)
    if on_nonfinite == "raise" and not bool(finite):
        bad = stats.nonfinite.cpu().nonzero().flatten().tolist()
        if bad:
            name = stats.name
            shown = ", ".join(f"{name}[{i}]" for i in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
            raise ValueError(f"{shown} contain NaN or Inf; nothing was updated "
                             "(on_nonfinite='skip' flags the round instead of raising)")
        if not bool(round_is_finite(stats.nonfinite, eta, stats.mean_sq)):
            raise ValueError(f"the round's statistics overflowed (eta={eta.item()!r}, "
                             f"||mean||^2={stats.mean_sq.item()!r}); nothing was updated")
        raise ValueError(f"the step overflows {dtype} (step size {eta.item()!r}, ||mean||^2={stats.mean_sq.item()!r}"
                         "): it would write Inf into params; nothing was updated")
    return finite


def overflow_counter(like: torch.Tensor) -> torch.Tensor:
    """A fresh int32 [1] counter for an apply pass: elements whose new value would not be finite (they keep their
    old value; the apply passes never store Inf or NaN)."""
    return torch.zeros(1, dtype=torch.int32, device=like.device)


def check_overflow(counter: torch.Tensor, on_nonfinite: str, what: str) -> None:
    """``"raise"``: a ValueError when the apply pass left elements unchanged because their new value overflowed
    (one host read). ``"skip"`` leaves the count in the step's statistics."""
    if on_nonfinite == "raise":
        n = int(counter.item())
        if n:
            raise ValueError(f"{n} elements of {what} would have become Inf or NaN (the values are at the edge of "
                             "their dtype); those elements kept their previous values, every other element was "
                             "updated")


def warn_unmatched_buffers(params: ParamRows, stats: RoundStats) -> None:
    """Say so (once per process and case) when buffers cannot be updated: the global model has buffers the
    clients did not send (their running statistics stay as they were), or the clients sent buffers the global
    model cannot take (a list of parameters, ``model.parameters()``)."""
    sent = set(stats.buffers.names) if stats.buffers is not None else set()
    floating = {n for n, b in params.buffers if b.is_floating_point()}
    if floating and not sent:
        warnings.warn(f"the global model has buffers ({', '.join(sorted(floating)[:3])}...) but the client updates "
                      "carry none, so they are not updated: send state_dicts (or modules) with the buffers",
                      RuntimeWarning, stacklevel=3)
    elif sent and not params.buffers:
        warnings.warn(f"the client updates carry buffers ({', '.join(sorted(sent)[:3])}...) that the global model "
                      "cannot take (pass the module or its state_dict as params, not a list of its parameters); "
                      "they are ignored", RuntimeWarning, stacklevel=3)


def buffer_updates(params: ParamRows, stats: RoundStats, *, models: bool) -> list:
    """The global model's new buffers (BatchNorm running statistics, counters) from the clients', checked before
    anything of the round is written: never extrapolated, never in eta or an optimizer's state. Floating buffers
    become the clients' weighted average (``sum_i p_i b_i``, computed in float64); integer buffers
    (``num_batches_tracked``) advance by the weighted average of the clients' advances, rounded to the nearest
    integer, in int64 arithmetic (a counter near 2^63 has no float64 neighbours 1 apart). ``models``: the clients
    sent full models (else updates: ``b_i - b_global``). A buffer of another shape than the model's raises
    ``ValueError`` here. Returns groups of buffers of one dtype, (buffers, their new values flattened end to end,
    which of those elements may take them or None: the finite ones) for :func:`write_buffers`; the clients' raw
    buffers are averaged a group at a time (one row per client holding the whole group, added in client order:
    elementwise what a loop over buffers computes, in a few torch calls a client instead of a few a buffer and
    client)."""
    if not params.buffers:
        return []
    sums, raw = {}, {}
    if stats.buffer_sums is not None:
        sums = {n: b for n, b in zip(stats.buffers.names, stats.buffer_sums) if b is not None}
    elif stats.buffers is not None:
        raw = dict(zip(stats.buffers.names, stats.buffers.values))
    taken = []
    for name, g in params.buffers:
        if name not in sums and name not in raw:
            continue
        shape = tuple(sums[name].shape) if name in sums else tuple(raw[name][0].shape)
        if shape != tuple(g.shape):
            raise ValueError(f"the clients' buffer {name!r} has shape {shape}; the global model's has "
                             f"{tuple(g.shape)}; nothing was updated")
        taken.append((name, g))
    out = []
    for name, g in taken:  # an Accumulator's sums: one buffer at a time
        if name in sums:
            if g.is_floating_point():
                new = sums[name] if models else g.to(torch.float64) + sums[name]
                out.append(([g], new.reshape(-1), None))
            else:
                new, fits = _advanced(g, sums[name])
                out.append(([g], new.reshape(-1), fits.reshape(-1)))
    for floating in (True, False):
        kind = [(n, g) for n, g in taken if n in raw and g.is_floating_point() == floating]
        for dtype in dict.fromkeys(g.dtype for _, g in kind):
            gs = [g for _, g in kind if g.dtype == dtype]
            values = [raw[n] for n, g in kind if g.dtype == dtype]
            if floating:
                avg, bad = _weighted_rows(values, gs, stats.coefs, params.device)
                _flag_clients(stats, bad)
                out.append((gs, avg if models else _flat_cat(gs).to(torch.float64) + avg, None))
            else:
                advance, ok = _counter_advances(values, gs, stats.coefs, params.device, models)
                new, fits = _advanced(_flat_cat(gs), advance)
                out.append((gs, new, fits if ok is None else ok & fits))
    return out


def _flat_cat(tensors: list) -> torch.Tensor:
    """``tensors`` (of one dtype) flattened end to end, in one call when all are 1-D (cat) or all 0-d (stack)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    dims = set(map(_DIM, tensors))
    if dims == {1}:
        return torch.cat(tensors)
    if dims == {0}:
        return torch.stack(tensors)
    return torch.cat([t.reshape(-1) for t in tensors])


def _client_matrix(values: list, like: list, dtype: torch.dtype, device) -> torch.Tensor:
    """``[M, n]`` in ``dtype``: row i is client i's buffers ``values[k][i]`` (each shaped as ``like[k]``) end to end.
    Values of one dtype and device, all 1-D or all 0-d (BatchNorm's statistics, its counters), are joined by one
    ``cat`` / ``stack`` (~0.1 ms for 16 ResNet-18 clients); anything else is copied through a view of the matrix
    for each value (a dtype conversion, a device move)."""
    m = len(values[0])
    flat = list(chain.from_iterable(zip(*values)))  # client-major: client 0's buffers, then client 1's...
    dims = {g.dim() for g in like}
    with torch.no_grad():  # (a buffer sent with requires_grad is a value like any other)
        if len(dims) == 1 and dims <= {0, 1} and _one_dtype_on(flat, torch.device(device)):
            mat = torch.cat(flat) if dims == {1} else torch.stack(flat)
            return mat.view(m, -1).to(dtype)
        sizes = [g.numel() for g in like]
        mat = torch.empty(m, sum(sizes), dtype=dtype, device=device)
        views = [v.view(g.shape) for v, g in zip(mat.view(-1).split(sizes * m), like * m)]
        torch._foreach_copy_(views, flat)
    return mat


_DTYPE, _DEVICE, _DIM = attrgetter("dtype"), attrgetter("device"), methodcaller("dim")


def _one_dtype_on(ts: list, device: torch.device) -> bool:
    """The tensors ``ts`` have one dtype and are all on ``device`` (from their facts read in C where
    :mod:`fastagg._facts` is available: a ResNet-18 round's ~1,000 client buffers in ~0.03 ms, not ~0.15)."""
    f = _facts.facts(ts)
    if f is None or not f[:, _facts.OK].all():
        return len(set(map(_DTYPE, ts))) == 1 and set(map(_DEVICE, ts)) == {device}
    return bool((f[:, _facts.DTYPE] == f[0, _facts.DTYPE]).all()
                and (f[:, _facts.DEVICE] == _facts.device_code(device)).all())


def _in_client_order(mat: torch.Tensor, coefs: torch.Tensor) -> torch.Tensor:
    """``sum_i coefs_i mat[i]`` (float64 rows), the terms added in client order: the last row of the running sums
    (``cumsum`` over the clients adds them one after another, bit for bit a loop ``acc += coefs_i * mat[i]`` from
    ``acc = 0``, in one call instead of 2M; ``+ 0.0`` gives that loop's +0 where every term is -0)."""
    if mat.shape[0] == 0:
        return torch.zeros(mat.shape[1], dtype=mat.dtype, device=mat.device)
    return (coefs.to(device=mat.device, dtype=mat.dtype)[:, None] * mat).cumsum(0)[-1] + 0.0


def _weighted_rows(values: list, like: list, coefs: torch.Tensor, device) -> tuple:
    """``(sum_i coefs_i values[k][i]`` in float64 for every buffer k at once, flattened end to end (buffer k shaped
    as ``like[k]``), [M] bool: client i sent a NaN / Inf among them``)``: every client's buffers copied into one
    float64 matrix, its rows added in client order (elementwise what :func:`weighted_f64` computes per buffer)."""
    mat = _client_matrix(values, like, torch.float64, device)
    return _in_client_order(mat, coefs), ~torch.isfinite(mat).all(dim=1)


def _flag_clients(stats: RoundStats, bad: torch.Tensor) -> None:
    """Clients whose floating buffers hold a NaN / Inf are non-finite clients like those whose parameters do:
    ``on_nonfinite="raise"`` names them and nothing is written, ``"skip"`` flags the round (as ``Accumulator.add``
    refuses such a client). Before, the round went on and each such element kept its old value, unreported."""
    if stats.nonfinite is not None and stats.nonfinite.shape == bad.shape:
        stats.nonfinite |= bad.to(stats.nonfinite.device)


def _counter_advances(values: list, like: list, coefs: torch.Tensor, device, models: bool) -> tuple:
    """Integer buffers of one dtype (``like``: the model's), flattened end to end: the weighted average of each
    client's advance (``models``: ``b_i - g``, exact in int64, with the elements where it overflows int64 marked
    not ok; else the sent ``b_i`` itself) in float64. Returns (advance, ok or None)."""
    # full models: each client's counters in int64 (its advance b_i - g is exact there); updates: straight to float64
    # (a uint64 advance past 2^63 must not wrap through int64 on the way)
    mat = _client_matrix(values, like, torch.int64 if models else torch.float64, like[0].device)
    ok = None
    if models:  # each client's advance b_i - g, exact in int64 (or refused where it overflows)
        g64 = _flat_cat(like).to(torch.int64)
        d = mat - g64
        ok = ~(((mat ^ g64) < 0) & ((d ^ mat) < 0)).any(dim=0)
        mat = d
    return _in_client_order(mat.to(device=device, dtype=torch.float64), coefs), ok


def weighted_f64(values: list, coefs: torch.Tensor, device, shape) -> torch.Tensor:
    """``sum_i coefs_i values_i`` in float64."""
    acc = torch.zeros(shape, dtype=torch.float64, device=device)
    for c, v in zip(coefs, values):
        acc += c * v.to(device=device, dtype=torch.float64)
    return acc


def _advanced(g: torch.Tensor, advance: torch.Tensor) -> tuple:
    """(``g + round(advance)`` in int64, where it fits ``g``'s dtype without wrapping)."""
    step = torch.round(advance)
    fits = torch.isfinite(step) & (step.abs() < 2.0 ** 62)
    g64, step64 = g.to(torch.int64), torch.where(fits, step, 0.0).to(torch.int64)
    new = g64 + step64  # |step| < 2^62: a wrap past the int64 range shows as a sign flip
    fits &= ~(((g64 >= 0) & (step64 >= 0) & (new < 0)) | ((g64 < 0) & (step64 < 0) & (new >= 0)))
    if g.dtype == torch.bool:
        return new, fits & (new >= 0) & (new <= 1)
    info = torch.iinfo(g.dtype)
    return new, fits & (new >= info.min) & (new <= info.max)


def write_buffers(updates: list, finite: torch.Tensor) -> None:
    """Write :func:`buffer_updates`' values (no host sync), a group of buffers at a time. Nothing changes when the
    round is not finite, and an element whose new value the buffer's dtype cannot hold keeps its old value: never
    Inf in a float16 / float32 statistic whose average overflows, never a wrapped integer (an int64 counter at its
    maximum stays there, a uint8 that would pass 255 stays as it was)."""
    for gs, new, ok in updates:
        vals = new.to(gs[0].dtype)
        if ok is None:
            ok = torch.isfinite(vals)
        out = torch.where(ok & finite, vals, _flat_cat(gs))
        pieces = list(out.split([g.numel() for g in gs]))  # 1-D: a view of its own only for another shape
        torch._foreach_copy_(gs, [o if g.dim() == 1 else o.view(g.shape) for o, g in zip(pieces, gs)])


def finish_writes(params: ParamRows, stats: RoundStats, updates: list, finite: torch.Tensor) -> None:
    """After a round's apply pass on ``params``: the buffers written (:func:`write_buffers`), autograd told
    (:func:`mark_written`), the clients' buffers the model lacks warned about."""
    write_buffers(updates, finite)
    mark_written(params)
    warn_unmatched_buffers(params, stats)


def mark_written(params: ParamRows) -> None:
    """Tell autograd that ``params`` (and the model's buffers) were written in place: the kernels write through raw
    pointers, which torch cannot see, so a graph saved from the old values (``loss = f(params)`` before the round,
    ``backward()`` after) would silently differentiate at the new ones. With the version counters bumped, that
    ``backward`` raises "modified by an inplace operation", as after torch.optim's ``p.add_()``. (The views share
    their tensors' counters; inference tensors have none and are skipped by torch.)"""
    torch._C._increment_version([*params.parts, *(b for _, b in params.buffers)])


def like_params(params: ParamRows, flat: torch.Tensor) -> ParamRows:
    """A flat buffer seen through ``params``' segments (for eval/broadcast outputs in params' form)."""
    return ParamRows(params.segments.slice(flat), params.segments, flat.dtype, flat.device, params.form, None)


def device_scalar(value, like: torch.Tensor) -> torch.Tensor:
    """A 0-d float64 tensor on ``like``'s device (tensors are converted without a host sync)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=torch.float64).reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=like.device)


def round_is_finite(nonfinite: torch.Tensor, eta: torch.Tensor, mean_sq: torch.Tensor) -> torch.Tensor:
    """Device bool: no client flagged non-finite, and eta and ||mean||^2 finite (no overflow)."""
    return ~nonfinite.any() & torch.isfinite(eta) & torch.isfinite(mean_sq)
