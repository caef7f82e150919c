"""Flower message-API strategies whose aggregation is one fused fastagg server step over the replies, read in place.

Each class subclasses the Flower strategy of the same name where Flower has one, so every Flower option
(sampling, ``min_*_nodes``, ``weighted_by_key``, ``arrayrecord_key``, metric aggregation, ``start``) keeps
working and keeps its name and default; fastagg adds the keywords ``backend`` and ``on_nonfinite``.

One round, for every strategy:

* ``configure_train`` keeps the model it sends (the global model; FedACG: its look-ahead point) as torch tensors the
  strategy owns, in the dtypes the user gave (Flower's FedAdam family turns float32 models into float64 after a
  round; fastagg does not).
* ``current_arrays`` (Flower's attribute) reads that model and, set by hand as Flower's own tests do, makes it the
  model the next replies are measured from; with no model at all, the rules whose result does not depend on it
  (FedAvg, the robust rules) aggregate the replies' models as Flower's do, the others raise ``AggregationError``.
  The FedOpt family (FedAdam, FedYogi, FedAdagrad, FedAMS) measures and steps every round from the model last sent
  or set, as Flower's does (its ``aggregate_train`` never replaces ``current_arrays``): rounds called without
  ``configure_train`` in between start again from it, and ``current_arrays`` reads it.
  Settings changed on the strategy between rounds (``eta``, ``server_momentum``, ``beta``,
  ``num_malicious_nodes``, ...) apply from the next round, as Flower's strategies read them every round.
* ``aggregate_train`` reads each reply's ``ArrayRecord`` in place (read-only numpy views of the message bytes: no
  per-client copy) and runs the fastagg server optimizer's step once over all of them, with the model sent as
  the base: each update ``model_i - sent`` is formed inside the stats pass and never stored, so the server's
  extra memory is the mean, not the M updates. (Flower already holds every reply's bytes when it calls
  ``aggregate_train``; folding them one by one into a :class:`fastagg.Accumulator` would read the running sum
  once per client, ~4x the traffic of one fused pass, and save no memory.)
  Entries named like torch buffers (``running_mean``, ``running_var``, ``num_batches_tracked``) and integer entries
  follow fastagg's buffer rule: weighted average (integers: rounded average advance), never stepped or counted.
* A reply that cannot be aggregated (not exactly one ArrayRecord and one MetricRecord, no numeric
  ``weighted_by_key`` >= 0, other keys or shapes than the model sent, an integer entry for a float one, bytes
  that disagree with their header, NaN/Inf; a float entry in another float dtype is cast to the model's) is, with
  ``on_nonfinite="skip"``, left out of the round and logged; with ``"raise"`` (default) the round is refused:
  ``AggregationError`` names the node and the problem, and the global model and every optimizer state are
  unchanged. (Under the robust strategies a reply holding NaN/Inf -- a compressed one also with an invalid code or
  a scale <= 0 -- is instead left out as an attack: :mod:`fastagg.flower.robust`.) Replies that are Flower errors
  (a client that failed) are logged and left out, as
  Flower does. A round with no usable reply keeps the model. Finite values so large that a new value would overflow
  (an Adam second moment of 1e38 updates) keep that element's old value: logged with ``"skip"``, an
  ``AggregationError`` after the round with ``"raise"`` (the one error raised after the model changed).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import pprint
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.exception import AggregationError
from flwr.serverapp.strategy import FedAdagrad as _FlFedAdagrad
from flwr.serverapp.strategy import FedAdam as _FlFedAdam
from flwr.serverapp.strategy import FedAvg as _FlFedAvg
from flwr.serverapp.strategy import FedAvgM as _FlFedAvgM
from flwr.serverapp.strategy import FedProx as _FlFedProx
from flwr.serverapp.strategy import FedYogi as _FlFedYogi
from flwr.serverapp.strategy import QFedAvg as _FlQFedAvg
from flwr.serverapp.strategy import Result as _FlResult
from flwr.serverapp.strategy.fedopt import FedOpt as _FlFedOpt
from flwr.supercore import log

from .. import robust, server
from .._checks import check_on_nonfinite
from ..compress import SparseUpdate
from ..flat import as_tensor, is_buffer_name, split_entries
from .compressed import is_compressed_record, read_compressed
from .records import ReplyError, record_views, reply_weight, to_record

__all__ = ["FedAvg", "FedAvgM", "FedProx", "FedAdam", "FedYogi", "FedAdagrad", "FedAMS", "FedExP", "FedExPM",
           "FedACG", "QFedAvg"]


def _metric_kind(value) -> tuple:
    """What a metric value is, for comparing replies: ("list", length) or ("number",)."""
    return ("list", len(value)) if isinstance(value, list) else ("number",)


def _norm_bit(msg: Message) -> int:
    """A reply's ``norm_bit`` metric (Flower's adaptiveclipping_mod: 1 when the client clipped its update)."""
    metrics = next(iter(msg.content.metric_records.values()))
    return int(bool(metrics.get("norm_bit", 0)))


@functools.lru_cache(maxsize=64)
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    """torch's dtype for a numpy dtype (kept: it is asked twice per entry of every reply)."""
    return torch.from_numpy(np.empty(0, dtype)).dtype


@dataclasses.dataclass
class CompressedReply:
    """A reply of fastagg's compress_mod: the compressed parameter update and the model's buffers (numpy views)."""

    update: object
    buffers: dict
    problem: str | None = None  # under a robust rule: why the reply is left out (NaN/Inf, an invalid code, ...)

    def rule_update(self):
        """The update the rule reads: a reply with a problem reads as a non-finite one (left out by robust rules,
        counted among ``f``), whatever its codes would dequantize to."""
        if self.problem is None:
            return self.update
        device = self.update.device
        return SparseUpdate(torch.zeros(1, dtype=torch.int32, device=device),
                            torch.full((1,), float("nan"), device=device), self.update.numel)


class _Fastagg:
    """The fastagg round, mixed in before a Flower strategy class. Subclasses define ``_optimizer(params)``."""

    def _init_fastagg(self, backend: str, on_nonfinite: str, buffers: str) -> None:
        check_on_nonfinite(on_nonfinite)
        if buffers not in server.BUFFER_POLICIES:
            raise ValueError(f"buffers must be one of {server.BUFFER_POLICIES}, got {buffers!r}")
        self.backend = backend
        self.on_nonfinite = on_nonfinite
        self.buffers = buffers
        self.global_model: dict[str, torch.Tensor] | None = None  # the strategy's own copy, updated in place
        self.optimizer: server.ServerOptimizer | None = None
        self.last_stats: server.StepStats | None = None
        self._returned: ArrayRecord | None = None  # the record aggregate_train returned (the global model)
        self._sent: dict[str, torch.Tensor] | None = None  # what this round's clients started from
        # FedOpt family: the record last sent (configure_train) or set (current_arrays), which Flower's FedOpt keeps
        # as current_arrays and measures every round from until the next configure_train; _stepped: a round has
        # stepped the global model since (a reference, no copy: see _restore_sent)
        self._pinned: ArrayRecord | None = None
        self._stepped = False
        self._model_changed = False  # set by _step when it raises after the model changed (overflow)
        self.server_metrics: dict[int, MetricRecord] = {}  # round -> the server's statistics (FedExP's eta, ...)
        self._optimizer(torch.zeros(1))  # checks the hyperparameters now, not at the first round

    def _optimizer(self, params) -> server.ServerOptimizer:
        raise NotImplementedError

    def _opt_kw(self) -> dict:
        # on_nonfinite: the strategy decides what a flagged round means
        return {"backend": self.backend, "on_nonfinite": "skip", "buffers": self.buffers}

    # -- the model sent ----------------------------------------------------------------------------------------
    @property
    def current_arrays(self):
        """Flower's ``current_arrays``: the global model the next replies are measured from, as Flower's class of
        the same name keeps it (its FedOpt family: ``{key: numpy array}``; the others: an ``ArrayRecord``), a copy;
        None before a model is known. Setting it, as Flower's own tests do before calling ``aggregate_train``
        without ``configure_train``, makes it the global model and the model the next replies are measured from
        (the optimizer's state is kept when the keys, shapes and dtypes are the global model's; other ones are
        refused). Setting None forgets the model and the optimizer's state."""
        model = self.__dict__.get("global_model")
        if model is None:
            return None
        if isinstance(self, _FlFedOpt):
            if self._pinned is not None:  # Flower's FedOpt keeps the model sent, not its own output
                return {k: np.array(v) for k, v in record_views(self._pinned).items()}
            return {k: v.numpy().copy() for k, v in model.items()}
        return to_record(model)

    @current_arrays.setter
    def current_arrays(self, value) -> None:
        if "_returned" not in self.__dict__:  # Flower's __init__ (None) before fastagg's
            if value is not None:
                raise ValueError("current_arrays can be set once the strategy is built")
            return
        if value is None:
            self._forget_model()
            return
        if isinstance(value, Mapping) and not isinstance(value, ArrayRecord):
            try:
                value = to_record(value)
            except (TypeError, ValueError) as e:
                raise ReplyError(f"current_arrays: {e}") from e
        self._adopt(value, "current_arrays")
        self._returned = None
        self._sent = self._train_model()
        self._pinned, self._stepped = value, False

    def _forget_model(self) -> None:
        self.global_model = self.optimizer = self._sent = self._returned = self._pinned = None
        self._stepped = False

    def _restore_sent(self) -> dict | None:
        """Flower's FedOpt family measures and steps every round from its ``current_arrays``, the model last sent
        by ``configure_train`` or set by hand, which its ``aggregate_train`` never replaces. A FedOpt round that
        follows another without ``configure_train`` in between therefore starts again from that model: it is
        copied back into the global model (the optimizer's moments kept, as Flower keeps them). Returns the
        global model as it was (a copy, to put back if the round is refused), or None when nothing was done --
        always the case in a run driven by ``start`` (one ``configure_train`` per round)."""
        if not (self._stepped and self._pinned is not None and isinstance(self, _FlFedOpt)):
            return None
        views = self._floats_as_global(record_views(self._pinned, "current_arrays"))
        self._check_like_global(views, "current_arrays")
        backup = {k: v.clone() for k, v in self.global_model.items()}
        for k, v in views.items():
            self.global_model[k].numpy()[...] = v  # (no tensor of the read-only view)
        self._returned = None
        self._sent = self._train_model()
        return backup

    def _base_free(self) -> bool:
        """Whether a round's result is the same from any model sent: FedAvg (``w + sum_i p_i (w_i - w)`` is
        ``sum_i p_i w_i``), FedAvgM with Flower's no-server-optimizer settings, and the robust rules that move with
        the replies (median, trimmed mean, Krum, Bulyan, MeaMed). Those may aggregate before any model is known,
        as Flower's FedAvg, FedMedian, Krum, ... do."""
        from .. import robust

        probe = self._optimizer(torch.zeros(1))
        agg = probe.aggregate
        if agg is not None and not isinstance(agg, (robust.Median, robust.TrimmedMean, robust.MeaMed, robust.Krum,
                                                    robust.MultiKrum, robust.Bulyan)):
            return False
        if type(probe) is server.FedAvg:
            return probe.lr == 1.0
        return type(probe) is server.FedAvgM and probe.lr == 1.0 and probe.momentum == 0.0

    def _model_from_replies(self, replies: list) -> bool:
        """Before any model is known (no ``configure_train``, no ``current_arrays``): for a base-free round, the
        first reply's model structure as zeros (so each update is the reply's model itself); True if one was
        taken. Otherwise AggregationError, as Flower's FedAvgM and FedOpt raise."""
        if not self._base_free():
            raise AggregationError(f"aggregate_train before configure_train: no model was sent, and "
                                   f"{type(self).__name__}'s step depends on it (call configure_train, or set "
                                   "current_arrays to the model the clients started from)")
        for m in replies:
            if m.has_error() or len(m.content.array_records) != 1:
                continue
            record = next(iter(m.content.array_records.values()))
            if is_compressed_record(record):
                continue
            try:
                views = record_views(record)
            except (TypeError, ValueError):
                continue
            self.global_model = {k: torch.zeros(v.shape, dtype=_torch_dtype(v.dtype)) for k, v in views.items()}
            self.optimizer = self._optimizer(self.global_model)
            self._sent = self.global_model
            return True
        return False

    def _adopt(self, arrays: ArrayRecord, where: str = "the arrays passed to configure_train") -> None:
        """Make ``arrays`` the global model unless they are the record this strategy returned (then they are)."""
        if arrays is self._returned and self.global_model is not None:
            return
        views = record_views(arrays, where)
        if self.global_model is None:
            self.global_model = {k: torch.from_numpy(np.array(v)) for k, v in views.items()}  # owned copies
            self.optimizer = self._optimizer(self.global_model)
            self._log_buffer_policy()
            return
        views = self._floats_as_global(views)
        self._check_like_global(views, where)
        for k, v in views.items():  # another model than the one returned (a restart): taken as it is, in place
            self.global_model[k].numpy()[...] = v  # (no tensor of the read-only view)

    def _log_buffer_policy(self) -> None:
        """Once per run: what happens to the model's buffers (BatchNorm statistics), which Flower's own strategies
        step like parameters."""
        names = [n for n, _ in self.optimizer._p.buffers]
        stepped = [n for n in self.global_model if n not in set(names) and is_buffer_name(n)]
        if self.buffers == "average" and names:
            log(INFO, "fastagg: buffers %s are the clients' weighted average, never stepped (buffers='optimizer' "
                "steps them as Flower's strategies do)", names[:4] + (["..."] if len(names) > 4 else []))
        elif stepped:
            log(INFO, "fastagg: buffers %s are stepped by the optimizer like parameters, as Flower's strategies "
                "do (buffers='average', the default, averages them)", stepped[:4] + (["..."] if len(stepped) > 4 else []))

    def _check_like_global(self, views: dict, where: str) -> None:
        g = self.global_model
        if set(views) != set(g):
            missing, extra = sorted(set(g) - set(views)), sorted(set(views) - set(g))
            raise ReplyError(f"{where} lack entries {missing[:4]}" if missing else
                             f"{where} have entries {extra[:4]} the global model does not")
        for k, v in views.items():
            want = g[k]
            if tuple(v.shape) != tuple(want.shape) or _torch_dtype(v.dtype) != want.dtype:
                raise ReplyError(f"{where}[{k!r}] has shape {tuple(v.shape)} dtype {v.dtype}; the global model's is "
                                 f"shape {tuple(want.shape)} dtype {str(want.dtype).removeprefix('torch.')}")

    def _train_model(self) -> dict[str, torch.Tensor]:
        """What clients start the round from (FedACG: its look-ahead point)."""
        return self.global_model

    def _train_config(self, config: ConfigRecord) -> None:
        """Entries a strategy adds to the train config (FedACG: the prox coefficient)."""

    def _flower_configure_train(self, server_round, arrays, config, grid):
        # Flower's FedOpt.configure_train deserializes a copy of the whole model every round; FedAvg's only samples
        return _FlFedAvg.configure_train(self, server_round, arrays, config, grid)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Flower's sampling and messages; the model sent is kept (as torch tensors) to form the updates against."""
        self._adopt(arrays)
        self._sent = self._train_model()
        self._pinned, self._stepped = arrays, False
        send = arrays if self._sent is self.global_model else to_record(self._sent)
        self._train_config(config)
        return self._flower_configure_train(server_round, send, config, grid)

    # -- aggregation -------------------------------------------------------------------------------------------
    def _read(self, msg: Message) -> tuple[dict, float]:
        """A reply's arrays (views of its bytes) and weight; raises ReplyError saying what is wrong."""
        content = msg.content
        if len(content.array_records) != 1:
            raise ReplyError(f"has {len(content.array_records)} ArrayRecords; expected exactly one")
        if len(content.metric_records) != 1:
            raise ReplyError(f"has {len(content.metric_records)} MetricRecords; expected exactly one")
        weight = reply_weight(next(iter(content.metric_records.values())), self.weighted_by_key)
        key, record = next(iter(content.array_records.items()))
        if is_compressed_record(record):
            return self._read_compressed(record, f"ArrayRecord {key!r}"), weight
        views = self._floats_as_global(record_views(record, f"ArrayRecord {key!r}"))
        self._check_like_global(views, f"ArrayRecord {key!r}")
        return views, weight

    def _read_compressed(self, record: ArrayRecord, where: str) -> "CompressedReply":
        """A reply of :func:`fastagg.flower.compressed.compress_mod`: the compressed update (read in place) checked
        against the model's parameters, its buffers against the model's, every value finite, every code valid. Under
        a robust rule a reply whose values are not (NaN/Inf, an invalid code, a scale <= 0) is kept with its
        ``problem``: the rule leaves it out, as it leaves out a float reply holding NaN (an attack, not an
        accident); other strategies refuse it (``ReplyError``: the round refused, or the reply skipped)."""
        if self.buffers != "average":
            raise ReplyError("is compressed (parameters only); buffers='optimizer' steps buffers as parameters")
        update, bufs = read_compressed(record, where)
        numel = self.optimizer._p.segments.numel
        if update.numel != numel:
            raise ReplyError(f"is a compressed update of {update.numel} elements; the model has {numel} parameters")
        if update.device != self.optimizer.device:
            raise ReplyError(f"is on {update.device}; the model is on {self.optimizer.device}")
        names = [n for n, _ in self.optimizer._p.buffers]
        self._check_like_buffers(bufs, names, where)
        if isinstance(update, SparseUpdate):
            update.check_indices(where)
            problem = None if bool(torch.isfinite(update.values).all()) else "contains NaN or Inf"
        elif update.holds_invalid_code():
            problem = update.INVALID_CODES
        elif bool((torch.isfinite(update.scales) & ~(update.scales > 0)).any()):
            problem = "has a compressed scale <= 0"
        else:
            problem = None if bool(torch.isfinite(update.scales).all()) else "contains NaN or Inf"
        if problem is None and not all(np.isfinite(v).all() for v in bufs.values() if v.dtype.kind == "f"):
            problem = "contains NaN or Inf"
        robust_rule = isinstance(self.optimizer.aggregate, robust.RULES)
        if problem is None and robust_rule and any((np.asarray(v) < 0).any() for k, v in bufs.items()
                                                   if k.rsplit(".", 1)[-1] == "running_var"):
            problem = "has a negative running_var"  # (as a float reply's: an attack under a robust rule)
        if problem is not None and not robust_rule:
            raise ReplyError(problem)
        return CompressedReply(update, bufs, problem)

    def _check_like_buffers(self, bufs: dict, names: list, where: str) -> None:
        if set(bufs) != set(names):
            raise ReplyError(f"{where} carries buffers {sorted(bufs)[:4]}; the model's are {sorted(names)[:4]}")
        self._check_like_global({**{k: v for k, v in bufs.items()},
                                 **{k: self.global_model[k].numpy() for k in self.global_model if k not in bufs}},
                                where)

    def _floats_as_global(self, views: dict) -> dict:
        """A reply's floating entries in another float dtype than the global model's (float64 from a numpy client
        of a float32 model) are cast to the model's, as fastagg's own steps convert updates on load: one copy of
        that entry. Everything else (an integer entry for a float one, other shapes) is checked as it came."""
        out = {}
        for k, v in views.items():
            want = self.global_model.get(k)
            if want is not None and v.dtype.kind == "f" and want.is_floating_point() and \
                    _torch_dtype(v.dtype) != want.dtype and want.dtype != torch.bfloat16:
                with np.errstate(over="ignore"):
                    cast = v.astype(torch.empty(0, dtype=want.dtype).numpy().dtype)
                if not np.isfinite(cast).all() and np.isfinite(v).all():
                    raise ReplyError(f"entry {k!r} holds {v.dtype} values beyond the range of the model's "
                                     f"{str(want.dtype).removeprefix('torch.')}")
                v = cast
            out[k] = v
        return out

    def _refuse_or_skip(self, server_round: int, msg: Message, problem: str, cause: Exception | None = None) -> None:
        node = msg.metadata.src_node_id
        if self.on_nonfinite == "skip":
            log(WARNING, "aggregate_train: node %d left out of round %d: its reply %s", node, server_round, problem)
            return
        raise AggregationError(f"round {server_round}: the reply of node {node} {problem}; the round is refused and "
                               "the global model is unchanged (on_nonfinite='skip' would leave the node out)") from cause

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """One fused fastagg server step over every usable reply (see the module doc). Before any model is known
        (no ``configure_train``, no ``current_arrays``), a base-free round (FedAvg, the robust rules) aggregates the
        replies' models themselves, as Flower's do; other strategies raise ``AggregationError``."""
        replies = list(replies)
        if self.global_model is not None:
            backup = self._restore_sent()
            self._model_changed = False
            try:
                out = self._aggregate_train(server_round, replies)
            except BaseException:
                if backup is not None and not self._model_changed:  # a refused round leaves the model as it was
                    for k, v in backup.items():
                        self.global_model[k].copy_(v)
                raise
            if out[0] is None and backup is not None:  # no step: the model is kept
                for k, v in backup.items():
                    self.global_model[k].copy_(v)
            return out
        if not self._model_from_replies(replies):
            if any(not m.has_error() for m in replies):
                raise AggregationError(f"round {server_round}: no model was sent and no reply carries one (exactly "
                                       "one ArrayRecord of numpy arrays); the round is refused")
            log(INFO, "aggregate_train: Received 0 results and %s failures", len(replies))
            return None, None
        try:
            out = self._aggregate_train(server_round, replies)
        except BaseException:
            self._forget_model()  # a refused round leaves no model behind
            raise
        if out[0] is None:
            self._forget_model()
        return out

    def _aggregate_train(self, server_round: int, replies: list) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid = [m for m in replies if not m.has_error()]
        log(INFO, "aggregate_train: Received %s results and %s failures", len(valid), len(replies) - len(valid))
        for m in replies:
            if m.has_error():
                log(INFO, "\t> Received error in reply from node %d: %s", m.metadata.src_node_id, m.error.reason)
        usable = []  # (message, views of its arrays, weight)
        for m in valid:
            try:
                usable.append((m, *self._read(m)))
            except (ValueError, TypeError) as e:
                self._refuse_or_skip(server_round, m, str(e), e)
        usable = self._metrics_alike(server_round, usable)
        self._check_metrics(server_round, [m.content for m, _, _ in usable])  # before the model can change
        stats, usable = self._step(server_round, usable)
        if stats is None:
            log(WARNING, "aggregate_train: no usable reply with a positive %r in round %d: the global model is kept",
                self.weighted_by_key, server_round)
            return None, None
        metrics = self._metrics([m.content for m, _, _ in usable])  # the replies aggregated, no others
        if not bool(stats.finite):
            log(WARNING, "aggregate_train: round %d's step does not fit the model's dtype (eta=%s): the global model "
                "is kept", server_round, float(stats.eta))
            return None, metrics
        kept = int(stats.overflowed.item()) if stats.overflowed is not None else 0
        if kept:
            log(WARNING, "aggregate_train: round %d: %d elements whose new value would have overflowed kept their "
                "previous values", server_round, kept)
        own = self._round_metrics(stats)
        if own:  # the server's statistics, kept apart from the clients' train metrics
            self.server_metrics[server_round] = MetricRecord(own)
            log(INFO, "aggregate_train: round %d server metrics %s", server_round,
                {k: round(v, 6) for k, v in own.items()})
        self._returned = to_record(self.global_model)
        self._stepped = True
        return self._returned, metrics

    def _metrics_alike(self, server_round: int, usable: list) -> list:
        """The replies whose train metrics have the kind (a number, or a list of one length) that the first reply's
        have for the same key: Flower's metric aggregation would otherwise raise on them after the step."""
        if not usable:
            return usable
        kinds: dict = {}
        out = []
        for entry in usable:
            metrics = next(iter(entry[0].content.metric_records.values()))
            clash = next((k for k, v in metrics.items() if k in kinds and kinds[k] != _metric_kind(v)), None)
            if clash is not None:
                self._refuse_or_skip(server_round, entry[0], f"has metric {clash!r} of another kind than the other "
                                     f"replies' ({_metric_kind(metrics[clash])[0]} vs {kinds[clash][0]})")
                continue
            for k, v in metrics.items():
                kinds.setdefault(k, _metric_kind(v))
            out.append(entry)
        return out

    def _check_metrics(self, server_round: int, contents: list) -> None:
        """Run the train-metrics aggregation once before the step: a function that fails on these replies fails
        while the global model is still unchanged."""
        if not contents:
            return
        try:
            self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        except Exception as e:  # noqa: BLE001 (whatever the user's aggregation raises)
            raise AggregationError(f"round {server_round}: the train metrics cannot be aggregated ({e!r:.200}); the "
                                   "round is refused and the global model is unchanged") from e

    def _metrics(self, contents: list) -> MetricRecord:
        try:
            return self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        except Exception as e:  # noqa: BLE001 (checked before the step; a subset cannot fail but a user fn might)
            log(WARNING, "aggregate_train: the train metrics of the replies aggregated could not be aggregated: %r", e)
            return MetricRecord()

    def _step(self, server_round: int, usable: list) -> tuple:
        """The optimizer's step over ``usable`` (dropping, or refusing on, the replies the stats pass flags: NaN/Inf,
        or finite values so large that the round's sums overflow); (stats, the replies aggregated), stats None when
        nothing is left to aggregate. The optimizer runs in "skip" mode: a round it flags writes nothing, so this
        method decides what a flagged reply means."""
        self._sync_hyperparameters()
        rule = self.optimizer.aggregate
        while usable and sum(w for _, _, w in usable) > 0:
            self.optimizer.flat_state["step"].fill_(server_round - 1)  # Flower's round numbering (FedAdam's bias corr.)
            weights = None if rule is not None and not rule.weighted else [w for _, _, w in usable]
            if hasattr(rule, "set_norm_bits"):  # client-side adaptive DP: the clients' reports, in step order
                rule.set_norm_bits([_norm_bit(m) for m, _, _ in usable])
            stats = self._optimizer_step(usable, weights)
            if stats.robust is not None:  # a robust rule: NaN/Inf replies were left out (attacks), not refused
                for i in stats.robust.excluded.nonzero().flatten().tolist():
                    v = usable[i][1]
                    log(WARNING, "aggregate_train: node %d left out of round %d: its reply %s",
                        usable[i][0].metadata.src_node_id, server_round,
                        v.problem if isinstance(v, CompressedReply) and v.problem else "holds NaN or Inf")
                self.last_stats = stats
                return stats, [u for i, u in enumerate(usable) if bool(stats.robust.selected[i])]
            if bool(stats.finite):
                if stats.overflowed is not None and self.on_nonfinite == "raise" and int(stats.overflowed.item()):
                    # the model changed: the next configure_train takes the one Flower passes
                    self._returned, self._model_changed, self._stepped = None, True, True
                    raise AggregationError(
                        f"round {server_round}: {int(stats.overflowed.item())} elements of the model or the "
                        "optimizer's state would have become Inf or NaN (values at the edge of their dtype); those "
                        "elements kept their previous values, every other element was updated")
                self.last_stats = stats
                return stats, usable
            bad = stats.nonfinite.nonzero().flatten().tolist()
            why = "contains NaN or Inf"
            if not bad:
                bad, why = self._overflowing(usable, stats), "is so large that the round's sums would overflow"
            if not bad:  # every reply of an ordinary size: the step itself does not fit the dtype
                if self.on_nonfinite == "raise":
                    raise AggregationError(f"round {server_round}: the step does not fit the model's dtype "
                                           f"(eta={float(stats.eta)!r}); the round is refused and the global model "
                                           "is unchanged")
                self.last_stats = stats
                return stats, usable
            for i in bad:
                self._refuse_or_skip(server_round, usable[i][0], why)
            usable = [u for i, u in enumerate(usable) if i not in set(bad)]
        return None, usable

    def _sync_hyperparameters(self) -> None:
        """Flower's strategies read their settings (``eta``, ``server_learning_rate``, ``beta_1``, ...) in every
        round, so one set on the strategy between rounds applies from the next: the optimizer's hyperparameters are
        set from the strategy's attributes (checked as the constructor checks them), its state kept."""
        probe = self._optimizer(torch.zeros(1))
        for k in self.optimizer._hyper:
            if getattr(probe, k) != getattr(self.optimizer, k):
                setattr(self.optimizer, k, getattr(probe, k))

    def _optimizer_step(self, usable: list, weights) -> server.StepStats:
        """The optimizer's step over the usable replies (QFedAvg passes their losses instead of weights)."""
        if any(isinstance(v, CompressedReply) for _, v, _ in usable):
            return self._compressed_step(usable, weights)
        return self.optimizer.step([v for _, v, _ in usable], weights=weights, base=self._sent)

    def _compressed_step(self, usable: list, weights) -> server.StepStats:
        """A round with compressed replies: all compressed, folded where they lie; mixed with full models, each
        compressed one dequantized into a row beside the others' updates. Buffers: the replies' weighted average
        (integer counters: the rounded average advance), written only when the step is taken."""
        opt = self.optimizer
        if all(isinstance(v, CompressedReply) for _, v, _ in usable):
            updates = [v.rule_update() for _, v, _ in usable]
        else:
            sent = dict(split_entries(self._sent, where="the model sent")[0])
            rows = []
            for _, v, _ in usable:
                if isinstance(v, CompressedReply):
                    rows.append(v.rule_update().dequantize(opt._cdt))
                else:
                    params = split_entries(v, where="the reply")[0]
                    rows.append(torch.cat([as_tensor(x).reshape(-1).to(opt._cdt) -
                                           sent[k].reshape(-1).to(opt._cdt) for k, x in params]))
            updates = torch.stack(rows)
        try:
            with warnings.catch_warnings():  # the buffers are averaged below, from the replies' own
                warnings.filterwarnings("ignore", message="the global model has buffers", category=RuntimeWarning)
                stats = opt.step(updates, weights=weights)
        except ValueError:  # (all compressed, folded in an Accumulator) the round's sums would overflow: nothing
            # changed; each reply's norm lets _step find the ones too large (_overflowing) and refuse or skip them
            norms = torch.stack([u.dequantize(torch.float64).square().sum() for u in updates])
            return types.SimpleNamespace(finite=torch.tensor(False), robust=None, eta=torch.tensor(float("nan")),
                                         nonfinite=torch.zeros(len(usable), dtype=torch.bool), sq_norms=norms)
        if not bool(stats.finite):  # the model is unchanged; _step decides what the flagged round means
            return stats
        w = np.ones(len(usable)) if weights is None else np.asarray(weights, dtype=np.float64)
        kept = list(range(len(usable)))
        if stats.robust is not None:  # the replies a robust rule left out bring no buffers (0 * NaN is NaN)
            kept = (~stats.robust.excluded).nonzero().flatten().tolist()
        w = w[kept]
        p = w / w.sum()
        for name, _ in opt._p.buffers:
            got = [v.buffers[name] if isinstance(v, CompressedReply) else v[name]
                   for _, v, _ in (usable[i] for i in kept)]
            old = self._sent[name]
            if old.is_floating_point():
                avg = sum(pi * np.asarray(g, dtype=np.float64) for pi, g in zip(p, got))
                self.global_model[name].copy_(torch.from_numpy(np.asarray(avg)).to(old.dtype))
            else:
                step = sum(pi * (np.asarray(g, dtype=np.float64) - old.numpy()) for pi, g in zip(p, got))
                self.global_model[name].copy_(old + torch.from_numpy(np.asarray(np.rint(step))).to(old.dtype))
        stats.nonfinite = torch.zeros(len(usable), dtype=torch.bool)
        return stats

    def _overflowing(self, usable: list, stats: server.StepStats) -> list:
        """The replies that can make the weighted mean overflow its dtype: if an element of ``sum_i p_i d_i`` passes
        the dtype's largest value F, some reply has ``p_i ||d_i|| > F / M``; an honest update is nowhere near."""
        w = np.array([wt for _, _, wt in usable], dtype=np.float64)
        p = (w / w.max()) / (w / w.max()).sum()
        norms = np.sqrt(stats.sq_norms.detach().cpu().double().numpy())
        limit = torch.finfo(self.optimizer._cdt).max / len(usable)
        return [i for i in range(len(usable)) if not np.isfinite(norms[i]) or p[i] * norms[i] > limit]

    def _round_metrics(self, stats: server.StepStats) -> dict:
        return {}

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args, **kwargs) -> "Result":
        """Flower's ``start``; the result is a :class:`Result` whose ``train_metrics_serverapp`` holds the server's
        statistics per round (FedExP's ``fedexp-eta``, ...), apart from the clients' ``train_metrics_clientapp``."""
        self.server_metrics = {}
        out = super().start(grid, initial_arrays, *args, **kwargs)
        return Result(**{f.name: getattr(out, f.name) for f in dataclasses.fields(out)},
                      train_metrics_serverapp=dict(self.server_metrics))

    def summary(self) -> None:
        probe = self._optimizer(torch.zeros(1))
        log(INFO, "\t├──> fastagg %s %s, backend=%r, on_nonfinite=%r", type(probe).__name__, probe.hyperparameters,
            self.backend, self.on_nonfinite)
        super().summary()


@dataclasses.dataclass
class Result(_FlResult):
    """Flower's ``Result`` plus ``train_metrics_serverapp``: round -> the server's statistics of the aggregation
    (FedExP's ``fedexp-eta``, ``fedexp-mean-sq-norm``, ``fedexp-avg-sq-norm``), which are not client metrics."""

    train_metrics_serverapp: dict[int, MetricRecord] = dataclasses.field(default_factory=dict)

    def __repr__(self) -> str:
        return (super().__repr__() + "\nServerApp-side Train Metrics (fastagg):\n"
                + pprint.pformat({r: dict(m) for r, m in self.train_metrics_serverapp.items()}, indent=2) + "\n")


def _signature(cls, flower_cls) -> None:
    """``cls.__init__``'s signature: Flower's parameters, then fastagg's keywords (for help() and IDEs)."""
    params = list(inspect.signature(flower_cls.__init__).parameters.values())
    cls.__init__.__signature__ = inspect.Signature(params + _FASTAGG_KW)


_FASTAGG_KW = [inspect.Parameter("backend", inspect.Parameter.KEYWORD_ONLY, default="auto"),
               inspect.Parameter("on_nonfinite", inspect.Parameter.KEYWORD_ONLY, default="raise"),
               inspect.Parameter("buffers", inspect.Parameter.KEYWORD_ONLY, default="average")]


def _flower_subclass(name: str, flower_cls: type, make: Callable, doc: str) -> type:
    """A fastagg strategy with exactly ``flower_cls``'s constructor plus ``backend`` and ``on_nonfinite``."""

    def __init__(self, *args, backend: str = "auto", on_nonfinite: str = "raise",
                 buffers: str = "average", **kwargs):
        flower_cls.__init__(self, *args, **kwargs)
        self._init_fastagg(backend, on_nonfinite, buffers)

    cls = type(name, (_Fastagg, flower_cls), {"__init__": __init__, "_optimizer": make, "__doc__": doc,
                                               "__module__": __name__})
    _signature(cls, flower_cls)
    return cls


_COMMON = """

    Every argument of Flower's ``{flower}`` keeps its name and default; fastagg adds ``backend`` (``"auto"``,
    ``"cpu"``, ``"triton"``, ``"reference"``), ``on_nonfinite`` (``"raise"``: a bad reply refuses the round;
    ``"skip"``: it is left out and logged) and ``buffers`` (``"average"``: BatchNorm statistics and other buffers
    are the clients' weighted average; ``"optimizer"``: stepped like parameters, as Flower's strategies do -- the
    Flower-identical baseline). See :mod:`fastagg.flower`."""

FedAvg = _flower_subclass(
    "FedAvg", _FlFedAvg, lambda self, p: server.FedAvg(p, **self._opt_kw()),
    "FedAvg: ``w <- w + sum_i p_i (w_i - w)``, the examples-weighted average (Flower's ``FedAvg``)."
    + _COMMON.format(flower="FedAvg"))

FedAvgM = _flower_subclass(
    "FedAvgM", _FlFedAvgM,
    lambda self, p: server.FedAvgM(p, lr=self.server_learning_rate, momentum=self.server_momentum, **self._opt_kw()),
    "FedAvgM: ``v <- server_momentum v - mean;  w <- w - server_learning_rate v`` (Flower's ``FedAvgM``)."
    + _COMMON.format(flower="FedAvgM"))


class FedProx(_Fastagg, _FlFedProx):
    """FedProx: FedAvg on the server; ``configure_train`` sends ``proximal-mu`` in the config, the coefficient of the
    clients' ``(mu/2) ||w - w_global||^2`` (Flower's ``FedProx``)."""

    def __init__(self, *args, backend: str = "auto", on_nonfinite: str = "raise",
                 buffers: str = "average", **kwargs):
        _FlFedProx.__init__(self, *args, **kwargs)
        self._init_fastagg(backend, on_nonfinite, buffers)

    def _optimizer(self, p):
        return server.FedAvg(p, **self._opt_kw())

    def _flower_configure_train(self, server_round, arrays, config, grid):
        return _FlFedProx.configure_train(self, server_round, arrays, config, grid)


_signature(FedProx, _FlFedProx)
FedProx.__doc__ += _COMMON.format(flower="FedProx")


def _adam_kw(self) -> dict:
    return dict(lr=self.eta, betas=(self.beta_1, self.beta_2), tau=self.tau, **self._opt_kw())


FedAdam = _flower_subclass(
    "FedAdam", _FlFedAdam, lambda self, p: server.FedAdam(p, bias_correction="flower", **_adam_kw(self)),
    "FedAdam with Flower's bias-corrected rate ``eta sqrt(1 - beta_2^(t+1)) / (1 - beta_1^(t+1))`` in round t "
    "(Flower's ``FedAdam``; ``eta_l`` is kept for clients, as in Flower).\n\n    ``m <- beta_1 m + (1 - beta_1) mean;  "
    "v <- beta_2 v + (1 - beta_2) mean^2;  w <- w + eta_t m / (sqrt(v) + tau)``" + _COMMON.format(flower="FedAdam"))

FedYogi = _flower_subclass(
    "FedYogi", _FlFedYogi, lambda self, p: server.FedYogi(p, **_adam_kw(self)),
    "FedYogi: ``v <- v - (1 - beta_2) mean^2 sign(v - mean^2)``, Adam's other updates, no bias correction "
    "(Flower's ``FedYogi``)." + _COMMON.format(flower="FedYogi"))

FedAdagrad = _flower_subclass(
    "FedAdagrad", _FlFedAdagrad, lambda self, p: server.FedAdagrad(p, lr=self.eta, tau=self.tau, **self._opt_kw()),
    "FedAdagrad: ``v <- v + mean^2;  w <- w + eta mean / (sqrt(v) + tau)`` (Flower's ``FedAdagrad``)."
    + _COMMON.format(flower="FedAdagrad"))


class FedAMS(_Fastagg, _FlFedOpt):
    """FedAMS (Wang et al. 2022): Adam's moments, ``vhat <- max(vhat, v, vhat_floor)``,
    ``w <- w + eta m / (sqrt(vhat) + tau)``. Flower has no FedAMS: the arguments are Flower's ``FedOpt``'s with
    FedAMS's defaults (``eta=0.1, beta_1=0.9, beta_2=0.99, tau=0``) plus ``vhat_floor`` (default 1e-8)."""

    def __init__(self, *, eta: float = 0.1, eta_l: float = 0.1, beta_1: float = 0.9, beta_2: float = 0.99,
                 tau: float = 0.0, vhat_floor: float = 1e-8, backend: str = "auto", on_nonfinite: str = "raise",
                 buffers: str = "average", **kwargs):
        _FlFedOpt.__init__(self, eta=eta, eta_l=eta_l, beta_1=beta_1, beta_2=beta_2, tau=tau, **kwargs)
        self.vhat_floor = vhat_floor
        self._init_fastagg(backend, on_nonfinite, buffers)

    def _optimizer(self, p):
        return server.FedAMS(p, vhat_floor=self.vhat_floor, **_adam_kw(self))


class _FedExPFamily(_Fastagg, _FlFedAvg):
    """Clients train from the newest model; evaluation (``configure_evaluate``, ``start``'s ``evaluate_fn``) uses the
    average of the last two, FedExP's rule. Each round reports ``fedexp-eta``, ``fedexp-mean-sq-norm``
    (``||mean||^2``; FedExP-M: ``||v||^2``) and ``fedexp-avg-sq-norm`` (the clients' weighted mean of
    ``||delta_i||^2``) as server metrics: ``strategy.server_metrics[round]`` and ``start()``'s
    ``Result.train_metrics_serverapp``, apart from the clients' train metrics."""

    def __init__(self, *args, backend: str = "auto", on_nonfinite: str = "raise",
                 buffers: str = "average", **kwargs):
        _FlFedAvg.__init__(self, *args, **kwargs)
        self._init_fastagg(backend, on_nonfinite, buffers)

    def eval_model(self) -> dict[str, torch.Tensor] | None:
        """The model to evaluate, by key: the FedExP average of the last two iterates (buffers: the global's)."""
        if self.global_model is None:
            return None
        ev = self.optimizer.eval_params()
        return {k: ev.get(k, v) if isinstance(ev, dict) else v for k, v in self.global_model.items()}

    def _eval_record(self, arrays: ArrayRecord) -> ArrayRecord:
        return to_record(self.eval_model()) if arrays is self._returned and self._returned is not None else arrays

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return _FlFedAvg.configure_evaluate(self, server_round, self._eval_record(arrays), config, grid)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's ``start``; ``evaluate_fn`` is given the evaluation model (the average of the last two)."""
        wrapped = None if evaluate_fn is None else (lambda rnd, arrays: evaluate_fn(rnd, self._eval_record(arrays)))
        return super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout, train_config=train_config,
                             evaluate_config=evaluate_config, evaluate_fn=wrapped)

    def _round_metrics(self, stats):
        return {"fedexp-eta": float(stats.eta), "fedexp-mean-sq-norm": float(stats.mean_sq_norm),
                "fedexp-avg-sq-norm": float(stats.avg_sq_norm)}


class FedExP(_FedExPFamily):
    """FedExP (Jhunjhunwala et al., ICLR 2023)::

        eta = max(1, sum_i p_i ||delta_i||^2 / (2 (||mean||^2 + eps)));   w <- w + eta mean

    with ``p_i`` the examples-weighted participation. ``eps`` (default 1e-3: the paper's value for CIFAR-10/100
    and CINIC-10; its EMNIST value is 1e-1), ``eps_mode`` (``"paper"``: ``||mean||^2 + eps``; ``"official"``:
    ``M * eps``, the official code's convention, in which the paper's tabled values were run -- pass it to
    reproduce them), ``eps_decay``, ``exact_projection``: as :class:`fastagg.server.FedExP`.
    """

    def __init__(self, *args, eps: float = 1e-3, eps_mode: str = "paper", eps_decay: float = 1.0,
                 exact_projection: bool = False, backend: str = "auto", on_nonfinite: str = "raise",
                 buffers: str = "average", **kwargs):
        self.eps, self.eps_mode, self.eps_decay, self.exact_projection = eps, eps_mode, eps_decay, exact_projection
        super().__init__(*args, backend=backend, on_nonfinite=on_nonfinite, buffers=buffers, **kwargs)

    def _optimizer(self, p):
        return server.FedExP(p, eps=self.eps, eps_mode=self.eps_mode, eps_decay=self.eps_decay,
                             exact_projection=self.exact_projection, **self._opt_kw())


class FedExPM(_FedExPFamily):
    """FedExP with server momentum (paper 000, App. F): ``v <- mean + beta v``, FedExP's step size on ``v``.
    ``eps`` (default 1e-3, FedExP's), ``beta`` (default 0.9, the official code's), ``eps_mode``, ``eps_decay``: as
    :class:`fastagg.server.FedExPM`.
    """

    def __init__(self, *args, eps: float = 1e-3, beta: float = 0.9, eps_mode: str = "paper",
                 eps_decay: float = 1.0, backend: str = "auto", on_nonfinite: str = "raise",
                 buffers: str = "average", **kwargs):
        self.eps, self.beta, self.eps_mode, self.eps_decay = eps, beta, eps_mode, eps_decay
        super().__init__(*args, backend=backend, on_nonfinite=on_nonfinite, buffers=buffers, **kwargs)

    def _optimizer(self, p):
        return server.FedExPM(p, eps=self.eps, beta=self.beta, eps_mode=self.eps_mode, eps_decay=self.eps_decay,
                              **self._opt_kw())


class FedACG(_Fastagg, _FlFedAvg):
    """FedACG (Kim et al., CVPR 2024): the server sends the look-ahead ``b = w + lam m`` and steps
    ``m <- lam m + mean;  w <- w + m`` with updates measured from ``b``. ``configure_train`` sends ``b`` and puts
    ``proximal-mu`` (the clients' ``(beta/2) ||theta - b||^2`` coefficient; default 0.001, the paper's CIFAR value)
    in the config: the key Flower's FedProx clients already read. The model returned, evaluated and kept in
    ``Result.arrays`` is ``w``. ``lam`` default 0.85."""

    def __init__(self, *args, lam: float = 0.85, proximal_mu: float = 0.001, backend: str = "auto",
                 on_nonfinite: str = "raise", buffers: str = "average", **kwargs):
        self.lam = lam
        if isinstance(proximal_mu, bool) or not isinstance(proximal_mu, (int, float)) or not proximal_mu >= 0 \
                or not math.isfinite(proximal_mu):
            raise ValueError(f"proximal_mu must be a finite number >= 0, got {proximal_mu!r}")
        self.proximal_mu = float(proximal_mu)
        _FlFedAvg.__init__(self, *args, **kwargs)
        self._init_fastagg(backend, on_nonfinite, buffers)

    def _optimizer(self, p):
        return server.FedACG(p, lam=self.lam, **self._opt_kw())

    def _train_model(self):
        b = self.optimizer.broadcast()  # the look-ahead params (a buffer the step rewrites after aggregation)
        return {k: b.get(k, v) for k, v in self.global_model.items()}

    def _train_config(self, config):
        config["proximal-mu"] = self.proximal_mu


for _cls in (FedExP, FedExPM):
    _cls.__doc__ += "\n    " + _FedExPFamily.__doc__
for _cls in (FedExP, FedExPM, FedACG):
    _cls.__doc__ += _COMMON.format(flower="FedAvg")
FedAMS.__doc__ += _COMMON.format(flower="FedOpt")
del _cls


class QFedAvg(_Fastagg, _FlQFedAvg):
    """q-FedAvg (Li et al., ICLR 2020; Flower's ``QFedAvg``, its arguments ``client_learning_rate``, ``q`` and
    ``train_loss_key``): each reply's update weighed by its training loss to the power ``q`` and the step scaled
    by ``L sum F_i^q / sum h_i`` (:class:`fastagg.server.QFedAvg`), in one read of the replies. A reply without a
    finite training loss >= 0 under ``train_loss_key`` is a bad reply (refused, or left out with
    ``on_nonfinite="skip"``); Flower raises on a missing one. The model keeps its dtypes (Flower's returns float64
    arrays for a float32 model).""" + _COMMON.format(flower="QFedAvg")

    def __init__(self, *args, backend: str = "auto", on_nonfinite: str = "raise", buffers: str = "average",
                 **kwargs):
        _FlQFedAvg.__init__(self, *args, **kwargs)
        self._init_fastagg(backend, on_nonfinite, buffers)

    def _optimizer(self, p):
        return server.QFedAvg(p, client_learning_rate=self.client_learning_rate, q=self.q, **self._opt_kw())

    def _read(self, msg: Message) -> tuple[dict, float]:
        views, weight = super()._read(msg)
        loss = next(iter(msg.content.metric_records.values())).get(self.train_loss_key)
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss) or loss < 0:
            raise ReplyError(f"has {self.train_loss_key!r} = {loss!r:.60}; q-FedAvg needs the client's training loss, a "
                             "finite number >= 0")
        return views, weight

    def _read_compressed(self, record, where):
        raise ReplyError("is compressed; QFedAvg reads full models (its q-weights need each client's update with "
                         "its loss), so compressed replies are not supported by it")

    def _optimizer_step(self, usable: list, weights) -> server.StepStats:
        losses = [float(next(iter(m.content.metric_records.values()))[self.train_loss_key]) for m, _, _ in usable]
        return self.optimizer.step([v for _, v, _ in usable], losses, base=self._sent)
