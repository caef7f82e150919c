"""An asynchronous Flower server loop: FedBuff / FedAsync (:mod:`fastagg.asynchronous`) on Flower's message API.

A ServerApp's main runs ``FedBuff(...).start(grid, initial_arrays, num_steps)``: train messages go to
``concurrency`` nodes at once; replies are pulled as they come (``grid.pull_messages``, no round barrier), each is
folded into the current buffer the moment it arrives (its update against the model that node was sent, formed
inside the stats pass; the reply read in place), the server optimizer steps every ``buffer_size`` updates, and the
node that just replied gets the newest model at once. A fast node never waits for a slow one. The node's train
config carries ``server-version`` (the version it trains from). As Flower's strategies do, ``start`` first waits
for ``min_available_nodes`` to connect; a node that connects later is sent the newest model within
``node_poll_interval`` seconds (up to ``concurrency`` nodes train at once). ClientApps are Flower's usual ones: they train
from the arrays they receive and reply with their arrays and a MetricRecord (``weighted_by_key``: the weight).

A reply that is a Flower error, holds NaN/Inf, has other keys or shapes, lacks the ``weighted_by_key`` metric or
carries it as anything but a finite number >= 0, has a metric of another kind (a number, or a list of one length)
than the replies folded before it had for the same key (Flower's metric aggregation would raise on them), or is
staler than ``max_staleness`` is left out and logged with the node's id (the node is sent the newest model again;
the run goes on with the others). Each message's reply is folded at most once. No reply can stop the run: a buffer
whose total weight is 0 when it is due (its nodes all sent ``weighted_by_key`` 0) or whose numbers the optimizer
refuses (its step overflows) is discarded without a step (logged, listed in ``AsyncResult.discarded``; the version
stays, the run goes on), and a weight above 0 but too small to normalise by is left out. Any other server step that
raises keeps its buffer (logged); it steps again with the next reply. A ``train_metrics_aggr_fn`` that
still raises loses only that step's train metrics (logged), not the run.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore import log

from .. import server
from .._checks import check_int
from ..asynchronous import AsyncServer, Polynomial, StaleUpdate, StepError
from .compressed import is_compressed_record, read_compressed
from .records import ReplyError, record_views, reply_weight, to_record
from .strategies import _metric_kind

__all__ = ["FedBuff", "AsyncResult"]

OPTIMIZERS = {"fedavg": server.FedAvg, "fedavgm": server.FedAvgM, "fedadam": server.FedAdam,
              "fedyogi": server.FedYogi, "fedadagrad": server.FedAdagrad, "fedexp": server.FedExP}


@dataclasses.dataclass
class AsyncResult:
    """What :meth:`FedBuff.start` returns: the final ``arrays``, the server ``version`` reached, the updates folded
    per node, each step's aggregated train metrics (``train_metrics[version]``), the staleness of every folded
    update, the replies left out (node, why), and the buffers discarded instead of stepped (version, updates,
    why: :attr:`fastagg.asynchronous.AsyncServer.discarded`; their replies count as folded)."""

    arrays: ArrayRecord
    version: int
    updates_per_node: dict
    train_metrics: dict
    staleness: list
    left_out: list
    discarded: list = dataclasses.field(default_factory=list)


class FedBuff:
    """FedBuff (``buffer_size`` K > 1, server momentum or an adaptive optimizer) or FedAsync (``buffer_size=1``,
    ``optimizer="fedavg"`` with ``optimizer_kwargs={"lr": alpha}``) over a Flower Grid.

    Args:
        optimizer: ``"fedavg"``, ``"fedavgm"``, ``"fedadam"``, ``"fedyogi"``, ``"fedadagrad"``, ``"fedexp"`` or a
            callable ``params -> fastagg.server optimizer``; ``optimizer_kwargs`` its hyperparameters.
        buffer_size, staleness, max_staleness, normalize: as :class:`fastagg.asynchronous.AsyncServer`
            (``normalize="flsim"``: FLSim's un-normalised sum; docs/ASYNC.md).
        concurrency: nodes training at once (default: every connected node, including those that connect later).
        min_available_nodes: nodes ``start`` waits for before sending the first model (Flower's name and default).
        node_poll_interval: seconds between looks for newly connected nodes while below ``concurrency``.
        weighted_by_key, arrayrecord_key, configrecord_key, train_metrics_aggr_fn: Flower's names and defaults.
        pull_interval: seconds between pulls when no reply is waiting.
    """

    def __init__(self, optimizer: str | Callable = "fedavg", *, optimizer_kwargs: dict | None = None,
                 buffer_size: int = 10, staleness=None, max_staleness: int | None = None,
                 concurrency: int | None = None, min_available_nodes: int = 2, node_poll_interval: float = 1.0,
                 weighted_by_key: str = "num-examples", arrayrecord_key: str = "arrays",
                 configrecord_key: str = "config", train_metrics_aggr_fn: Callable | None = None,
                 pull_interval: float = 0.01, backend: str = "auto", normalize: str = "weights"):
        if isinstance(optimizer, str):
            if optimizer not in OPTIMIZERS:
                raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)} or a callable, got {optimizer!r}")
            cls, kw = OPTIMIZERS[optimizer], dict(optimizer_kwargs or {})
            self._make = lambda params: cls(params, backend=backend, on_nonfinite="skip", **kw)
        elif callable(optimizer):
            self._make = optimizer
        else:
            raise TypeError(f"optimizer must be a name or a callable, got {type(optimizer).__name__}")
        self._make(torch.zeros(1))  # the hyperparameters are checked now, not at the first reply
        AsyncServer(server.FedAvg(torch.zeros(1)), buffer_size=buffer_size, staleness=staleness,
                    max_staleness=max_staleness, normalize=normalize)  # (checks these)
        if concurrency is not None:
            concurrency = check_int(concurrency, "concurrency", minimum=1)
        min_available_nodes = check_int(min_available_nodes, "min_available_nodes", minimum=1)
        for name, value in (("node_poll_interval", node_poll_interval), ("pull_interval", pull_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.buffer_size, self.staleness = buffer_size, staleness if staleness is not None else Polynomial(0.5)
        self.max_staleness, self.concurrency = max_staleness, concurrency
        self.min_available_nodes, self.node_poll_interval = min_available_nodes, node_poll_interval
        self.weighted_by_key, self.arrayrecord_key, self.configrecord_key = weighted_by_key, arrayrecord_key, \
            configrecord_key
        self.train_metrics_aggr_fn = train_metrics_aggr_fn or aggregate_metricrecords
        self.pull_interval, self.normalize = pull_interval, normalize

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_steps: int, *,
              train_config: ConfigRecord | None = None, timeout: float = 3600.0) -> AsyncResult:
        """Run until the server has taken ``num_steps`` steps (or ``timeout`` seconds pass); returns the
        :class:`AsyncResult`."""
        num_steps = check_int(num_steps, "num_steps", minimum=1)
        params = {k: torch.from_numpy(np.array(v)) for k, v in record_views(initial_arrays, "initial_arrays").items()}
        srv = AsyncServer(self._make(params), buffer_size=self.buffer_size, staleness=self.staleness,
                          max_staleness=self.max_staleness, on_nonfinite="skip", normalize=self.normalize)
        deadline = time.monotonic() + timeout
        nodes = self._wait_for_nodes(grid, deadline)
        sent: dict[int, list] = {}  # version -> [ArrayRecord sent, its tensors, messages in flight]
        in_flight: dict[str, tuple] = {}  # message id -> (node, version)
        result = AsyncResult(initial_arrays, 0, {}, {}, [], [])
        contents: list = []  # the replies folded since the last step (their train metrics)
        kinds: dict = {}  # metric key -> its kind in the replies folded so far (a number, or a list of one length)
        config = dict(train_config or {})

        def send(node: int) -> None:
            v = srv.version
            if v not in sent:
                sent[v] = [to_record(params), {k: t.clone() for k, t in params.items()}, 0]
            entry = sent[v]
            msg = Message(content=RecordDict({self.arrayrecord_key: entry[0],
                                              self.configrecord_key: ConfigRecord({**config, "server-version": v})}),
                          dst_node_id=node, message_type=MessageType.TRAIN)
            for mid in grid.push_messages([msg]):
                in_flight[mid] = (node, v)
                entry[2] += 1

        def release(v: int) -> None:
            sent[v][2] -= 1
            if sent[v][2] == 0 and v != srv.version:
                del sent[v]  # no message of that version in flight any more: its base copy goes

        def send_to_idle(connected: list) -> None:
            """Send the newest model to connected nodes with nothing in flight, up to ``concurrency`` busy."""
            busy = {node for node, _ in in_flight.values()}
            for node in connected:
                if self.concurrency is not None and len(busy) >= self.concurrency:
                    break
                if node not in busy:
                    result.updates_per_node.setdefault(node, 0)
                    send(node)
                    busy.add(node)

        send_to_idle(nodes)
        next_poll = time.monotonic() + self.node_poll_interval
        while srv.version < num_steps and time.monotonic() < deadline:
            if time.monotonic() >= next_poll:
                if self.concurrency is None or len(in_flight) < self.concurrency:
                    send_to_idle(list(grid.get_node_ids()))
                next_poll = time.monotonic() + self.node_poll_interval
            replies = list(grid.pull_messages(list(in_flight)))
            if not replies:
                time.sleep(self.pull_interval)
                continue
            for reply in replies:
                if srv.version >= num_steps:
                    break  # the run is over: the rest of this pull is not folded (no step would take it)
                node, v = in_flight.pop(reply.metadata.reply_to_message_id)
                discards = len(srv.discarded)
                why = self._fold(srv, reply, v, sent[v][1], node, result, contents, kinds)
                release(v)
                for entry in srv.discarded[discards:]:
                    result.discarded.append(entry)
                    log(WARNING, "fastagg FedBuff: a buffer of %d update(s) was discarded at version %d, no step: %s",
                        entry[1], entry[0], entry[2])
                    contents = []  # (one buffer is open at a time here: the replies since the last step were its)
                if why is not None:
                    result.left_out.append((node, why))
                    log(WARNING, "fastagg FedBuff: the reply of node %d left out: %s", node, why)
                elif srv.version > result.version:
                    result.version = srv.version
                    for old in [k for k, e in sent.items() if e[2] == 0 and k != srv.version]:
                        del sent[old]  # a base no message in flight needs any more
                    if contents:
                        result.train_metrics[srv.version] = self._metrics(contents, srv.version)
                    contents = []
                    log(INFO, "fastagg FedBuff: version %d (%d updates folded so far)", srv.version,
                        sum(result.updates_per_node.values()))
                if srv.version < num_steps:
                    send(node)
        if srv.version < num_steps:
            log(WARNING, "fastagg FedBuff: stopped after %.0f s at version %d of %d", timeout, srv.version, num_steps)
        result.arrays = to_record(params)
        return result

    def _wait_for_nodes(self, grid: Grid, deadline: float) -> list:
        """Wait (as Flower's ``sample_nodes`` does) until ``min_available_nodes`` are connected; returns them."""
        last_log = 0.0
        while len(nodes := list(grid.get_node_ids())) < self.min_available_nodes:
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"fastagg FedBuff: {len(nodes)} node(s) connected before the timeout, "
                                   f"min_available_nodes={self.min_available_nodes}")
            if now - last_log >= 10.0:
                log(INFO, "Waiting for nodes to connect: %d connected (minimum required: %d).", len(nodes),
                    self.min_available_nodes)
                last_log = now
            time.sleep(min(0.1, deadline - now))
        return nodes

    def _metrics(self, contents: list, version: int):
        """The step's aggregated train metrics; a ``train_metrics_aggr_fn`` that raises costs only these."""
        try:
            return self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        except Exception as e:  # noqa: BLE001 (whatever the user's aggregation raises; the step is taken)
            log(WARNING, "fastagg FedBuff: the train metrics of version %d could not be aggregated: %r", version, e)
            return MetricRecord()

    def _weight(self, metrics: MetricRecord) -> float:
        """The reply's weight (its ``weighted_by_key`` metric); ReplyError when missing or not a number >= 0."""
        return reply_weight(metrics, self.weighted_by_key)

    def _fold(self, srv: AsyncServer, reply: Message, v: int, base: dict, node: int, result: AsyncResult,
              contents: list, kinds: dict) -> str | None:
        """Fold one reply; returns why it was left out, or None. Everything of the reply is checked before the
        fold (a folded update cannot be taken out)."""
        if reply.has_error():
            return f"a Flower error ({reply.error.reason})"
        try:
            records = reply.content.array_records
            if len(records) != 1 or len(reply.content.metric_records) != 1:
                raise ReplyError("expected one ArrayRecord and one MetricRecord")
            record = next(iter(records.values()))
            metrics = next(iter(reply.content.metric_records.values()))
            weight = self._weight(metrics)
            clash = next((k for k, m in metrics.items() if k in kinds and kinds[k] != _metric_kind(m)), None)
            if clash is not None:
                raise ReplyError(f"has metric {clash!r} of another kind than the replies folded before "
                                 f"({_metric_kind(metrics[clash])[0]} vs {kinds[clash][0]})")
            if is_compressed_record(record):  # compress_mod's update: folded where it lies (no buffers to average)
                update, bufs = read_compressed(record, "the reply's ArrayRecord")
                if bufs:
                    raise ReplyError("is compressed and carries buffers; FedBuff folds compressed replies of models "
                                     "without buffers")
                res = self._submit(srv, update, v, weight=weight,
                                   client_id=(node, reply.metadata.reply_to_message_id))
                return self._counted(res, node, result, contents, reply, metrics, kinds)
            views = record_views(record, "the reply's ArrayRecord")
            if set(views) != set(base) or any(tuple(views[k].shape) != tuple(base[k].shape) for k in base):
                raise ReplyError("has other keys or shapes than the model sent")
            views = {k: views[k] for k in base}
            res = self._submit(srv, views, v, weight=weight, base=base,
                             client_id=(node, reply.metadata.reply_to_message_id))
        except (StaleUpdate, ValueError, TypeError) as e:
            return str(e)
        return self._counted(res, node, result, contents, reply, metrics, kinds)

    @staticmethod
    def _submit(srv: AsyncServer, update, v: int, **kw):
        """``srv.submit``; a server step that fails after the fold keeps the reply folded (the buffer steps with
        the next reply) and is logged."""
        try:
            return srv.submit(update, v, **kw)
        except StepError as e:
            log(WARNING, "fastagg FedBuff: the server step failed (%r); its buffer is kept and steps with the next "
                "reply", e.__cause__)
            return e.result

    @staticmethod
    def _counted(res, node: int, result: AsyncResult, contents: list, reply: Message, metrics: MetricRecord,
                 kinds: dict) -> str | None:
        if not res.folded:
            return "holds NaN or Inf"
        for k, m in metrics.items():
            kinds.setdefault(k, _metric_kind(m))
        result.updates_per_node[node] = result.updates_per_node.get(node, 0) + 1
        result.staleness.append(res.staleness)
        contents.append(reply.content)
        return None
