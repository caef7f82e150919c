"""fastagg.flower.FedBuff's server loop against a scripted Grid (no Ray, no network): nodes that connect late,
``min_available_nodes``, ``concurrency``, replies left out, and the model against an AsyncServer fed the same
replies in the same order."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fastagg import server
from fastagg.asynchronous import AsyncServer, Constant
from fastagg.flower.asynchronous import FedBuff

# flwr 1.42: Message() outside a running task raises "TaskIdentity.run_id is not set" (private API, test-only)
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


class ScriptedGrid:
    """A Grid whose nodes ``connect`` after a number of ``get_node_ids``/``pull_messages`` calls and answer a train
    message ``delay[node]`` pulls after it was pushed, with ``client(node, sent arrays, message)``."""

    def __init__(self, client, delay, connect=None):
        self.client, self.delay = client, delay
        self.connect = connect or {n: 0 for n in delay}  # node -> the tick it connects at
        self.ticks = 0
        self.pending: dict[str, list] = {}  # message id -> [message, pulls left]
        self.ids = (f"m{i}" for i in itertools.count())
        self.pushed: list = []  # (node, server-version) of every message pushed
        self.max_in_flight = 0
        self.received: list = []  # (node, version trained from, reply arrays) in the order pulled

    def get_node_ids(self):
        self.ticks += 1
        return [n for n, t in self.connect.items() if self.ticks >= t]

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            mid = next(self.ids)
            msg.metadata.__dict__["_message_id"] = mid  # what the SuperLink does on push
            self.pending[mid] = [msg, self.delay[msg.metadata.dst_node_id]]
            self.pushed.append((msg.metadata.dst_node_id, int(msg.content["config"]["server-version"])))
            ids.append(mid)
        self.max_in_flight = max(self.max_in_flight, len(self.pending))
        return ids

    def pull_messages(self, message_ids):
        self.ticks += 1
        out = []
        for mid in list(message_ids):
            entry = self.pending.get(mid)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                msg = self.pending.pop(mid)[0]
                node = msg.metadata.dst_node_id
                sent = {k: a.numpy() for k, a in msg.content["arrays"].items()}
                reply = self.client(node, sent, msg)
                if not reply.has_error():
                    self.received.append((node, int(msg.content["config"]["server-version"]),
                                          {k: a.numpy().copy() for k, a in reply.content["arrays"].items()}))
                out.append(reply)
        return out


def train(node, sent, msg, n=10):
    """A client: the model it was sent plus a node-specific step."""
    new = {k: (v + np.float32(0.01 * node) - np.float32(0.1) * v).astype(np.float32) for k, v in sent.items()}
    return Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in new.items()}),
                               "metrics": MetricRecord({"num-examples": n})}), reply_to=msg)


START = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.float32)}


def start_arrays():
    return ArrayRecord({k: Array(v.copy()) for k, v in START.items()})


def run(grid, num_steps, **kw):
    kw = {"optimizer": "fedavgm", "optimizer_kwargs": {"lr": 1.0, "momentum": 0.5}, "buffer_size": 2,
          "pull_interval": 1e-4, "node_poll_interval": 1e-4, **kw}
    return FedBuff(**kw).start(grid, start_arrays(), num_steps=num_steps, timeout=30)


def test_a_node_that_connects_late_is_sent_work_and_its_updates_are_folded():
    grid = ScriptedGrid(train, delay={1: 2, 2: 3, 3: 1}, connect={1: 0, 2: 0, 3: 25})
    result = run(grid, num_steps=20)
    assert result.version == 20 and not result.left_out
    assert result.updates_per_node[3] > 0  # joined after start and carried part of the run
    assert sum(result.updates_per_node.values()) == 40


def test_start_waits_for_min_available_nodes_as_flower_strategies_do():
    grid = ScriptedGrid(train, delay={1: 1, 2: 1, 3: 1}, connect={1: 0, 2: 5, 3: 9})
    result = run(grid, num_steps=3, min_available_nodes=3)
    first = {node for node, _ in grid.pushed[:3]}
    assert first == {1, 2, 3}  # the first model went to all three at once
    assert result.version == 3


def test_too_few_nodes_before_the_timeout_is_an_error_naming_min_available_nodes():
    grid = ScriptedGrid(train, delay={1: 1}, connect={1: 0})
    with pytest.raises(TimeoutError, match="min_available_nodes=2"):
        FedBuff(buffer_size=2).start(grid, start_arrays(), num_steps=2, timeout=0.3)
    assert grid.pushed == []


def test_concurrency_caps_the_nodes_training_at_once_even_as_nodes_connect():
    grid = ScriptedGrid(train, delay={n: n for n in range(1, 7)}, connect={n: 3 * n for n in range(1, 7)})
    result = run(grid, num_steps=10, concurrency=3, min_available_nodes=1)
    assert result.version == 10
    assert grid.max_in_flight <= 3


@pytest.mark.parametrize("normalize", ["weights", "flsim"])
def test_bad_replies_are_left_out_and_the_model_matches_an_async_server_fed_the_good_ones(normalize):
    def client(node, sent, msg):
        if node == 4:
            return Message(Error(code=0, reason="the node crashed"), reply_to=msg)
        if node == 5:
            return train(node, {k: np.full_like(v, np.nan) for k, v in sent.items()}, msg)
        if node == 6:
            return train(node, {"w": sent["w"][:2], "b": sent["b"]}, msg)
        return train(node, sent, msg, n=10 * node)

    grid = ScriptedGrid(client, delay={1: 1, 2: 2, 3: 3, 4: 2, 5: 1, 6: 4})
    lr = 1.0 if normalize == "weights" else 0.02  # (FLSim's sum of weights 10-30 times the updates: its lr / K)
    result = run(grid, num_steps=8, staleness=Constant(), optimizer="fedavg", optimizer_kwargs={"lr": lr},
                 normalize=normalize)
    assert result.version == 8
    reasons = {node: why for node, why in result.left_out}
    assert "the node crashed" in reasons[4] and "NaN" in reasons[5] and "shapes" in reasons[6]
    assert {n for n, c in result.updates_per_node.items() if c} <= {1, 2, 3}

    # the oracle: the same replies, folded in the order pulled, until the 8th step
    params = {k: torch.from_numpy(v.astype(np.float64)) for k, v in START.items()}
    oracle = AsyncServer(server.FedAvg(params, lr=lr, backend="reference"), buffer_size=2, staleness=Constant(),
                         normalize=normalize)
    bases = {0: {k: t.clone() for k, t in params.items()}}
    for node, v, arrays in grid.received:
        if oracle.version == 8:
            break
        if node in (5, 6):
            continue
        oracle.submit({k: torch.from_numpy(a.astype(np.float64)) for k, a in arrays.items()}, v,
                      weight=10.0 * node, base=bases[v])
        bases.setdefault(oracle.version, {k: t.clone() for k, t in params.items()})
    got = {k: a.numpy() for k, a in result.arrays.items()}
    for k in START:
        np.testing.assert_allclose(got[k], params[k].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [({"min_available_nodes": 0}, "min_available_nodes"),
                                           ({"min_available_nodes": True}, "min_available_nodes"),
                                           ({"node_poll_interval": 0}, "node_poll_interval"),
                                           ({"pull_interval": float("nan")}, "pull_interval"),
                                           ({"concurrency": 0}, "concurrency")])
def test_bad_loop_settings_are_refused_naming_the_setting(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedBuff(**kwargs)


def test_compressed_replies_fold_where_they_lie():
    """Nodes behind fastagg's compress_mod send int8 updates; FedBuff folds them as they arrive. Against the same
    run with the full models each compressed reply stands for (sent + the dequantized update): the same model."""
    from flwr.app import Context

    from fastagg.compress import dequantize
    from fastagg.flower import compress_mod, read_compressed

    mod = compress_mod("int8:block=4")
    stood_for = []

    def compressed(node, sent, msg):
        ctx = Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})
        out = mod(msg, ctx, lambda m, c: train(node, sent, m))
        update, _ = read_compressed(out.content["arrays"])
        flat = dequantize(update).numpy()
        stood_for.append({"w": (sent["w"].astype(np.float64) + flat[:12].reshape(3, 4)).astype(np.float32),
                          "b": (sent["b"].astype(np.float64) + flat[12:]).astype(np.float32)})
        return out

    delays = {1: 1, 2: 2, 3: 3}
    got = run(ScriptedGrid(compressed, delays), num_steps=6, staleness=Constant())
    assert got.version == 6 and not got.left_out
    replay = iter(stood_for)

    def replayed(node, sent, msg):  # the same pull order as the compressed run: the same replies, as full models
        arrays = ArrayRecord({k: Array(v) for k, v in next(replay).items()})
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)

    want = run(ScriptedGrid(replayed, delays), num_steps=6, staleness=Constant())
    for k in START:
        np.testing.assert_allclose(got.arrays[k].numpy(), want.arrays[k].numpy(), rtol=1e-5, atol=1e-6)


def test_a_reply_without_its_weight_or_with_a_metric_of_another_kind_is_left_out_naming_the_node(caplog):
    """Node 4 replies without the weight key, node 5 with its loss a list where the others send a number, node 6
    with a negative weight: each reply is left out (nothing of it folded) with a reason naming the node, in the
    result and in the log, and the run goes on with the others to its last step, each step's train metrics
    aggregated from the good replies (Flower's aggregation raised on the mixed ones and ended start())."""
    import logging

    def client(node, sent, msg):
        reply = train(node, sent, msg)
        metrics = {"num-examples": 10, "loss": 0.5 * node}
        if node == 4:
            del metrics["num-examples"]
        elif node == 5:
            metrics["loss"] = [1.0, 2.0]
        elif node == 6:
            metrics["num-examples"] = -3
        return Message(RecordDict({"arrays": reply.content["arrays"], "metrics": MetricRecord(metrics)}),
                       reply_to=msg)

    grid = ScriptedGrid(client, delay={1: 1, 2: 2, 3: 1, 4: 1, 5: 2, 6: 1})
    with caplog.at_level(logging.WARNING):
        result = run(grid, num_steps=6, staleness=Constant())
    assert result.version == 6
    reasons = {node: why for node, why in result.left_out}
    assert set(reasons) == {4, 5, 6}
    assert "'num-examples'" in reasons[4] and "'loss'" in reasons[5] and "'num-examples'" in reasons[6]
    assert {n for n, c in result.updates_per_node.items() if c} == {1, 2, 3}
    assert sum(result.updates_per_node.values()) == 12  # 6 steps of 2: only good replies
    for node in (4, 5, 6):
        assert any(f"node {node} " in r.getMessage() for r in caplog.records), node
    for version, metrics in result.train_metrics.items():
        assert 0.5 <= metrics["loss"] <= 1.5, (version, metrics)  # the mean of nodes 1-3's losses only


def test_a_train_metrics_aggregation_that_raises_costs_only_the_metrics():
    def broken(contents, key):
        raise RuntimeError("the user's aggregation broke")

    result = run(ScriptedGrid(train, delay={1: 1, 2: 2}), num_steps=3, train_metrics_aggr_fn=broken)
    assert result.version == 3 and not result.left_out and sum(result.updates_per_node.values()) == 6
    assert set(result.train_metrics) == {1, 2, 3} and all(len(m) == 0 for m in result.train_metrics.values())


def test_every_name_the_async_docs_and_example_give_imports():
    """What docs/ASYNC.md, the async example and the module's docs name as ``fastagg.flower.X`` or import with
    ``from fastagg.flower[.asynchronous] import X`` exists there (the example named fastagg.flower.FedBuff, which
    fastagg.flower did not export)."""
    import importlib
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    texts = [p.read_text() for p in [root / "docs" / "ASYNC.md", root / "fastagg" / "flower" / "asynchronous.py",
                                     *sorted((root / "examples" / "flower_async").glob("*.*"))] if p.suffix in
             (".md", ".py")]
    named = set()
    for text in texts:
        for sub, name in re.findall(r"fastagg\.flower(\.asynchronous)?\.([A-Z]\w+)", text):
            named.add(("fastagg.flower" + sub, name))
        for mod, names in re.findall(r"from (fastagg\.flower(?:\.asynchronous)?) import ([\w, ]+)", text):
            named |= {(mod, n.strip()) for n in names.split(",") if n.strip()}
    assert ("fastagg.flower", "FedBuff") in named  # (the regexes read the docs: not a test that cannot fail)
    missing = [f"{mod}.{name}" for mod, name in sorted(named) if not hasattr(importlib.import_module(mod), name)]
    assert not missing, missing
    import fastagg.flower
    assert fastagg.flower.FedBuff is FedBuff and "FedBuff" in fastagg.flower.__all__


def test_a_server_step_that_fails_keeps_its_buffer_and_the_run_goes_on(caplog):
    """The optimizer's second step raises once: the reply that completed the buffer stays folded (counted, not
    left out), the failure is logged, the buffer steps with the next reply (which goes into the next buffer), and
    the run reaches its last step with every reply folded once: with constant staleness the model equals an
    AsyncServer's whose optimizer never failed, fed the same replies in the same order."""
    import logging

    class Flaky(server.FedAvg):
        calls = 0

        def step(self, *args, **kwargs):
            Flaky.calls += 1
            if Flaky.calls == 2:
                raise RuntimeError("the optimizer failed once")
            return super().step(*args, **kwargs)

    with caplog.at_level(logging.WARNING):
        grid = ScriptedGrid(train, delay={1: 1, 2: 2})
        result = run(grid, num_steps=4, optimizer=lambda p: Flaky(p, lr=1.0, on_nonfinite="skip"),
                     staleness=Constant())
    assert Flaky.calls == 5 and result.version == 4 and not result.left_out
    assert any("optimizer failed once" in r.getMessage() for r in caplog.records)
    folded = sum(result.updates_per_node.values())
    assert folded == 8  # 4 buffers of 2; the 5th reply stepped the 2nd buffer and went into the 3rd
    params = {k: torch.from_numpy(v.astype(np.float64)) for k, v in START.items()}
    oracle = AsyncServer(server.FedAvg(params, lr=1.0, backend="reference"), buffer_size=2, staleness=Constant())
    bases = {0: {k: t.clone() for k, t in params.items()}}
    for node, v, arrays in grid.received[:folded]:
        oracle.submit({k: torch.from_numpy(a.astype(np.float64)) for k, a in arrays.items()}, v, weight=10.0,
                      base=bases[v])
        bases.setdefault(oracle.version, {k: t.clone() for k, t in params.items()})
    assert oracle.version == 4
    for k in START:
        np.testing.assert_allclose(result.arrays[k].numpy(), params[k].numpy(), rtol=1e-5, atol=1e-6)


def test_a_node_replying_zero_examples_cannot_stop_the_run(caplog):
    """FedAsync (buffer_size 1): node 1 replies num-examples = 0 every time, a buffer of total weight 0. Each such
    buffer is discarded without a step (logged, listed in result.discarded, the reply counted as folded, not left
    out), and the honest nodes' replies step the run to its end: the model equals an AsyncServer's fed only the honest
    replies in the same order (the discards moved no version, so their staleness is the same). Before, the first
    such reply jammed the server and the run spent its whole timeout at version 0."""
    import logging

    with caplog.at_level(logging.WARNING):
        grid = ScriptedGrid(lambda node, sent, msg: train(node, sent, msg, n=0 if node == 1 else 10),
                            delay={1: 1, 2: 2, 3: 3})
        result = run(grid, num_steps=5, buffer_size=1, optimizer="fedavg", optimizer_kwargs={"lr": 1.0})
    assert result.version == 5 and not result.left_out
    zero = [r for r in grid.received if r[0] == 1]
    assert zero and len(result.discarded) == result.updates_per_node[1] >= 1
    assert all(n == 1 and "weight is 0" in why for _, n, why in result.discarded)
    assert any("discarded" in r.getMessage() for r in caplog.records)
    params = {k: torch.from_numpy(v.astype(np.float64)) for k, v in START.items()}
    oracle = AsyncServer(server.FedAvg(params, lr=1.0, backend="reference"), buffer_size=1)
    bases = {0: {k: t.clone() for k, t in params.items()}}
    for node, v, arrays in grid.received:
        if node == 1 or oracle.version == 5:
            continue
        oracle.submit({k: torch.from_numpy(a.astype(np.float64)) for k, a in arrays.items()}, v, weight=10.0,
                      base=bases[v])
        bases.setdefault(oracle.version, {k: t.clone() for k, t in params.items()})
    assert oracle.version == 5
    for k in START:
        np.testing.assert_allclose(result.arrays[k].numpy(), params[k].numpy(), rtol=1e-5, atol=1e-6)
