"""fastagg.flower's robust strategies next to Flower 1.42's own on the same reply Messages, round after round
(FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan), and where Flower's float32 distances of full models go wrong:
small updates on large weights, against a float64 oracle."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import strategy as fl

from fastagg import flower as fa
from fastagg.testing import assert_close
from test_flower_strategies import Grid, arrays_of, flower_round, initial, rec, reply, train_round

SHAPES = {"conv.weight": (4, 3), "fc.weight": (5, 4), "fc.bias": (5,)}
NODES = 11

CASES = {  # name: (Flower's, fastagg's, settings, atol)
    "FedMedian": (fl.FedMedian, fa.FedMedian, {}, 1e-6),
    "FedTrimmedAvg": (fl.FedTrimmedAvg, fa.FedTrimmedAvg, dict(beta=0.2), 1e-6),
    "Krum": (fl.Krum, fa.Krum, dict(num_malicious_nodes=2), 1e-6),
    "MultiKrum": (fl.MultiKrum, fa.MultiKrum, dict(num_malicious_nodes=2, num_nodes_to_select=4), 1e-6),
    "Bulyan": (fl.Bulyan, fa.Bulyan, dict(num_malicious_nodes=2), 1e-6),
}


def _clients(rnd, attackers=(3, 9)):
    """Honest nodes move a little and differ; attackers send the model plus a large shift."""

    def client(msg):
        node = msg.metadata.dst_node_id
        sent = arrays_of(msg.content["arrays"])
        rng = np.random.default_rng(100 * rnd + node)
        shift = 3.0 if node in attackers else 0.0
        model = {k: (v + 0.05 * rng.standard_normal(v.shape) + shift).astype(v.dtype) for k, v in sent.items()}
        return reply(msg, model, 5 + 3 * node)
    return client


@pytest.mark.parametrize("case", list(CASES))
def test_same_model_as_flowers_robust_strategy_round_after_round(case):
    fl_cls, fa_cls, kw, atol = CASES[case]
    theirs, ours = fl_cls(min_available_nodes=1, **kw), fa_cls(min_available_nodes=1, **kw)
    a_fa = a_fl = rec(initial())
    for rnd, count in enumerate([11, 12, 10, 13], start=1):  # even counts: the median's two middle values
        nodes = list(range(1, count + 1))
        client = _clients(rnd)
        msgs, (a_fa, metrics) = train_round(ours, rnd, a_fa, nodes, client)
        replies = [client(m) for m in msgs]
        a_fl, fl_metrics = flower_round(theirs, rnd, a_fl, nodes, replies)
        if a_fl is None:  # Bulyan with fewer than 4f + 3 replies: both keep the model
            assert a_fa is None and case == "Bulyan" and count < 11
            a_fa = a_fl = msgs[0].content["arrays"]
            continue
        got, want = arrays_of(a_fa), arrays_of(a_fl)
        assert list(got) == list(want)
        for k in got:
            assert got[k].dtype == np.float32
            assert_close(torch.from_numpy(got[k]), torch.from_numpy(want[k]).double(), rtol=1e-5, atol=atol,
                         name=f"{case} {k} after round {rnd}")
        assert dict(metrics) == pytest.approx(dict(fl_metrics))
        assert np.abs(got["fc.bias"] - arrays_of(rec(initial()))["fc.bias"]).max() < 1.0  # attackers kept out


def test_krum_distances_of_small_updates_on_large_weights_match_float64_where_flowers_do_not():
    """Weights ~1000, updates ~1e-3: Flower forms ||x||^2 + ||y||^2 - 2 x.y over the float32 models (~1e6 each),
    so its distances (~1e-5) drown in rounding and its choice is noise; fastagg's Gram of the updates in float64
    gives the oracle's scores, so it picks the oracle's client."""
    shapes = {"w": (2000,)}
    big = {"w": np.full(2000, 1000.0, np.float32)}
    centre = np.random.default_rng(0).standard_normal(2000) * 1e-3
    spread = [0.2, 0.1, 0.5, 0.3, 1.5, 0.8, 0.05, 0.9, 2.0, 0.4, 0.7]

    def client(msg):
        node = msg.metadata.dst_node_id
        rng = np.random.default_rng(node)
        upd = centre + spread[node - 1] * 1e-4 * rng.standard_normal(2000)
        return reply(msg, {"w": (big["w"] + upd).astype(np.float32)}, 10)

    nodes = list(range(1, NODES + 1))
    ours = fa.Krum(num_malicious_nodes=2, min_available_nodes=1)
    msgs, (a_fa, _) = train_round(ours, 1, rec(big), nodes, client)
    replies = [client(m) for m in msgs]
    models = np.stack([r.content["arrays"]["w"].numpy().astype(np.float64) for r in replies])
    upd = models - big["w"].astype(np.float64)
    d2 = ((upd[:, None, :] - upd[None, :, :]) ** 2).sum(-1)
    oracle = np.array([np.sort(np.delete(d2[i], i))[:NODES - 4].sum() for i in range(NODES)])
    pick = int(ours.last_stats.robust.selected.nonzero())
    assert pick == int(np.argmin(oracle))
    np.testing.assert_allclose(ours.last_stats.robust.scores.numpy(), oracle, rtol=1e-6)
    flat = models.astype(np.float32)
    norms = np.square(flat).sum(1)
    flower_d2 = norms[:, None] + norms[None, :] - 2 * flat @ flat.T
    err = np.abs(flower_d2 - d2)[~np.eye(NODES, dtype=bool)].max() / d2[~np.eye(NODES, dtype=bool)].min()
    assert err > 0.1, err  # Flower's distances are off by more than 10% of the smallest true one


def test_a_nan_reply_is_left_out_and_logged_not_refused(caplog):
    caplog.set_level(logging.WARNING)
    s = fa.FedMedian(min_available_nodes=1)
    honest = _clients(1)

    def client(msg):
        r = honest(msg)
        if msg.metadata.dst_node_id == 4:
            arrays = arrays_of(r.content["arrays"])
            arrays["fc.bias"] = np.full((5,), np.nan, np.float32)
            return reply(msg, arrays, 10)
        return r

    _, (arrays, _) = train_round(s, 1, rec(initial()), list(range(1, NODES + 1)), client)
    assert all(np.isfinite(v).all() for v in arrays_of(arrays).values())
    assert any("node 4 left out" in r.getMessage() for r in caplog.records)
    assert dict(s.server_metrics[1]) == {"robust-selected": NODES - 1, "robust-excluded": 1, "robust-clipped": 0}


def test_bulyan_with_too_few_replies_keeps_the_model_as_flower_does(caplog):
    caplog.set_level(logging.WARNING)
    s = fa.Bulyan(num_malicious_nodes=2, min_available_nodes=1)
    _, (arrays, _) = train_round(s, 1, rec(initial()), [1, 2, 3, 4, 5], _clients(1))
    assert arrays is None and any("keeps the model" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="custom selection_rule"):
        fa.Bulyan(selection_rule=lambda c, f, n: c)


@pytest.mark.parametrize("case", ["FedMedian", "FedTrimmedAvg"])
def test_batchnorm_statistics_take_the_coordinate_rule_as_in_flower(case):
    """A model with BatchNorm: Flower's FedMedian/FedTrimmedAvg apply the rule to every array, running statistics
    included; fastagg's give the same floating entries (its counter stays int64, advanced by the rule's advance)."""
    from test_flower_strategies import _bn_state

    fl_cls, fa_cls, kw, _ = CASES[case]
    _, state = _bn_state()
    ours, theirs = fa_cls(min_available_nodes=1, **kw), fl_cls(min_available_nodes=1, **kw)

    def client(msg):
        node = msg.metadata.dst_node_id
        sent = arrays_of(msg.content["arrays"])
        rng = np.random.default_rng(node)
        model = {k: np.asarray(v + 1 if v.dtype.kind == "i" else
                               (v + 0.1 * rng.standard_normal(v.shape) + (3.0 if node == 2 else 0.0)).astype(v.dtype))
                 for k, v in sent.items()}
        model["1.running_var"] = (np.abs(model["1.running_var"]) + 0.1).astype(np.float32)
        return reply(msg, model, 10)

    nodes = list(range(1, 8))
    msgs, (a_fa, _) = train_round(ours, 1, rec(state), nodes, client)
    replies = [client(m) for m in msgs]
    a_fl, _ = flower_round(theirs, 1, rec(state), nodes, replies)
    got, want = arrays_of(a_fa), arrays_of(a_fl)
    for k, v in got.items():
        if v.dtype.kind == "f":
            assert_close(torch.from_numpy(v), torch.from_numpy(want[k]).double(), rtol=1e-5, atol=1e-6, name=k)
    assert got["1.num_batches_tracked"].dtype == np.int64
    assert int(got["1.num_batches_tracked"]) == int(state["1.num_batches_tracked"]) + 1


@pytest.mark.parametrize("case", ["Krum", "MultiKrum"])
def test_a_selected_replys_batchnorm_statistics_never_reach_the_model(case):
    """A model with BatchNorm: node 3 sends the honest replies' mean weights (Krum's pick) with running_var 1e6
    (valid: it stays in); node 5 honest weights with a running_var of -5 in one channel (a negative variance: left
    out, logged). Flower's Krum would average the selected replies' statistics (1e6 here); fastagg's take each
    element's median over the replies left in (numpy's median of the replies)."""
    from test_flower_strategies import _bn_state

    _, state = _bn_state()
    fa_cls, kw = CASES[case][1], CASES[case][2]
    nodes = list(range(1, 10))

    def honest(node):
        rng = np.random.default_rng(node)
        return {k: np.asarray(v + 1 if v.dtype.kind == "i" else
                              (v + 0.1 * rng.standard_normal(v.shape)).astype(v.dtype)) for k, v in state.items()}
    models = {n: honest(n) for n in nodes}
    for n in nodes:
        models[n]["1.running_var"] = np.abs(models[n]["1.running_var"]).astype(np.float32) + 0.1
    good = [n for n in nodes if n != 5]
    for k, v in state.items():
        if v.dtype.kind == "f" and "running" not in k:
            models[3][k] = np.mean([models[n][k] for n in nodes if n != 3], axis=0).astype(v.dtype)
    models[3]["1.running_var"] = np.array([1e6, 1e6], np.float32)
    models[5]["1.running_var"] = np.array([-5.0, 1e6], np.float32)
    s = fa_cls(min_available_nodes=1, **kw)
    _, (arrays, _) = train_round(s, 1, rec(state), nodes, lambda msg: reply(msg, models[msg.metadata.dst_node_id], 10))
    got = arrays_of(arrays)
    want = np.median(np.stack([models[n]["1.running_var"].astype(np.float64) for n in good]), axis=0)
    np.testing.assert_allclose(got["1.running_var"].astype(np.float64), want, rtol=1e-6)
    assert (got["1.running_var"] > 0).all() and (got["1.running_var"] < 10).all()
    assert dict(s.server_metrics[1])["robust-excluded"] == 1


def test_bulyan_at_its_bound_with_a_nan_reply_aggregates_counting_it_as_an_attacker():
    """11 replies = 4f + 3 for f = 2, one of them NaN: the NaN reply is one of the f, so the 10 others hold at most
    f - 1 = 1 attacker and Bulyan (10 >= 4 * 1 + 3) aggregates them instead of keeping the model."""
    s = fa.Bulyan(num_malicious_nodes=2, min_available_nodes=1)
    honest = _clients(1, attackers=(9,))

    def client(msg):
        r = honest(msg)
        if msg.metadata.dst_node_id == 4:
            arrays = arrays_of(r.content["arrays"])
            arrays["fc.bias"] = np.full((5,), np.nan, np.float32)
            return reply(msg, arrays, 10)
        return r

    _, (arrays, _) = train_round(s, 1, rec(initial()), list(range(1, NODES + 1)), client)
    assert arrays is not None and all(np.isfinite(v).all() for v in arrays_of(arrays).values())
    assert dict(s.server_metrics[1])["robust-excluded"] == 1


CHANGES = [  # (name, built with, changed to between rounds 1 and 2)
    ("FedTrimmedAvg", dict(beta=0.2), dict(beta=0.4)),
    ("FedTrimmedAvg", dict(beta=0.0), dict(beta=0.2)),
    ("MultiKrum", dict(num_malicious_nodes=1, num_nodes_to_select=5), dict(num_nodes_to_select=1)),
    ("MultiKrum", dict(num_malicious_nodes=0, num_nodes_to_select=5), dict(num_malicious_nodes=2)),
    ("Krum", dict(num_malicious_nodes=0), dict(num_malicious_nodes=3)),
    ("Bulyan", dict(num_malicious_nodes=0), dict(num_malicious_nodes=1)),
]


@pytest.mark.parametrize("name,built,change", CHANGES, ids=[f"{c[0]}-{list(c[2])[0]}" for c in CHANGES])
def test_a_setting_changed_between_rounds_applies_from_the_next_as_in_flower(name, built, change, monkeypatch):
    """Flower's robust strategies read ``beta``, ``num_malicious_nodes``, ``num_nodes_to_select`` in every round:
    after the same change between rounds 1 and 2, round 2 is Flower's class's round 2 (on the same replies, with
    no model sent, as Flower's own tests call aggregate_train). The change matters: Flower's round 2 with the old
    setting is another model."""
    import gc

    monkeypatch.setattr(gc, "collect", lambda *a: 0)  # (Flower's to_numpy_ndarrays collects per reply: 0.25 s each)
    rng = np.random.default_rng(4)
    start = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    count = 7 if name == "Bulyan" else 11  # (Bulyan: 4f + 3 with f = 1; Flower's takes seconds over 11 replies)
    shifts = [0.0] * (count - 2) + [2.0, -3.0]  # two far replies

    def replies(rnd):
        r = np.random.default_rng(rnd)
        out = []
        for i, shift in enumerate(shifts):
            msg = Message(content=RecordDict({}), dst_node_id=i + 1, message_type="train")
            out.append(reply(msg, {k: v + 0.1 * r.standard_normal(v.shape).astype(np.float32) + shift
                                   for k, v in start.items()}, 5 + i))
        return out

    ours = getattr(fa, name)(**built, backend="cpu")
    theirs, before = getattr(fl, name)(**built), getattr(fl, name)(**built)
    for s in (ours, theirs, before):
        s.aggregate_train(1, replies(1))
    for s in (ours, theirs):
        for k, v in change.items():
            setattr(s, k, v)
    got, want, old = (arrays_of(s.aggregate_train(2, replies(2))[0]) for s in (ours, theirs, before))
    assert max(np.abs(want[k] - old[k]).max() for k in want) > 1e-3  # the change matters
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"{name} {k} after {change}")


def test_a_bad_setting_between_rounds_is_refused_and_the_model_kept():
    """beta outside [0, 0.5): ValueError naming it (as the constructor's), before anything changes."""
    rng = np.random.default_rng(5)
    model = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    ours = fa.FedTrimmedAvg(beta=0.2)
    ours.current_arrays = rec(model)
    ours.beta = 0.7
    msgs = [Message(content=RecordDict({}), dst_node_id=i + 1, message_type="train") for i in range(4)]
    with pytest.raises(ValueError, match="beta"):
        ours.aggregate_train(1, [reply(m, {k: v + i for k, v in model.items()}, 5) for i, m in enumerate(msgs)])
    for k, v in arrays_of(ours.current_arrays).items():
        np.testing.assert_array_equal(v, model[k])
