"""q-FedAvg: fastagg.server.QFedAvg against the paper's formula in float64 on every backend and client form, and
fastagg.flower.QFedAvg next to Flower 1.42's QFedAvg on the same reply Messages round after round."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message
from flwr.serverapp import strategy as fl

from fastagg import flower as fa
from fastagg import server
from fastagg.testing import assert_close, cpu_backends
from test_flower_strategies import Grid, arrays_of, initial, rec, reply


def _oracle(w, x, losses, lr_c, q):
    L = 1.0 / lr_c
    f = torch.tensor(losses, dtype=torch.float64) + 1e-10
    d = x.double()
    h = q * f ** (q - 1) * L * L * (d * d).sum(1) + L * f ** q
    return w.double() + L * (f[:, None] ** q * d).sum(0) / h.sum()


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("q", [0.0, 0.5, 1.0, 2.0])
def test_qfedavg_is_the_papers_update(backend, q):
    g = torch.Generator().manual_seed(int(q * 10))
    x = 0.05 * torch.randn(6, 301, generator=g)
    losses = [0.3, 1.2, 2.5, 0.05, 0.9, 4.0]
    w0 = torch.randn(301, generator=g)
    for form in ("matrix", "models"):
        w = w0.clone()
        opt = server.QFedAvg(w, client_learning_rate=0.05, q=q, backend=backend)
        if form == "matrix":
            opt.step(x, losses)
        else:
            opt.step(list(x + w0), losses, base=w0)
        assert_close(w, _oracle(w0, x, losses, 0.05, q), rtol=1e-5, atol=1e-6, name=f"q={q} {form}")
    if q == 0.0:  # q = 0: FedAvg with equal weights
        w = w0.clone()
        server.QFedAvg(w, client_learning_rate=0.05, q=0.0, backend=backend).step(x, losses)
        assert_close(w, w0.double() + x.double().mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("losses,err,match", [
    ([1.0, -0.5, 1.0], ValueError, r"losses\[1\]"), ([1.0, float("nan"), 1.0], ValueError, r"losses\[1\]"),
    ([1.0, 1.0], ValueError, "one value per client"), ([1.0, True, 1.0], TypeError, "losses"),
    (["1", 1.0, 1.0], TypeError, "losses"), (None, TypeError, "losses"),
])
def test_hostile_losses_change_nothing(losses, err, match):
    w = torch.zeros(5)
    opt = server.QFedAvg(w, client_learning_rate=0.1)
    with pytest.raises(err, match=match):
        opt.step(torch.ones(3, 5), losses)
    assert w.abs().sum() == 0
    for bad in (dict(client_learning_rate=0.0), dict(client_learning_rate=0.1, q=-1.0)):
        with pytest.raises(ValueError):
            server.QFedAvg(torch.zeros(2), **bad)


SHAPES = {"conv.weight": (4, 3), "fc.weight": (5, 4), "fc.bias": (5,)}


def _client(rnd):
    def client(msg):
        node = msg.metadata.dst_node_id
        sent = arrays_of(msg.content["arrays"])
        rng = np.random.default_rng(10 * rnd + node)
        model = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in sent.items()}
        return reply(msg, model, 5 + node, train_loss=float(0.2 + 0.4 * node + 0.1 * rnd))
    return client


@pytest.mark.parametrize("q", [0.1, 1.0])
def test_same_model_as_flowers_qfedavg_round_after_round(q):
    theirs = fl.QFedAvg(client_learning_rate=0.1, q=q, min_available_nodes=1)
    ours = fa.QFedAvg(client_learning_rate=0.1, q=q, min_available_nodes=1)
    a_fa = a_fl = rec(initial(shapes=SHAPES))
    for rnd, count in enumerate([4, 5, 3, 6], start=1):
        nodes = list(range(1, count + 1))
        msgs = sorted(ours.configure_train(rnd, a_fa, ConfigRecord(), Grid(nodes)), key=lambda m: m.metadata.dst_node_id)
        client = _client(rnd)
        replies = [client(m) for m in msgs]
        a_fa, m_fa = ours.aggregate_train(rnd, replies)
        fl_msgs = sorted(theirs.configure_train(rnd, a_fl, ConfigRecord(), Grid(nodes)),
                         key=lambda m: m.metadata.dst_node_id)
        a_fl, m_fl = theirs.aggregate_train(rnd, [Message(content=r.content, reply_to=f)
                                                  for r, f in zip(replies, fl_msgs)])
        got, want = arrays_of(a_fa), arrays_of(a_fl)
        for k in got:
            assert got[k].dtype == np.float32  # (Flower's comes back float64)
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"{k} round {rnd}")
        assert dict(m_fa) == pytest.approx(dict(m_fl))
        a_fl = rec({k: v.astype(np.float32) for k, v in want.items()})  # both continue from float32 models


def test_a_reply_without_a_training_loss_is_a_bad_reply(caplog):
    from flwr.serverapp.exception import AggregationError

    ours = fa.QFedAvg(client_learning_rate=0.1, min_available_nodes=1)
    start = rec(initial(shapes=SHAPES))
    msgs = sorted(ours.configure_train(1, start, ConfigRecord(), Grid([1, 2, 3])), key=lambda m: m.metadata.dst_node_id)
    replies = [_client(1)(m) for m in msgs]
    bad = replies[1]
    del bad.content.metric_records["metrics"]["train_loss"]
    with pytest.raises(AggregationError, match="train_loss"):
        ours.aggregate_train(1, replies)
    skip = fa.QFedAvg(client_learning_rate=0.1, min_available_nodes=1, on_nonfinite="skip")
    msgs = sorted(skip.configure_train(1, start, ConfigRecord(), Grid([1, 2, 3])), key=lambda m: m.metadata.dst_node_id)
    replies = [_client(1)(m) for m in msgs]
    replies[2].content.metric_records["metrics"]["train_loss"] = -1.0
    arrays, _ = skip.aggregate_train(1, replies)
    assert arrays is not None and "left out" in caplog.text
