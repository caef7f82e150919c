"""fastagg.flower without an engine: hand-made reply Messages through configure_train / aggregate_train / start.

Equality with Flower 1.42's own message-API strategies (same replies, 5 rounds, 3-5 nodes with different
num-examples): float32 models agree to rtol 1e-5 and atol 1e-6 for FedAvg / FedAvgM, atol 1e-4 for the adaptive
rules (steps of 0.01-0.1 here). fastagg forms the update as sum_i p_i (w_i - w), exact in float32 for nearby
models; Flower forms sum_i p_i w_i - w, which loses the low bits of small updates, and the adaptive rules divide
by sqrt(v) + tau, so one element with a tiny update can differ by ~1e-5 (see the float64 oracle test below: fastagg
is the closer one). FedExP, FedExP-M and FedACG are checked against float64 oracles written out here.
"""
from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
import torch

# flwr is a test requirement (pyproject's [test] extra, installed by `make test`): a missing one fails here
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import strategy as fl
from flwr.serverapp.exception import AggregationError
from flwr.supercore.task_identity import TaskIdentity

from fastagg import server
from fastagg import flower as fa
from fastagg.testing import assert_close, cpu_backends  # noqa: E402

# flwr 1.42: Message() outside a running task raises "TaskIdentity.run_id is not set" (private API, test-only)
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1

BACKENDS = cpu_backends()
SHAPES = {"conv.weight": (4, 3), "fc.weight": (5, 4), "fc.bias": (5,)}
NODES_PER_ROUND = [3, 5, 4, 3, 5]


class Grid:
    """The part of a Flower Grid that strategies use; ``send_and_receive`` plays the clients for ``start``."""

    def __init__(self, nodes, client=None):
        self.nodes = list(nodes)
        self.client = client

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, timeout=None):
        return [self.client(m) for m in messages]


def rec(arrays):
    """An ArrayRecord of {key: numpy array} (ArrayRecord itself takes a list, a torch state_dict or Arrays)."""
    return arrays if isinstance(arrays, ArrayRecord) else ArrayRecord({k: Array(v) for k, v in arrays.items()})


def reply(msg, arrays, n, **metrics):
    content = RecordDict({"arrays": rec(arrays),
                          "metrics": MetricRecord({"num-examples": n, **metrics})})
    return Message(content=content, reply_to=msg)


def arrays_of(record):
    return {k: a.numpy() for k, a in record.items()}


def initial(seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def train_round(strategy, rnd, arrays, nodes, client):
    """configure_train -> one reply per sampled node (``client(node, sent arrays)``) -> aggregate_train."""
    msgs = sorted(strategy.configure_train(rnd, arrays, ConfigRecord(), Grid(nodes)), key=lambda m: m.metadata.dst_node_id)
    replies = [client(m) for m in msgs]
    return msgs, strategy.aggregate_train(rnd, replies)


def flower_round(strategy, rnd, arrays, nodes, replies):
    """Flower's own ``strategy`` aggregating the very replies fastagg's got (re-addressed to its train messages):
    ``(arrays, metrics)``."""
    msgs = sorted(strategy.configure_train(rnd, arrays, ConfigRecord(), Grid(nodes)), key=lambda x: x.metadata.dst_node_id)
    return strategy.aggregate_train(rnd, [Message(content=r.content, reply_to=f) for r, f in zip(replies, msgs)])


def clients_for_round(rnd, nodes, seed=1):
    """Deterministic client models: sent + a node- and round-specific update; example counts differ per node."""

    def client(msg):
        node = msg.metadata.dst_node_id
        sent = arrays_of(msg.content["arrays"])
        rng = np.random.default_rng(1000 * seed + 10 * rnd + node)
        model = {k: (v + 0.05 * rng.standard_normal(v.shape) + 0.02 * (node % 3 - 1)).astype(v.dtype)
                 for k, v in sent.items()}
        return reply(msg, model, int(7 + 13 * node))
    return client


# -- equality with Flower's own strategies -------------------------------------------------------------------------

CASES = {  # (Flower's, fastagg's, settings, atol)
    "FedAvg": (fl.FedAvg, fa.FedAvg, {}, 1e-6),
    "FedAvgM": (fl.FedAvgM, fa.FedAvgM, dict(server_learning_rate=0.7, server_momentum=0.9), 1e-6),
    "FedAdam": (fl.FedAdam, fa.FedAdam, dict(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3), 1e-4),
    "FedYogi": (fl.FedYogi, fa.FedYogi, dict(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3), 1e-4),
    "FedAdagrad": (fl.FedAdagrad, fa.FedAdagrad, dict(eta=0.1, tau=1e-3), 1e-4),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_same_arrays_as_flowers_strategy_round_after_round(case, backend):
    fl_cls, fa_cls, kw, atol = CASES[case]
    theirs, ours = fl_cls(min_available_nodes=1, **kw), fa_cls(min_available_nodes=1, backend=backend, **kw)
    a_fl = a_fa = rec(initial())
    for rnd, m in enumerate(NODES_PER_ROUND, start=1):
        nodes = list(range(1, m + 1))
        client = clients_for_round(rnd, nodes)
        msgs, (a_fa, metrics) = train_round(ours, rnd, a_fa, nodes, client)
        # Flower gets the very same client models (built from fastagg's model), as its users' clients would send
        replies = [client(msg) for msg in msgs]
        a_fl, fl_metrics = flower_round(theirs, rnd, a_fl, nodes, replies)
        got, want = arrays_of(a_fa), arrays_of(a_fl)
        assert list(got) == list(want)
        for k in got:
            assert got[k].dtype == np.float32, f"{case}: {k} became {got[k].dtype}"
            assert_close(torch.from_numpy(got[k]), torch.from_numpy(want[k]).double(), rtol=1e-5, atol=atol,
                         name=f"{case} {k} after round {rnd}")
        assert dict(metrics) == dict(fl_metrics)


def test_fastagg_is_closer_than_flower_to_a_float64_oracle_on_small_updates():
    """FedAdagrad's first round on updates of ~1e-4 around weights of ~1 (where float32 keeps ~1e-7 absolute): the
    float64 oracle of Flower's own formula, w + eta d / (|d| + tau) with d = sum_i p_i (w_i - w)."""
    eta, tau = 0.1, 1e-3
    w0 = {"w": (1 + np.random.default_rng(0).random(2000)).astype(np.float32)}
    ours, theirs = fa.FedAdagrad(eta=eta, tau=tau, min_available_nodes=1), fl.FedAdagrad(eta=eta, tau=tau,
                                                                                        min_available_nodes=1)
    msgs = sorted(ours.configure_train(1, rec(w0), ConfigRecord(), Grid([1, 2, 3, 4, 5])),
                  key=lambda m: m.metadata.dst_node_id)
    models = [(w0["w"] + 1e-4 * np.random.default_rng(k).standard_normal(2000)).astype(np.float32) for k in range(5)]
    n = np.array([3, 8, 2, 9, 5], np.float64)
    replies = [reply(m, {"w": x}, int(c)) for m, x, c in zip(msgs, models, n)]
    got, _ = ours.aggregate_train(1, replies)
    fl_msgs = sorted(theirs.configure_train(1, rec(w0), ConfigRecord(), Grid([1, 2, 3, 4, 5])),
                     key=lambda m: m.metadata.dst_node_id)
    want, _ = theirs.aggregate_train(1, [Message(content=r.content, reply_to=f) for r, f in zip(replies, fl_msgs)])
    d = (n / n.sum()) @ np.stack([x.astype(np.float64) - w0["w"] for x in models])
    oracle = w0["w"] + eta * d / (np.abs(d) + tau)
    err_ours = np.abs(got["w"].numpy() - oracle).max()
    err_flower = np.abs(want["w"].numpy() - oracle).max()
    assert err_ours <= err_flower and err_ours < 2e-7, (err_ours, err_flower)


def test_fedprox_sends_proximal_mu_and_averages():
    ours, theirs = fa.FedProx(proximal_mu=0.3, min_available_nodes=1), fl.FedProx(proximal_mu=0.3, min_available_nodes=1)
    client = clients_for_round(1, [1, 2, 3])
    msgs, (a, _) = train_round(ours, 1, rec(initial()), [1, 2, 3], client)
    assert all(m.content["config"]["proximal-mu"] == 0.3 for m in msgs)
    fl_msgs = sorted(theirs.configure_train(1, rec(initial()), ConfigRecord(), Grid([1, 2, 3])),
                     key=lambda x: x.metadata.dst_node_id)
    b, _ = theirs.aggregate_train(1, [client(m) for m in fl_msgs])
    for k, v in arrays_of(a).items():
        assert_close(torch.from_numpy(v), torch.from_numpy(arrays_of(b)[k]), rtol=1e-5, atol=1e-6, name=k)


# -- FedExP, FedExP-M, FedACG against float64 oracles ---------------------------------------------------------------

def _flat(d):
    return np.concatenate([np.asarray(v, np.float64).ravel() for v in d.values()])


def _unflat(x, like):
    out, off = {}, 0
    for k, v in like.items():
        out[k] = x[off:off + v.size].reshape(v.shape)
        off += v.size
    return out


def _round_inputs(msgs, client):
    replies = [client(m) for m in msgs]
    sent = _flat(arrays_of(msgs[0].content["arrays"]))
    deltas = np.stack([_flat(arrays_of(r.content["arrays"])) - sent for r in replies])
    n = np.array([r.content["metrics"]["num-examples"] for r in replies], np.float64)
    return replies, deltas, n / n.sum()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fedexp_equals_a_float64_oracle_and_evaluates_the_average_of_the_last_two(backend):
    eps = 1e-3
    s = fa.FedExP(eps=eps, min_available_nodes=1, backend=backend)
    w = _flat(initial())
    arrays = rec(initial())
    for rnd, m in enumerate(NODES_PER_ROUND, start=1):
        nodes = list(range(1, m + 1))
        client = clients_for_round(rnd, nodes, seed=7)
        msgs = sorted(s.configure_train(rnd, arrays, ConfigRecord(), Grid(nodes)), key=lambda x: x.metadata.dst_node_id)
        assert_close(torch.from_numpy(_flat(arrays_of(msgs[0].content["arrays"]))), torch.from_numpy(w), rtol=1e-5,
                     atol=1e-6, name="the model sent (the newest)")
        replies, deltas, p = _round_inputs(msgs, client)
        mean = p @ deltas
        eta = max(1.0, float(p @ (deltas ** 2).sum(1)) / (2 * (mean @ mean + eps)))
        w, ev = w + eta * mean, w + eta * mean - 0.5 * eta * mean
        arrays, metrics = s.aggregate_train(rnd, replies)
        assert not any(k.startswith("fedexp-") for k in metrics)  # the server's statistics are not client metrics
        server_metrics = s.server_metrics[rnd]
        assert_close(torch.tensor(server_metrics["fedexp-eta"]), torch.tensor(eta), rtol=1e-5, atol=0, name="eta")
        assert_close(torch.tensor(server_metrics["fedexp-mean-sq-norm"]), torch.tensor(mean @ mean), rtol=1e-5,
                     atol=0, name="||mean||^2")
        assert_close(torch.tensor(server_metrics["fedexp-avg-sq-norm"]), torch.tensor(float(p @ (deltas ** 2).sum(1))),
                     rtol=1e-5, atol=0, name="avg ||delta||^2")
        assert_close(torch.from_numpy(_flat(arrays_of(arrays))), torch.from_numpy(w), rtol=1e-5, atol=1e-6,
                     name=f"model after round {rnd}")
        ev_msgs = list(s.configure_evaluate(rnd, arrays, ConfigRecord(), Grid(nodes)))
        assert_close(torch.from_numpy(_flat(arrays_of(ev_msgs[0].content["arrays"]))), torch.from_numpy(ev),
                     rtol=1e-5, atol=1e-6, name=f"evaluation model after round {rnd}")
    assert max(s.last_stats.eta.item(), 0) >= 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_fedexpm_equals_a_float64_oracle(backend):
    eps, beta = 1e-3, 0.9
    s = fa.FedExPM(eps=eps, beta=beta, min_available_nodes=1, backend=backend)
    w, v, a_num = _flat(initial()), np.zeros(_flat(initial()).size), 0.0
    arrays = rec(initial())
    for rnd, m in enumerate(NODES_PER_ROUND, start=1):
        nodes = list(range(1, m + 1))
        msgs = sorted(s.configure_train(rnd, arrays, ConfigRecord(), Grid(nodes)), key=lambda x: x.metadata.dst_node_id)
        replies, deltas, p = _round_inputs(msgs, clients_for_round(rnd, nodes, seed=3))
        v = p @ deltas + beta * v
        a_num = float(p @ (deltas ** 2).sum(1)) + beta / 2 * a_num
        eta = a_num / (2 * (v @ v + eps))
        w = w + eta * v
        arrays, metrics = s.aggregate_train(rnd, replies)
        assert_close(torch.tensor(s.server_metrics[rnd]["fedexp-eta"]), torch.tensor(eta), rtol=1e-5, atol=0,
                     name="eta")
        assert_close(torch.from_numpy(_flat(arrays_of(arrays))), torch.from_numpy(w), rtol=1e-5, atol=1e-6,
                     name=f"model after round {rnd}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fedacg_sends_the_look_ahead_and_equals_a_float64_oracle(backend):
    lam = 0.85
    s = fa.FedACG(lam=lam, proximal_mu=0.01, min_available_nodes=1, backend=backend)
    w, mom = _flat(initial()), np.zeros(_flat(initial()).size)
    arrays = rec(initial())
    for rnd, m in enumerate(NODES_PER_ROUND, start=1):
        nodes = list(range(1, m + 1))
        msgs = sorted(s.configure_train(rnd, arrays, ConfigRecord(), Grid(nodes)), key=lambda x: x.metadata.dst_node_id)
        assert all(x.content["config"]["proximal-mu"] == 0.01 for x in msgs)
        b = w + lam * mom
        assert_close(torch.from_numpy(_flat(arrays_of(msgs[0].content["arrays"]))), torch.from_numpy(b), rtol=1e-5,
                     atol=1e-6, name="the look-ahead sent")
        replies, deltas, p = _round_inputs(msgs, clients_for_round(rnd, nodes, seed=5))
        mom = lam * mom + p @ deltas
        w = w + mom
        arrays, _ = s.aggregate_train(rnd, replies)
        assert_close(torch.from_numpy(_flat(arrays_of(arrays))), torch.from_numpy(w), rtol=1e-5, atol=1e-6,
                     name=f"model w after round {rnd}")


def test_fedams_is_fastaggs_fedams_with_flowers_argument_names():
    s = fa.FedAMS(eta=0.05, beta_1=0.8, beta_2=0.95, tau=1e-4, vhat_floor=1e-6, min_available_nodes=1)
    params = {k: torch.from_numpy(v) for k, v in initial().items()}
    opt = server.FedAMS(params, lr=0.05, betas=(0.8, 0.95), tau=1e-4, vhat_floor=1e-6)
    arrays = rec(initial())
    for rnd, m in enumerate(NODES_PER_ROUND[:3], start=1):
        nodes = list(range(1, m + 1))
        msgs = sorted(s.configure_train(rnd, arrays, ConfigRecord(), Grid(nodes)), key=lambda x: x.metadata.dst_node_id)
        replies = [clients_for_round(rnd, nodes)(x) for x in msgs]
        deltas = [{k: torch.from_numpy(r.content["arrays"][k].numpy() - params[k].numpy()) for k in params}
                  for r in replies]
        opt.step(deltas, weights=[r.content["metrics"]["num-examples"] for r in replies])
        arrays, _ = s.aggregate_train(rnd, replies)
        for k, v in arrays_of(arrays).items():
            assert_close(torch.from_numpy(v), params[k], rtol=1e-5, atol=1e-6, name=f"{k} round {rnd}")


# -- the Flower contract: arguments, options, start() -------------------------------------------------------------

@pytest.mark.parametrize("name", ["FedAvg", "FedAvgM", "FedProx", "FedAdam", "FedYogi", "FedAdagrad"])
def test_constructor_keeps_flowers_names_and_defaults(name):
    import inspect
    theirs = inspect.signature(getattr(fl, name).__init__).parameters
    ours = inspect.signature(getattr(fa, name).__init__).parameters
    for k, p in theirs.items():
        assert k in ours and ours[k].default == p.default, k
    s = getattr(fa, name)()
    assert isinstance(s, getattr(fl, name))
    for k, p in theirs.items():
        if k not in ("self", "train_metrics_aggr_fn", "evaluate_metrics_aggr_fn") and hasattr(s, k):
            assert getattr(s, k) == p.default, k


def test_flower_options_keep_working():
    s = fa.FedAvg(fraction_train=0.5, min_train_nodes=1, min_available_nodes=1, weighted_by_key="n",
                  arrayrecord_key="model", configrecord_key="cfg")
    msgs = list(s.configure_train(1, rec(initial()), ConfigRecord({"lr": 0.1}), Grid(range(1, 9))))
    assert len(msgs) == 4 and all(set(m.content.keys()) == {"model", "cfg"} for m in msgs)
    assert all(m.content["cfg"]["server-round"] == 1 and m.content["cfg"]["lr"] == 0.1 for m in msgs)
    replies = [Message(content=RecordDict({"model": m.content["model"], "metrics": MetricRecord({"n": 2, "loss": 1.0})}),
                       reply_to=m) for m in msgs]
    arrays, metrics = s.aggregate_train(1, replies)
    assert dict(metrics) == {"loss": 1.0}
    for k, v in arrays_of(arrays).items():
        np.testing.assert_array_equal(v, initial()[k])


def test_hyperparameters_are_checked_at_construction():
    with pytest.raises(ValueError, match="eps must be"):
        fa.FedExP(eps=-1.0)
    with pytest.raises(ValueError, match="betas"):
        fa.FedAdam(beta_1=1.5)
    with pytest.raises(ValueError, match="on_nonfinite"):
        fa.FedAvg(on_nonfinite="ignore")
    with pytest.raises(ValueError, match="proximal_mu"):
        fa.FedACG(proximal_mu=-1.0)


def test_start_runs_rounds_and_evaluates_fedexps_average_of_the_last_two():
    """Flower's own start() loop with a grid that plays the clients: evaluation (client-side and evaluate_fn) sees
    the average of the last two models, clients train from the newest, Result.arrays is the newest."""
    eps, seen_train, seen_eval, seen_fn = 1e-3, [], [], []

    def client(msg):
        sent = arrays_of(msg.content["arrays"])
        if msg.metadata.message_type == MessageType.EVALUATE:
            seen_eval.append(_flat(sent))
            return Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 1, "loss": 0.0})}),
                           reply_to=msg)
        seen_train.append(_flat(sent))
        rnd = msg.content["config"]["server-round"]
        return clients_for_round(rnd, [])(msg)

    s = fa.FedExP(eps=eps, min_available_nodes=3, min_train_nodes=3, min_evaluate_nodes=1, fraction_evaluate=0.1)
    result = s.start(Grid([1, 2, 3], client), rec(initial()), num_rounds=3,
                     evaluate_fn=lambda rnd, arrays: seen_fn.append(_flat(arrays_of(arrays))) or MetricRecord({"x": 1}))
    w = _flat(initial())
    evs = [w]
    trains = [w]
    for rnd in range(1, 4):
        sent = seen_train[3 * (rnd - 1)]
        assert_close(torch.from_numpy(sent), torch.from_numpy(trains[-1]), rtol=1e-5, atol=1e-6, name="train model")
        assert "fedexp-eta" not in result.train_metrics_clientapp[rnd]
        eta = float(result.train_metrics_serverapp[rnd]["fedexp-eta"])
        # the model after the round, from the next round's sent model (or Result.arrays after the last)
        nxt = seen_train[3 * rnd] if rnd < 3 else _flat(arrays_of(result.arrays))
        mean = (nxt - trains[-1]) / eta
        evs.append(nxt - 0.5 * eta * mean)
        trains.append(nxt)
        assert_close(torch.from_numpy(seen_eval[rnd - 1]), torch.from_numpy(evs[-1]), rtol=1e-5, atol=1e-5,
                     name=f"client-side evaluation model, round {rnd}")
        assert_close(torch.from_numpy(seen_fn[rnd]), torch.from_numpy(evs[-1]), rtol=1e-5, atol=1e-5,
                     name=f"evaluate_fn model, round {rnd}")
    np.testing.assert_array_equal(seen_fn[0], w)  # round 0: the initial model


# -- buffers, dtypes, memory --------------------------------------------------------------------------------------

def _bn_state():
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Flatten(),
                              torch.nn.Linear(8, 3))
    torch.manual_seed(0)
    net(torch.randn(4, 1, 4, 4))  # running statistics and num_batches_tracked move
    return net, {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_batchnorm_buffers_are_averaged_and_dtypes_are_kept(backend):
    """FedAdam (which Flower would step on running_var and turn into float64) on a model with BatchNorm: parameters
    take the Adam step, running statistics become the examples-weighted average, num_batches_tracked (int64) advances
    by the rounded average advance, and every entry keeps its dtype."""
    net, state = _bn_state()
    s = fa.FedAdam(eta=0.05, min_available_nodes=1, backend=backend)
    counts = {1: 10, 2: 20, 3: 70}

    def client(msg):
        node = msg.metadata.dst_node_id
        sent = arrays_of(msg.content["arrays"])
        rng = np.random.default_rng(node)
        model = {k: np.asarray(v + rng.standard_normal(v.shape).astype(v.dtype) * 0.1 if v.dtype.kind == "f"
                               else v + node) for k, v in sent.items()}
        model["1.running_var"] = np.abs(model["1.running_var"]) + 0.5
        return reply(msg, model, counts[node])

    msgs = sorted(s.configure_train(1, rec(state), ConfigRecord(), Grid([1, 2, 3])),
                  key=lambda m: m.metadata.dst_node_id)
    replies = [client(m) for m in msgs]
    arrays, _ = s.aggregate_train(1, replies)
    got = arrays_of(arrays)
    p = np.array([10, 20, 70]) / 100
    for k in ("1.running_mean", "1.running_var"):
        want = sum(pi * r.content["arrays"][k].numpy().astype(np.float64) for pi, r in zip(p, replies))
        assert_close(torch.from_numpy(got[k]), torch.from_numpy(want), rtol=1e-6, atol=1e-7, name=k)
    assert got["1.num_batches_tracked"].dtype == np.int64
    assert int(got["1.num_batches_tracked"]) == int(state["1.num_batches_tracked"]) + round(float(p @ [1, 2, 3]))
    for k, v in got.items():
        assert v.dtype == state[k].dtype, k
    # parameters: FedAdam's first step moves each element by about eta (sign of the mean update)
    moved = np.abs(got["0.weight"] - state["0.weight"])
    assert np.all(moved > 0) and np.all(moved <= 0.05 * 1.01)
    net.load_state_dict({k: torch.from_numpy(v) for k, v in got.items()})
    net.eval()
    assert torch.isfinite(net(torch.randn(2, 1, 4, 4))).all()


def test_replies_are_read_in_place_and_the_server_holds_no_update():
    """array_view is a view of the message's bytes; aggregating M = 8 replies of a 4 MB model allocates (numpy /
    Python) about one model: the returned record, not a copy per reply."""
    import tracemalloc

    a = Array(np.arange(10, dtype=np.float32))
    v = fa.array_view(a)
    assert np.shares_memory(v, np.frombuffer(a.data, np.uint8)) and not v.flags.writeable
    big = {"w": np.zeros(1_000_000, np.float32)}
    s = fa.FedAvg(min_available_nodes=1)
    msgs = list(s.configure_train(1, rec(big), ConfigRecord(), Grid(range(1, 9))))
    replies = [reply(m, {"w": np.full(1_000_000, float(m.metadata.dst_node_id), np.float32)}, 1) for m in msgs]
    s.aggregate_train(1, replies)  # warm: the accumulator and the optimizer's buffers exist
    msgs = list(s.configure_train(2, s._returned, ConfigRecord(), Grid(range(1, 9))))
    replies = [reply(m, {"w": np.full(1_000_000, float(m.metadata.dst_node_id), np.float32)}, 1) for m in msgs]
    tracemalloc.start()
    arrays, _ = s.aggregate_train(2, replies)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1.5 * 4_000_000, f"aggregate_train allocated {peak / 1e6:.1f} MB for a 4 MB model and 8 replies"
    np.testing.assert_allclose(arrays["w"].numpy(), 4.5)


def test_import_fastagg_does_not_import_flower_and_fastagg_flower_says_what_to_install():
    from fastagg.testing import import_without

    said = import_without("flwr", "fastagg.flower")
    assert "pip install '.[flower]'" in said and "pip install 'flwr" in said and "fastagg[" not in said, said


# -- bad replies ----------------------------------------------------------------------------------------------------

def _corrupt(kind, msg):
    sent = arrays_of(msg.content["arrays"])
    good = {k: v + 0.01 for k, v in sent.items()}
    if kind == "missing key":
        del good["fc.bias"]
    elif kind == "extra key":
        good["other"] = np.zeros(2, np.float32)
    elif kind == "wrong shape":
        good["fc.bias"] = np.zeros(6, np.float32)
    elif kind == "wrong dtype":  # an integer entry for a float one (another float dtype is cast: test below)
        good["fc.bias"] = good["fc.bias"].astype(np.int32)
    elif kind == "NaN":
        good["fc.weight"][1, 2] = np.nan
    elif kind == "Inf":
        good["conv.weight"][0, 0] = np.inf
    if kind == "no weight":
        return Message(content=RecordDict({"arrays": rec(good), "metrics": MetricRecord({"loss": 1.0})}),
                       reply_to=msg)
    if kind == "negative weight":
        return reply(msg, good, -3)
    if kind == "two ArrayRecords":
        return Message(content=RecordDict({"arrays": rec(good), "more": rec(good),
                                           "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)
    if kind in ("truncated bytes", "header disagrees", "not numpy"):
        record = rec(good)
        a = record["fc.weight"]
        if kind == "truncated bytes":
            record["fc.weight"] = Array(dtype=a.dtype, shape=a.shape, stype=a.stype, data=a.data[:-8])
        elif kind == "header disagrees":
            record["fc.weight"] = Array(dtype=a.dtype, shape=(4, 5), stype=a.stype, data=a.data)
        else:
            record["fc.weight"] = Array(dtype=a.dtype, shape=a.shape, stype="torch.save", data=a.data)
        return reply(msg, record, 1)
    return reply(msg, good, 1)


BAD = ["missing key", "extra key", "wrong shape", "wrong dtype", "NaN", "Inf", "no weight",
       "negative weight", "two ArrayRecords", "truncated bytes", "header disagrees", "not numpy"]


@pytest.mark.parametrize("kind", BAD)
def test_a_bad_reply_refuses_the_round_naming_the_node_and_changes_nothing(kind):
    s = fa.FedAdam(eta=0.05, min_available_nodes=1)
    arrays, _ = train_round(s, 1, rec(initial()), [1, 2, 3], clients_for_round(1, [1, 2, 3]))[1]
    before = {k: v.clone() for k, v in s.global_model.items()}
    opt_before = {k: v.clone() for k, v in s.optimizer.flat_state.items()}
    msgs = sorted(s.configure_train(2, arrays, ConfigRecord(), Grid([1, 2, 3])), key=lambda m: m.metadata.dst_node_id)
    good = clients_for_round(2, [1, 2, 3])
    replies = [good(msgs[0]), _corrupt(kind, msgs[1]), good(msgs[2])]
    with pytest.raises(AggregationError, match=f"node {msgs[1].metadata.dst_node_id}") as e:
        s.aggregate_train(2, replies)
    assert "refused" in str(e.value)
    for k, v in s.global_model.items():
        assert torch.equal(v, before[k]), k
    for k, v in s.optimizer.flat_state.items():
        assert torch.equal(v, opt_before[k]), k
    out, _ = s.aggregate_train(2, [good(msgs[0]), good(msgs[2])])  # the strategy is still usable
    assert out is not None


@pytest.mark.parametrize("kind", BAD)
def test_skip_leaves_a_bad_reply_out_and_logs_it(kind, caplog):
    s = fa.FedAvg(min_available_nodes=1, on_nonfinite="skip")
    ref = fa.FedAvg(min_available_nodes=1)
    msgs = sorted(s.configure_train(1, rec(initial()), ConfigRecord(), Grid([1, 2, 3])),
                  key=lambda m: m.metadata.dst_node_id)
    ref_msgs = sorted(ref.configure_train(1, rec(initial()), ConfigRecord(), Grid([1, 2, 3])),
                      key=lambda m: m.metadata.dst_node_id)
    good = clients_for_round(1, [1, 2, 3])
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    try:
        arrays, metrics = s.aggregate_train(1, [good(msgs[0]), _corrupt(kind, msgs[1]), good(msgs[2])])
    finally:
        flwr_logger.removeHandler(caplog.handler)
    want, _ = ref.aggregate_train(1, [good(ref_msgs[0]), good(ref_msgs[2])])
    for k, v in arrays_of(arrays).items():
        np.testing.assert_array_equal(v, arrays_of(want)[k])
    assert f"node {msgs[1].metadata.dst_node_id} left out of round 1" in caplog.text


def test_a_round_where_every_reply_fails_keeps_the_model():
    s = fa.FedExP(eps=1e-3, min_available_nodes=1, on_nonfinite="skip")
    msgs = list(s.configure_train(1, rec(initial()), ConfigRecord(), Grid([1, 2])))
    errors = [Message(Error(code=0, reason="client crashed"), reply_to=m) for m in msgs]
    assert s.aggregate_train(1, errors) == (None, None)
    assert s.aggregate_train(1, [_corrupt("NaN", m) for m in msgs]) == (None, None)
    assert s.aggregate_train(1, []) == (None, None)
    for k, v in s.global_model.items():
        np.testing.assert_array_equal(v.numpy(), initial()[k])
    strict = fa.FedAvg(min_available_nodes=1)
    msgs = list(strict.configure_train(1, rec(initial()), ConfigRecord(), Grid([1, 2])))
    assert strict.aggregate_train(1, [Message(Error(code=0, reason="x"), reply_to=m) for m in msgs]) == (None, None)


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_finite_values_at_the_edge_of_float32_never_put_inf_in_the_model(on_nonfinite, caplog):
    """A reply with finite 3e38 entries: FedAdam's second moment of such an update overflows float32. Those elements
    keep their old values (skip: logged; raise: AggregationError after the round), nothing becomes Inf or NaN."""
    s = fa.FedAdam(eta=0.05, min_available_nodes=1, on_nonfinite=on_nonfinite)
    msgs = sorted(s.configure_train(1, rec(initial()), ConfigRecord(), Grid([1, 2])),
                  key=lambda m: m.metadata.dst_node_id)
    huge = arrays_of(msgs[1].content["arrays"])
    huge["conv.weight"][0, :] = 3e38
    replies = [clients_for_round(1, [1, 2])(msgs[0]), reply(msgs[1], huge, 5)]
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    try:
        if on_nonfinite == "raise":
            with pytest.raises(AggregationError, match="kept their previous values"):
                s.aggregate_train(1, replies)
        else:
            s.aggregate_train(1, replies)
            assert "kept their previous values" in caplog.text
    finally:
        flwr_logger.removeHandler(caplog.handler)
    for k, v in s.global_model.items():
        assert torch.isfinite(v).all(), k
    for k, v in s.optimizer.flat_state.items():
        assert torch.isfinite(v).all(), k


# -- one client must not stop a round (issue 19) ---------------------------------------------------------------------

def _round_with(strategy, bad_reply, nodes=(1, 2, 3), rnd=1):
    """Round ``rnd`` of ``strategy`` where node 2 replies ``bad_reply(msg)`` and the others honestly (with a float
    ``loss`` metric); returns the messages, the replies and the honest replies (for a reference round without
    node 2)."""
    msgs = sorted(strategy.configure_train(rnd, rec(initial()), ConfigRecord(), Grid(list(nodes))),
                  key=lambda m: m.metadata.dst_node_id)
    honest = clients_for_round(rnd, list(nodes))

    def good(m):
        r = honest(m)
        metrics = next(iter(r.content.metric_records.values()))
        return reply(m, next(iter(r.content.array_records.values())), metrics["num-examples"],
                     loss=float(m.metadata.dst_node_id))

    replies = [bad_reply(m) if m.metadata.dst_node_id == 2 else good(m) for m in msgs]
    return msgs, replies, [good(m) for m in msgs if m.metadata.dst_node_id != 2]


def _huge(msg):
    """Finite float32 values near the largest, with a large weight: the round's mean has a norm past float32's
    range, so no step of it can be taken safely."""
    arrays = {k: np.full_like(v, 3.3e38) for k, v in arrays_of(msg.content["arrays"]).items()}
    return reply(msg, arrays, 1000, loss=1e30)


def _reference(name, honest_of):
    ref = getattr(fa, name)(min_available_nodes=1, **({"eps": 1e-3} if name == "FedExP" else {}))
    _, _, honest = _round_with(ref, lambda m: m)
    return ref.aggregate_train(1, honest)


@pytest.mark.parametrize("name", ["FedAvg", "FedAvgM", "FedExP"])
def test_skip_leaves_out_a_finite_reply_so_large_the_round_would_overflow(name, caplog):
    kw = {"eps": 1e-3} if name == "FedExP" else {}
    s = getattr(fa, name)(min_available_nodes=1, on_nonfinite="skip", **kw)
    msgs, replies, _ = _round_with(s, _huge)
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    try:
        arrays, metrics = s.aggregate_train(1, replies)
    finally:
        flwr_logger.removeHandler(caplog.handler)
    assert arrays is not None, "the honest nodes' round was dropped"
    want, want_metrics = _reference(name, None)
    for k, v in arrays_of(arrays).items():
        np.testing.assert_allclose(v, arrays_of(want)[k], rtol=1e-6, atol=1e-7)
    assert "node 2 left out of round 1" in caplog.text and "overflow" in caplog.text
    assert metrics["loss"] == pytest.approx(want_metrics["loss"])  # node 2's loss of 1e30 is not in them


def test_raise_refuses_a_round_with_a_reply_that_would_overflow_naming_the_node():
    s = fa.FedAvg(min_available_nodes=1)
    _, replies, _ = _round_with(s, _huge)
    before = {k: v.clone() for k, v in s.global_model.items()}
    with pytest.raises(AggregationError, match="node 2.*overflow"):
        s.aggregate_train(1, replies)
    for k, v in s.global_model.items():
        assert torch.equal(v, before[k]), k


def test_a_node_left_out_is_left_out_of_the_train_metrics():
    s = fa.FedAvg(min_available_nodes=1, on_nonfinite="skip")

    def nan_reply(msg):
        arrays = arrays_of(msg.content["arrays"])
        arrays["fc.bias"][0] = np.nan
        return reply(msg, arrays, 1000, loss=1e9)

    _, replies, honest = _round_with(s, nan_reply)
    _, metrics = s.aggregate_train(1, replies)
    ref = fa.FedAvg(min_available_nodes=1)
    _round_with(ref, lambda m: m)
    _, want = ref.aggregate_train(1, honest)
    assert metrics["loss"] == pytest.approx(want["loss"]) and metrics["loss"] <= 3


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_a_metric_of_another_type_is_caught_before_the_model_changes(on_nonfinite):
    s = fa.FedAdam(eta=0.05, min_available_nodes=1, on_nonfinite=on_nonfinite)

    def listy(msg):
        return reply(msg, {k: v + 0.01 for k, v in arrays_of(msg.content["arrays"]).items()}, 3, loss=[1.0, 2.0])

    _, replies, honest = _round_with(s, listy)
    before = {k: v.clone() for k, v in s.global_model.items()}
    state_before = {k: v.clone() for k, v in s.optimizer.flat_state.items()}
    if on_nonfinite == "raise":
        with pytest.raises(AggregationError, match="node 2"):
            s.aggregate_train(1, replies)
        for k, v in s.global_model.items():
            assert torch.equal(v, before[k]), k
        for k, v in s.optimizer.flat_state.items():
            assert torch.equal(v, state_before[k]), k
    else:
        arrays, metrics = s.aggregate_train(1, replies)
        assert arrays is not None and isinstance(metrics["loss"], float)


def test_a_user_metric_aggregation_that_fails_fails_before_the_step():
    def broken(records, key):
        raise RuntimeError("boom")

    s = fa.FedAvg(min_available_nodes=1, train_metrics_aggr_fn=broken)
    _, replies, _ = _round_with(s, lambda m: clients_for_round(1, [1, 2, 3])(m))
    before = {k: v.clone() for k, v in s.global_model.items()}
    with pytest.raises(AggregationError, match="train metrics cannot be aggregated"):
        s.aggregate_train(1, replies)
    for k, v in s.global_model.items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_a_weight_too_large_for_a_float_is_a_bad_weight(on_nonfinite):
    """num-examples = 10**400 (a valid Python int in a MetricRecord): refused or left out like any bad weight, never
    an OverflowError."""
    s = fa.FedAvg(min_available_nodes=1, on_nonfinite=on_nonfinite)

    def enormous(msg):
        return reply(msg, {k: v + 0.01 for k, v in arrays_of(msg.content["arrays"]).items()}, 10**400)

    _, replies, _ = _round_with(s, enormous)
    if on_nonfinite == "raise":
        with pytest.raises(AggregationError, match="node 2.*num-examples"):
            s.aggregate_train(1, replies)
    else:
        arrays, _ = s.aggregate_train(1, replies)
        want, _ = _reference("FedAvg", None)
        for k, v in arrays_of(arrays).items():
            np.testing.assert_array_equal(v, arrays_of(want)[k])


def test_fedacg_sends_the_look_ahead_of_the_model_it_is_handed():
    """configure_train handed another model than the one aggregate_train returned (a restart, a rollback): the
    look-ahead b = w + lam m sent to clients starts from that model, not from the previous one."""
    s = fa.FedACG(min_available_nodes=1, lam=0.5)
    arrays = rec(initial())
    for rnd in (1, 2):
        _, (arrays, _) = train_round(s, rnd, arrays, [1, 2, 3], clients_for_round(rnd, [1, 2, 3]))
    other = {k: v * 0 + 0.25 for k, v in initial(seed=9).items()}
    msgs = list(s.configure_train(3, rec(other), ConfigRecord(), Grid([1, 2, 3])))
    sent = arrays_of(msgs[0].content["arrays"])
    m = s.optimizer.flat_state["momentum"]
    flat_w = torch.cat([torch.from_numpy(other[k]).reshape(-1) for k in s.global_model])
    want = flat_w + 0.5 * m
    got = torch.cat([torch.from_numpy(sent[k]).reshape(-1) for k in s.global_model])
    assert_close(got, want, rtol=1e-6, atol=1e-7, name="look-ahead")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float64_reply_of_a_float32_model_is_cast_like_the_core_api(backend):
    """A numpy client that sends float64: its entries are cast to the model's float32 (one copy), as fastagg's
    steps convert updates on load, never a refused round; the round equals the one where that client had cast
    its arrays itself, bit for bit, and the model stays float32."""
    nodes = [1, 2, 3, 4]
    client = clients_for_round(1, nodes)

    def as_float64(msg):
        out = client(msg)
        if msg.metadata.dst_node_id == 2:
            arrays = {k: a.numpy().astype(np.float64) for k, a in out.content["arrays"].items()}
            return reply(msg, arrays, out.content["metrics"]["num-examples"])
        return out

    results = []
    for each in (client, as_float64):
        strategy = fa.FedAdam(min_available_nodes=1, backend=backend, eta=0.05)
        _, (arrays, _) = train_round(strategy, 1, rec(initial()), nodes, each)
        results.append(arrays_of(arrays))
    for k in results[0]:
        assert results[1][k].dtype == np.float32 and np.array_equal(results[0][k], results[1][k]), k


def test_a_float64_reply_beyond_float32s_range_is_refused_as_such(caplog):
    """Cast, a float64 reply of 1e300 would become Inf: it is named as out of range, left out with "skip"."""
    nodes = [1, 2, 3]
    client = clients_for_round(1, nodes)

    def huge(msg):
        out = client(msg)
        if msg.metadata.dst_node_id == 2:
            return reply(msg, {k: a.numpy().astype(np.float64) * 1e300 for k, a in out.content["arrays"].items()}, 5)
        return out
    with pytest.raises(AggregationError, match="node 2 .*values beyond the range of the model's float32"):
        train_round(fa.FedAdam(min_available_nodes=1), 1, rec(initial()), nodes, huge)
    _, (arrays, _) = train_round(fa.FedAdam(min_available_nodes=1, on_nonfinite="skip"), 1, rec(initial()), nodes,
                                 huge)
    assert all(np.isfinite(v).all() for v in arrays_of(arrays).values())
    assert "node 2 left out of round 1" in caplog.text


@pytest.mark.parametrize("case", ["FedAdam", "FedAvgM", "FedYogi"])
def test_buffers_optimizer_steps_batchnorm_statistics_as_flowers_strategy_does(case, caplog):
    """buffers="optimizer": running_mean / running_var take the optimizer's step like parameters, so the whole
    model equals Flower's own strategy round after round (the Flower-identical baseline in one argument); the
    default averages them instead. Integer buffers keep the average rule either way. The policy is logged once."""
    fl_cls, fa_cls, kw, atol = CASES[case]
    _, state = _bn_state()
    ours = fa_cls(min_available_nodes=1, buffers="optimizer", **kw)
    default = fa_cls(min_available_nodes=1, **kw)
    theirs = fl_cls(min_available_nodes=1, **kw)
    a_fa = a_fl = a_def = rec(state)
    floats = [k for k, v in state.items() if v.dtype.kind == "f"]
    caplog.set_level(logging.INFO)
    for rnd in range(1, 4):
        nodes = [1, 2, 3]

        def cast_back(msg, rnd=rnd):  # a client: float entries move, the BatchNorm counter advances by 1
            node = msg.metadata.dst_node_id
            sent = arrays_of(msg.content["arrays"])
            rng = np.random.default_rng(100 * rnd + node)
            arrays = {k: np.asarray(v + 1 if v.dtype.kind == "i" else
                                    (v + 0.05 * rng.standard_normal(v.shape) + 0.02 * (node - 2)).astype(v.dtype))
                      for k, v in sent.items()}
            arrays["1.running_var"] = (np.abs(arrays["1.running_var"]) + 0.1).astype(np.float32)
            return reply(msg, arrays, 7 + 13 * node)

        msgs, (a_fa, _) = train_round(ours, rnd, a_fa, nodes, cast_back)
        replies = [cast_back(m) for m in msgs]
        a_fl, _ = flower_round(theirs, rnd, a_fl, nodes, replies)
        def_msgs = sorted(default.configure_train(rnd, a_def, ConfigRecord(), Grid(nodes)),
                          key=lambda x: x.metadata.dst_node_id)
        a_def, _ = default.aggregate_train(rnd, [Message(content=r.content, reply_to=f)
                                                 for r, f in zip(replies, def_msgs)])
        got, want = arrays_of(a_fa), arrays_of(a_fl)
        for k in floats:
            assert_close(torch.from_numpy(got[k]), torch.from_numpy(want[k]).double(), rtol=1e-5, atol=atol,
                         name=f"{case} {k} after round {rnd}")
        assert got["1.num_batches_tracked"].dtype == np.int64
    averaged = arrays_of(a_def)
    assert not np.allclose(averaged["1.running_mean"], got["1.running_mean"], atol=1e-6)  # the policies differ
    logs = [r.getMessage() for r in caplog.records if "fastagg: buffers" in r.getMessage()]
    assert len(logs) == 2 and any("stepped by the optimizer" in m for m in logs) and any("average" in m for m in logs)


def test_every_strategy_argument_has_a_default_fedexp_eps_included():
    """fa.FedExP() and fa.FedExPM() run without arguments: eps defaults to the paper's 1e-3."""
    for cls in (fa.FedExP, fa.FedExPM, fa.FedACG, fa.FedAMS, fa.FedAvg, fa.FedAvgM, fa.FedAdam, fa.FedYogi,
                fa.FedAdagrad, fa.FedProx):
        for name, p in inspect.signature(cls.__init__).parameters.items():
            assert p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) \
                or name == "self", (cls.__name__, name)
        cls()
    assert fa.FedExP().eps == 1e-3 and fa.FedExPM().eps == 1e-3
    with pytest.raises(ValueError, match="buffers must be one of"):
        fa.FedAdam(buffers="stepped")
