"""The cases Flower 1.42's own message-API strategy tests check (framework/py/flwr/serverapp/strategy/*_test.py:
fedavgm_test, fedopt_test, fedmedian_test, fedtrimmedavg_test, multikrum_test), written again against fastagg's
classes. Flower's tests build a strategy, set ``strategy.current_arrays`` by hand (or set nothing, for the rules whose
result does not depend on the model sent) and call ``aggregate_train`` with mock replies, never ``configure_train``.
Where the numbers are not written out in Flower's test, Flower's own class on the same replies is the oracle.
"""
from __future__ import annotations

from unittest.mock import Mock

import numpy as np
import pytest

from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import strategy as fl
from flwr.serverapp.exception import AggregationError

from fastagg import flower as fa


def mock_reply(arrays: ArrayRecord, num_examples: float, node: int = 1) -> Message:
    """A reply as Flower's tests make it (strategy_utils_test.create_mock_reply): a Mock with a Message's spec."""
    message = Mock(spec=Message)
    message.content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": num_examples})})
    message.has_error.side_effect = lambda: False
    message.has_content.side_effect = lambda: True
    message.metadata.src_node_id = node
    return message


def rec(named: dict) -> ArrayRecord:
    """An ArrayRecord keyed by name (ArrayRecord itself takes a list, a torch state_dict or Arrays)."""
    return ArrayRecord({k: Array(v) for k, v in named.items()})


def _fedavgm_case():
    w00 = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32)
    w01 = np.array([7, 8, 9, 10], dtype=np.float32)
    w10 = np.array([[29, 23, 19], [17, 13, 11]], dtype=np.float32)
    w11 = np.array([7, 5, 3, 2], dtype=np.float32)
    replies = [mock_reply(ArrayRecord([w00, w01]), 1, 1), mock_reply(ArrayRecord([w10, w11]), 2, 2)]
    expected = [(w00 * 1 + w10 * 2) / 3, (w01 * 1 + w11 * 2) / 3]
    strategy = fa.FedAvgM()
    strategy.current_arrays = ArrayRecord([np.zeros((2, 3), np.float32), np.zeros(4, np.float32)])
    return strategy, replies, expected


def test_fedavgm_near_one_server_lr_no_momentum_without_configure_train():
    strategy, replies, expected = _fedavgm_case()
    strategy.server_learning_rate = 1.0 + 1e-9
    actual, _ = strategy.aggregate_train(1, replies)
    assert actual is not None
    for got, want in zip(actual.to_numpy_ndarrays(), expected, strict=True):
        np.testing.assert_almost_equal(got, want, decimal=5)


def test_fedavgm_two_rounds_without_configure_train():
    """Round 2 measures the replies from round 1's model (Flower keeps the aggregate as current_arrays)."""
    strategy, replies, expected = _fedavgm_case()
    strategy.server_learning_rate = 1.0 + 1e-9
    strategy.server_momentum = 1e-9
    strategy.aggregate_train(1, replies)
    actual, _ = strategy.aggregate_train(2, replies)
    assert actual is not None
    for got, want in zip(actual.to_numpy_ndarrays(), expected, strict=True):
        np.testing.assert_almost_equal(got, want, decimal=5)
    assert isinstance(strategy.current_arrays, ArrayRecord)  # Flower's FedAvgM keeps an ArrayRecord
    for got, want in zip(strategy.current_arrays.to_numpy_ndarrays(), actual.to_numpy_ndarrays(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_fedavgm_scalar_arrays():
    strategy = fa.FedAvgM(server_learning_rate=1.0 + 1e-9)
    strategy.current_arrays = ArrayRecord([np.array(0.0)])
    replies = [mock_reply(ArrayRecord([np.array(1.0)]), 1), mock_reply(ArrayRecord([np.array(3.0)]), 2)]
    actual, _ = strategy.aggregate_train(1, replies)
    assert actual is not None
    scalar = actual.to_numpy_ndarrays()[0]
    assert scalar.shape == ()
    np.testing.assert_allclose(scalar, np.array(7.0 / 3.0), rtol=1e-6)


FEDOPT = [("FedAdam", fa.FedAdam), ("FedYogi", fa.FedYogi), ("FedAdagrad", fa.FedAdagrad)]


@pytest.mark.parametrize("name,cls", FEDOPT + [("FedAMS", fa.FedAMS)])
@pytest.mark.parametrize("case", ["same", "more keys", "other shape"])
def test_fedopt_replies_unlike_current_arrays_are_refused(name, cls, case):
    """fedopt_test's compute_deltat case: replies whose keys or shapes differ from the current_arrays set by hand
    raise AggregationError (naming what differs) and change nothing; matching ones aggregate."""
    rng = np.random.default_rng(0)
    strategy = cls()
    start = {str(k): rng.standard_normal((7, 3)) for k in range(4)}
    strategy.current_arrays = start
    n, shape = {"same": (4, (7, 3)), "more keys": (5, (7, 3)), "other shape": (4, (7, 5))}[case]
    replies = [mock_reply(ArrayRecord([rng.standard_normal(shape) for _ in range(n)]), 3, node)
               for node in (11, 12)]
    if case == "same":
        actual, _ = strategy.aggregate_train(1, replies)
        assert actual is not None and list(actual) == list(start)
        return
    with pytest.raises(AggregationError, match=r"node 11 .*(have entries \['4'\]|\['0'\] has shape \(7, 5\))"):
        strategy.aggregate_train(1, replies)
    kept = strategy.current_arrays
    assert isinstance(kept, dict) and list(kept) == list(start)  # Flower's FedOpt keeps {key: ndarray}
    for k, v in start.items():
        np.testing.assert_array_equal(kept[k], v)


@pytest.mark.parametrize("name,cls", FEDOPT)
def test_fedopt_scalar_arrays_match_flowers_own(name, cls):
    """fedopt_test's scalar case, with Flower's own strategy on the same replies as the oracle."""
    results = []
    for strategy in (cls(), getattr(fl, name)()):
        strategy.current_arrays = {"0": np.array(0.0)}
        replies = [mock_reply(ArrayRecord([np.array(1.0)]), 1), mock_reply(ArrayRecord([np.array(3.0)]), 2)]
        actual, _ = strategy.aggregate_train(1, replies)
        assert actual is not None
        scalar = actual.to_numpy_ndarrays()[0]
        assert scalar.shape == () and np.isfinite(scalar)
        results.append(float(scalar))
    assert results[0] != 0.0
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)


def test_fedmedian_without_any_model():
    strategy = fa.FedMedian()
    replies = [mock_reply(ArrayRecord([np.array([1.0, 0.2, 0.5, 1.0])]), 5),
               mock_reply(ArrayRecord([np.array([0.2, 0.5, 1.0, 0.2])]), 2),
               mock_reply(ArrayRecord([np.array([0.5, 1.0, 0.2, 0.5])]), 9)]
    actual, _ = strategy.aggregate_train(1, replies)
    assert actual
    np.testing.assert_equal(actual.to_numpy_ndarrays()[0], np.array([0.5, 0.5, 0.5, 0.5]))


def test_fedmedian_scalar_arrays():
    strategy = fa.FedMedian()
    replies = [mock_reply(ArrayRecord([np.array(v)]), 1) for v in (1.0, 3.0, 2.0)]
    actual, _ = strategy.aggregate_train(1, replies)
    assert actual
    got = actual.to_numpy_ndarrays()[0]
    assert got.shape == ()
    np.testing.assert_equal(got, np.array(2.0))


def test_fedtrimmedavg_without_any_model():
    strategy = fa.FedTrimmedAvg(beta=0.25)
    replies = [mock_reply(ArrayRecord([np.array([0.5, 0.5, 0.5, 0.5])]), 1),
               mock_reply(ArrayRecord([np.array([1.0, 0.2, 0.5, 1.0])]), 5),
               mock_reply(ArrayRecord([np.array([0.2, 0.5, 1.0, 0.2])]), 2),
               mock_reply(ArrayRecord([np.array([0.5, 1.0, 0.2, 0.5])]), 9)]
    actual, _ = strategy.aggregate_train(1, replies)
    assert actual
    np.testing.assert_equal(actual.to_numpy_ndarrays()[0], np.array([0.5, 0.5, 0.5, 0.5]))


def test_fedtrimmedavg_scalar_arrays():
    strategy = fa.FedTrimmedAvg(beta=0.25)
    replies = [mock_reply(ArrayRecord([np.array(v)]), 1) for v in (0.5, 1.0, 2.0, 100.0)]
    actual, _ = strategy.aggregate_train(1, replies)
    assert actual
    got = actual.to_numpy_ndarrays()[0]
    assert got.shape == ()
    np.testing.assert_equal(got, np.array(1.5))


def _krum_replies(middle: float):
    return [mock_reply(ArrayRecord([np.array([v] * 4)]), 5, node) for node, v in enumerate((0.2, middle, 1.0))]


def test_krum_without_any_model():
    actual, _ = fa.Krum(num_malicious_nodes=1).aggregate_train(server_round=1, replies=_krum_replies(0.7))
    assert actual
    assert actual.object_id == ArrayRecord([np.array([0.7, 0.7, 0.7, 0.7])]).object_id  # the bytes themselves


def test_multikrum_without_any_model():
    actual, _ = fa.MultiKrum(num_malicious_nodes=1, num_nodes_to_select=2).aggregate_train(
        server_round=1, replies=_krum_replies(0.5))
    assert actual
    flower, _ = fl.MultiKrum(num_malicious_nodes=1, num_nodes_to_select=2).aggregate_train(
        server_round=1, replies=_krum_replies(0.5))
    np.testing.assert_allclose(actual.to_numpy_ndarrays()[0], np.array([0.35] * 4), rtol=1e-15)
    np.testing.assert_allclose(actual.to_numpy_ndarrays()[0], flower.to_numpy_ndarrays()[0], rtol=1e-15)


def test_fedavg_without_any_model_is_flowers_weighted_average():
    rng = np.random.default_rng(1)
    make = lambda: [mock_reply(rec({"a": rng.standard_normal((3, 2)).astype(np.float32),  # noqa: E731
                                    "b": np.arange(4, dtype=np.float32) + k}), k + 1, k) for k in range(3)]
    replies = make()
    ours, _ = fa.FedAvg().aggregate_train(1, replies)
    theirs, _ = fl.FedAvg().aggregate_train(1, replies)
    assert list(ours) == ["a", "b"]
    for k in ("a", "b"):
        got, want = ours[k].numpy(), theirs[k].numpy()
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make", [lambda: fa.FedAvgM(server_momentum=0.9), lambda: fa.FedAdam(),
                                  lambda: fa.FedExP(), lambda: fa.FedAvgM(server_learning_rate=0.5)])
def test_a_rule_that_needs_the_model_sent_refuses_without_one(make):
    """As Flower's FedAvgM (with its server optimizer on) and FedOpt raise AggregationError: the step depends on the
    model the clients started from, and none was given; the strategy is left without a model."""
    strategy = make()
    with pytest.raises(AggregationError, match=r"no model was sent.*current_arrays"):
        strategy.aggregate_train(1, [mock_reply(ArrayRecord([np.ones(3)]), 1)])
    assert strategy.current_arrays is None and strategy.optimizer is None


def test_a_refused_round_before_any_model_leaves_none_behind():
    strategy = fa.FedAvg()
    replies = [mock_reply(ArrayRecord([np.ones(3)]), 1, 1), mock_reply(ArrayRecord([np.ones(4)]), 1, 2)]
    with pytest.raises(AggregationError, match=r"node 2 .*shape \(4,\)"):
        strategy.aggregate_train(1, replies)
    assert strategy.current_arrays is None
    actual, _ = strategy.aggregate_train(1, [mock_reply(ArrayRecord([np.ones(4)]), 1)])  # another model: fine
    np.testing.assert_array_equal(actual.to_numpy_ndarrays()[0], np.ones(4))


def test_current_arrays_set_by_hand_after_a_round():
    """The same structure: taken as the new model (the optimizer's state kept); another structure: refused,
    naming current_arrays and the entry; None: the model and state are forgotten."""
    strategy = fa.FedAvgM(server_momentum=0.5)
    strategy.current_arrays = rec({"w": np.zeros(3, np.float32)})
    strategy.aggregate_train(1, [mock_reply(rec({"w": np.ones(3, np.float32)}), 1)])
    momentum = strategy.optimizer.flat_state["momentum_buffer"].clone()
    strategy.current_arrays = rec({"w": np.full(3, 5.0, np.float32)})
    assert (strategy.optimizer.flat_state["momentum_buffer"] == momentum).all()
    with pytest.raises(ValueError, match=r"current_arrays\['w'\] has shape \(4,\)"):
        strategy.current_arrays = rec({"w": np.zeros(4, np.float32)})
    np.testing.assert_array_equal(strategy.current_arrays["w"].numpy(), np.full(3, 5.0, np.float32))
    actual, _ = strategy.aggregate_train(2, [mock_reply(rec({"w": np.full(3, 6.0, np.float32)}), 1)])
    # v = 0.5 v + (-1) (measured from 5, not from round 1's model 1): w = 5 + (1 + 0.5)
    np.testing.assert_allclose(actual["w"].numpy(), np.full(3, 6.5), rtol=1e-6)
    strategy.current_arrays = None
    assert strategy.current_arrays is None and strategy.optimizer is None


# dp_mods_test (clientapp/mod): a 0-d array through the clipping mods keeps its shape. Flower's test also expects
# the value 2.0 for an update of norm 2 under clipping_norm 1 with norm_bit 1: flwr 1.42's compute_clip_model_update
# scales np.subtract's 0-d result, a numpy scalar, by rebinding it, so a 0-d model's update is never clipped. fastagg
# clips it (the DP guarantee rests on ||update|| <= C): a departure listed in docs/ALGORITHMS.md section 11.
def _dp_round(mod, with_metrics):
    from flwr.app import ConfigRecord, Context, MessageType
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.array(0.0))}),
                          "configs": ConfigRecord({"clipping_norm": 1.0})})
    msg = Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)

    def client(in_msg, _ctxt):
        out = RecordDict({"arrays": ArrayRecord({"w": Array(np.array(2.0))})})
        if with_metrics:
            out["metrics"] = MetricRecord({"loss": 0.5})
        return Message(content=out, reply_to=in_msg)

    ctxt = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    return mod(msg, ctxt, client)


@pytest.mark.parametrize("name", ["fixedclipping_mod", "adaptiveclipping_mod"])
def test_clipping_mods_keep_a_0d_array_and_clip_it(name):
    out = _dp_round(getattr(fa, name), name.startswith("adaptive"))
    got = out.content.array_records["arrays"]["w"].numpy()
    assert isinstance(got, np.ndarray) and got.shape == ()
    np.testing.assert_allclose(got, np.array(1.0), rtol=1e-12)  # 0 + clip(2, 1): the update's norm is now 1
    if name.startswith("adaptive"):
        assert out.content.metric_records["metrics"]["norm_bit"] == 1
    from flwr.clientapp import mod as flower_mods

    flower = _dp_round(getattr(flower_mods, name), name.startswith("adaptive"))
    np.testing.assert_array_equal(flower.content.array_records["arrays"]["w"].numpy(), np.array(2.0))  # the departure


@pytest.mark.parametrize("name,setting", [("FedAdam", "eta"), ("FedYogi", "beta_1"), ("FedAvgM", "server_momentum")])
def test_a_setting_changed_between_rounds_applies_as_in_flower(name, setting):
    """Flower's strategies read ``eta``, ``beta_1``, ``server_momentum``, ... in every round: the same change on
    fastagg's strategy between two rounds gives Flower's model (Flower's class on the same replies is the oracle)."""
    rng = np.random.default_rng(2)
    start = {"a": rng.standard_normal(5), "b": rng.standard_normal((2, 2))}
    rounds = [[{k: v + 0.1 * rng.standard_normal(v.shape) for k, v in start.items()} for _ in range(3)]
              for _ in range(2)]
    kw = {"server_momentum": 0.5} if name == "FedAvgM" else {}
    out = []
    for strategy in (getattr(fa, name)(**kw), getattr(fl, name)(**kw)):
        model = start
        for t, models in enumerate(rounds):
            if t == 1:
                setattr(strategy, setting, 0.3 * getattr(strategy, setting))
            strategy.current_arrays = rec(model) if name == "FedAvgM" else dict(model)
            replies = [mock_reply(rec({k: model[k] + (m[k] - start[k]) for k in m}), i + 1, i)
                       for i, m in enumerate(models)]
            actual, _ = strategy.aggregate_train(t + 1, replies)
            model = {k: actual[k].numpy() for k in actual}
        out.append(model)
    for k in start:
        np.testing.assert_allclose(out[0][k], out[1][k], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name,cls", FEDOPT)
def test_fedopt_measures_every_round_from_current_arrays_until_configure_train(name, cls):
    """Flower's FedOpt family keeps ``current_arrays`` (set by hand, or by configure_train) and its aggregate_train
    never replaces it: rounds 1..3 called without configure_train all measure the replies from, and step from,
    that model, the moments carried over. fastagg gives Flower's model each round, and its current_arrays stays
    the model set, as Flower's does. A round refused in between (a NaN reply) leaves the strategy as it was: the
    next round is still Flower's."""
    rng = np.random.default_rng(8)
    start = {"a": rng.standard_normal(5).astype(np.float32), "b": rng.standard_normal((2, 2)).astype(np.float32)}

    def replies(t):
        r = np.random.default_rng(t)
        return [mock_reply(rec({k: v + 0.1 * r.standard_normal(v.shape).astype(np.float32) for k, v in start.items()}),
                           5 + i, i + 1) for i in range(3)]

    ours, theirs = cls(eta=0.1, backend="cpu"), getattr(fl, name)(eta=0.1)
    for s in (ours, theirs):
        s.current_arrays = {k: v.copy() for k, v in start.items()}
    for t in (1, 2, 3):
        if t == 2:
            bad = replies(t)
            bad[1] = mock_reply(rec({k: np.full_like(v, np.nan) for k, v in start.items()}), 6, 2)
            kept = {k: v.clone() for k, v in ours.global_model.items()}
            with pytest.raises(AggregationError, match="node 2"):
                ours.aggregate_train(t, bad)
            for k, v in kept.items():
                assert (ours.global_model[k] == v).all(), k
        got, _ = ours.aggregate_train(t, replies(t))
        want, _ = theirs.aggregate_train(t, replies(t))
        for k in start:
            np.testing.assert_allclose(got[k].numpy(), want[k].numpy(), rtol=1e-5, atol=1e-7, err_msg=f"{k} round {t}")
        for k in start:
            np.testing.assert_array_equal(ours.current_arrays[k], theirs.current_arrays[k])
            np.testing.assert_array_equal(ours.current_arrays[k], start[k])
