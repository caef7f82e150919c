"""Compressed replies in Flower: fastagg's compress_mod on the client, fastagg's strategies reading them in place.
Each round is checked against Flower's own strategy aggregating the full models the compressed replies stand for
(sent + the dequantized update), BatchNorm buffers included; bad compressed replies are refused naming the node."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp import strategy as fl  # noqa: E402
from flwr.serverapp.exception import AggregationError  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fastagg import flower as fa  # noqa: E402
from fastagg.compress import dequantize  # noqa: E402
from fastagg.flower.compressed import MARKER, compressed_record, read_compressed  # noqa: E402
from fastagg.testing import assert_close, cpu_backends  # noqa: E402

TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
BACKENDS = cpu_backends()


class Grid:
    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return list(self.nodes)


def _model():
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
    torch.manual_seed(0)
    net(torch.randn(8, 6))
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def _rec(arrays):
    return ArrayRecord({k: Array(np.array(v, order="C")) for k, v in arrays.items()})


def _arrays(record):
    return {k: a.numpy() for k, a in record.items()}


def _trained(msg, scale=0.05):
    """A deterministic client: sent + a node- and round-specific update; BatchNorm statistics moved too."""
    node = msg.metadata.dst_node_id
    rnd = int(next(iter(msg.content.config_records.values())).get("server-round", 0))
    sent = _arrays(next(iter(msg.content.array_records.values())))
    rng = np.random.default_rng(100 * rnd + node)
    model = {k: (v + scale * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v + node
             for k, v in sent.items()}
    model["1.running_var"] = np.abs(model["1.running_var"]) + 0.5
    return model


def _client(spec, contexts, compressed_nodes=None):
    """Plays each node: trains (``_trained``), then runs the reply through compress_mod(spec) (only for the nodes
    in ``compressed_nodes`` when given); each node keeps one Context (error feedback lives in its state)."""
    mod = fa.compress_mod(spec, seed=3)

    def client(msg):
        node = msg.metadata.dst_node_id
        ctx = contexts.setdefault(node, Context(run_id=1, node_id=node, node_config={}, state=RecordDict(),
                                                run_config={}))

        def train(m, c):
            return Message(RecordDict({"arrays": _rec(_trained(m)),
                                       "metrics": MetricRecord({"num-examples": 10 + 7 * node})}), reply_to=m)
        if compressed_nodes is not None and node not in compressed_nodes:
            return train(msg, ctx)
        return mod(msg, ctx, train)
    return client


def _as_full_models(replies, msgs):
    """What each compressed reply stands for, as the full-model reply Flower's strategies read."""
    out = []
    for r, m in zip(replies, msgs):
        record = r.content["arrays"]
        if MARKER not in record:
            out.append(Message(content=r.content, reply_to=m))
            continue
        update, bufs = read_compressed(record)
        sent = _arrays(m.content["arrays"])
        delta = dequantize(update, torch.float64).numpy()
        model, at = {}, 0
        for k, v in sent.items():
            if k in bufs:
                model[k] = np.array(bufs[k])
            else:
                model[k] = (v.astype(np.float64) + delta[at:at + v.size].reshape(v.shape)).astype(v.dtype)
                at += v.size
        out.append(Message(RecordDict({"arrays": _rec(model), "metrics": r.content["metrics"]}), reply_to=m))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["int8:block=16", "fp8:block=32", "qsgd:s=8", "topk:0.3", "randk:0.5,ef=0"])
def test_compressed_rounds_equal_flowers_on_the_models_they_stand_for(backend, spec):
    ours, theirs = fa.FedAdam(eta=0.05, min_available_nodes=1, backend=backend), fl.FedAdam(eta=0.05,
                                                                                         min_available_nodes=1)
    arrays_ours = arrays_theirs = _rec(_model())
    contexts = {}
    client = _client(spec, contexts)
    for rnd in range(1, 4):
        nodes = [1, 2, 3, 4][: 2 + rnd % 3]
        msgs = sorted(ours.configure_train(rnd, arrays_ours, ConfigRecord(), Grid(nodes)),
                      key=lambda m: m.metadata.dst_node_id)
        replies = [client(m) for m in msgs]
        assert all(MARKER in r.content["arrays"] for r in replies)
        arrays_ours, _ = ours.aggregate_train(rnd, replies)
        fmsgs = sorted(theirs.configure_train(rnd, arrays_theirs, ConfigRecord(), Grid(nodes)),
                       key=lambda m: m.metadata.dst_node_id)
        arrays_theirs, _ = theirs.aggregate_train(rnd, _as_full_models(replies, fmsgs))
        a, b = _arrays(arrays_ours), _arrays(arrays_theirs)
        for k in a:  # (Flower's FedAdam steps BatchNorm statistics as parameters; fastagg averages them)
            if a[k].dtype.kind == "f" and "running" not in k:
                assert_close(torch.from_numpy(a[k]), torch.from_numpy(b[k].astype(a[k].dtype)), rtol=1e-4,
                             atol=1e-5, name=f"round {rnd} {k}")
        arrays_theirs = _rec({k: b[k].astype(a[k].dtype) for k in a})  # (Flower's FedAdam turns float32 into 64)


def test_a_round_may_mix_compressed_and_full_model_replies():
    ours, theirs = fa.FedAvg(min_available_nodes=1, min_train_nodes=1), fl.FedAvg(min_available_nodes=1)
    arrays = _rec(_model())
    client = _client("int8:block=8", {}, compressed_nodes={2, 4})
    msgs = sorted(ours.configure_train(1, arrays, ConfigRecord(), Grid([1, 2, 3, 4])),
                  key=lambda m: m.metadata.dst_node_id)
    replies = [client(m) for m in msgs]
    assert [MARKER in r.content["arrays"] for r in replies] == [False, True, False, True]
    got, _ = ours.aggregate_train(1, replies)
    fmsgs = sorted(theirs.configure_train(1, arrays, ConfigRecord(), Grid([1, 2, 3, 4])),
                   key=lambda m: m.metadata.dst_node_id)
    want, _ = theirs.aggregate_train(1, _as_full_models(replies, fmsgs))
    a, b = _arrays(got), _arrays(want)
    for k in a:
        if a[k].dtype.kind == "f":
            assert_close(torch.from_numpy(a[k]), torch.from_numpy(b[k]), rtol=1e-5, atol=1e-6, name=k)
    # num_batches_tracked: the rounded weighted average advance (fastagg's buffer rule)
    p = np.array([17, 24, 31, 38]) / 110
    assert int(a["1.num_batches_tracked"]) == int(_model()["1.num_batches_tracked"]) + round(float(p @ [1, 2, 3, 4]))


def test_error_feedback_residuals_live_in_the_nodes_context_and_are_sent_later():
    contexts = {}
    client = _client("topk:0.1", contexts)
    s = fa.FedAvg(min_available_nodes=1, min_train_nodes=1)
    arrays = _rec(_model())
    msg = next(iter(s.configure_train(1, arrays, ConfigRecord(), Grid([7]))))
    out = client(msg)
    update, _ = read_compressed(out.content["arrays"])
    residual = contexts[7].state.array_records["fastagg.residual"]["residual"].numpy()
    sent = _arrays(msg.content["arrays"])
    model = _trained(msg)
    delta = np.concatenate([(model[k].astype(np.float32) - sent[k]).reshape(-1) for k in sent
                            if sent[k].dtype.kind == "f" and "running" not in k])
    assert np.allclose(dequantize(update).numpy() + residual, delta, atol=1e-6)
    assert np.count_nonzero(residual) == delta.size - update.indices.numel()


def _node_reply(kind):
    s = fa.FedAvg(min_available_nodes=1, min_train_nodes=1)
    arrays = _rec(_model())
    msgs = sorted(s.configure_train(1, arrays, ConfigRecord(), Grid([1, 2])), key=lambda m: m.metadata.dst_node_id)
    spec = "topk:0.2,ef=0" if kind.startswith("sparse") else "int8:block=8"
    replies = [_client(spec, {})(m) for m in msgs]
    rec = replies[1].content["arrays"]
    update, bufs = read_compressed(rec)
    entries = {k: rec[k].numpy() for k in rec}
    if kind == "nan-scale":
        entries["scales"] = entries["scales"].copy()
        entries["scales"][1] = np.nan
    elif kind == "negative-scale":
        entries["scales"] = -entries["scales"]
    elif kind == "code-128":
        entries["codes"] = np.full_like(entries["codes"], -128)
    elif kind == "sparse-outside":
        entries["indices"] = entries["indices"].copy()
        entries["indices"][-1] = 10 ** 6
    elif kind == "sparse-unsorted":
        entries["indices"] = entries["indices"][::-1].copy()
    elif kind == "other-size":
        entries[MARKER] = np.array([1, 1, update.numel + 8, 8])
        entries["codes"] = np.zeros(update.numel + 8, dtype=np.int8)
        entries["scales"] = np.ones(-(-(update.numel + 8) // 8), dtype=np.float32)
    elif kind == "version":
        entries[MARKER] = np.array([9, 1, update.numel, 8])
    elif kind == "missing-buffer":
        del entries["1.running_mean"]
    replies[1] = Message(RecordDict({"arrays": _rec(entries), "metrics": replies[1].content["metrics"]}),
                         reply_to=msgs[1])
    return s, arrays, replies


@pytest.mark.parametrize("kind, match", [
    ("nan-scale", "NaN or Inf"), ("negative-scale", "scale <= 0"), ("code-128", "-128"),
    ("sparse-outside", "is outside"), ("sparse-unsorted", "strictly increasing"),
    ("other-size", "the model has"), ("version", "format version 9"), ("missing-buffer", "buffers"),
])
def test_a_bad_compressed_reply_is_refused_naming_the_node_and_nothing_changes(kind, match):
    s, arrays, replies = _node_reply(kind)
    before = {k: v.clone() for k, v in s.global_model.items()}
    with pytest.raises(AggregationError, match=f"node 2 .*{match}"):
        s.aggregate_train(1, replies)
    assert all(torch.equal(before[k], v) for k, v in s.global_model.items())
    s.on_nonfinite = "skip"
    got, _ = s.aggregate_train(1, replies)  # the bad reply left out, the good one taken
    assert got is not None


def test_robust_strategies_read_compressed_replies_dequantized():
    s = fa.FedMedian(min_available_nodes=1)
    arrays = _rec(_model())
    msgs = sorted(s.configure_train(1, arrays, ConfigRecord(), Grid([1, 2, 3])), key=lambda m: m.metadata.dst_node_id)
    replies = [_client("int8:block=8", {})(m) for m in msgs]
    got, _ = s.aggregate_train(1, replies)
    theirs = fl.FedMedian(min_available_nodes=1)
    fmsgs = sorted(theirs.configure_train(1, arrays, ConfigRecord(), Grid([1, 2, 3])),
                   key=lambda m: m.metadata.dst_node_id)
    want, _ = theirs.aggregate_train(1, _as_full_models(replies, fmsgs))
    a, b = _arrays(got), _arrays(want)
    for k in a:
        if a[k].dtype.kind == "f" and "running" not in k:
            assert_close(torch.from_numpy(a[k]), torch.from_numpy(b[k].astype(a[k].dtype)), rtol=1e-5, atol=1e-6,
                         name=k)


def test_the_mod_refuses_what_it_cannot_send_and_qfedavg_refuses_compressed_replies():
    with pytest.raises(ValueError, match="bf16"):
        fa.compress_mod("bf16")
    with pytest.raises(ValueError, match="unknown compression"):
        fa.compress_mod("int3")
    mod = fa.compress_mod("int8")
    s = fa.FedAvg(min_available_nodes=1, min_train_nodes=1)
    msg = next(iter(s.configure_train(1, _rec(_model()), ConfigRecord(), Grid([1]))))
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})

    def nan_train(m, c):
        model = _trained(m)
        model["0.weight"][0, 0] = np.nan
        return Message(RecordDict({"arrays": _rec(model), "metrics": MetricRecord({"num-examples": 3})}), reply_to=m)
    out = mod(msg, ctx, nan_train)
    assert out.has_error() and "NaN or Inf" in out.error.reason
    q = fa.QFedAvg(client_learning_rate=0.1, min_available_nodes=1, min_train_nodes=1)
    msg = next(iter(q.configure_train(1, _rec(_model()), ConfigRecord(), Grid([1]))))
    out = _client("int8", {})(msg)
    out.content["metrics"]["train_loss"] = 1.0
    with pytest.raises(AggregationError, match="QFedAvg reads full models"):
        q.aggregate_train(1, [out])


def test_the_wire_form_round_trips():
    from fastagg.compress import quantize_fp8, quantize_int8, sparsify_topk

    x = torch.randn(100)
    for u in (quantize_int8(x, 16), quantize_fp8(x, 32), sparsify_topk(x, 0.1)):
        back, bufs = read_compressed(compressed_record(u, {"b": np.zeros(2)}))
        assert type(back) is type(u) and torch.equal(dequantize(back), dequantize(u)) and list(bufs) == ["b"]


@pytest.mark.parametrize("mixed", [False, True])
def test_one_node_sending_huge_finite_values_is_left_out_and_the_others_aggregate(mixed):
    """A compressed reply of finite values so large that the round's sums overflow: with on_nonfinite="skip" that
    node is left out and the others make the round; with "raise" the round is refused naming it, model unchanged."""
    from fastagg.compress import quantize_int8

    for mode in ("skip", "raise"):
        s = fa.FedAvg(min_available_nodes=1, on_nonfinite=mode)
        arrays = _rec(_model())
        msgs = sorted(s.configure_train(1, arrays, ConfigRecord(), Grid([1, 2, 3])),
                      key=lambda m: m.metadata.dst_node_id)
        replies = [_client("int8:block=8", {}, compressed_nodes=None if not mixed else {2})(m) for m in msgs]
        rec = replies[1].content["arrays"]
        update, bufs = read_compressed(rec)
        huge = quantize_int8(torch.full((update.numel,), 3e38), 8)
        replies[1] = Message(RecordDict({"arrays": compressed_record(huge, {k: np.array(v) for k, v in bufs.items()}),
                                         "metrics": replies[1].content["metrics"]}), reply_to=msgs[1])
        before = {k: v.clone() for k, v in s.global_model.items()}
        if mode == "raise":
            with pytest.raises(AggregationError, match="node 2 .*overflow"):
                s.aggregate_train(1, replies)
            assert all(torch.equal(before[k], v) for k, v in s.global_model.items())
        else:
            got, _ = s.aggregate_train(1, replies)
            assert got is not None and all(np.isfinite(a.numpy()).all() for a in got.values())
            assert not torch.equal(before["0.weight"], s.global_model["0.weight"])


def test_a_reply_claiming_a_block_far_beyond_its_size_allocates_nothing_beyond_it():
    """A reply's header may name any block in [1, 2^31): one of 2^31 - 1 over the model's few parameters (one scale)
    was dequantized into 16 GiB of float64 by the robust strategies and the mixed rounds. Now O(d), and the round is
    the one its codes stand for."""
    from test_compress_hostile import _address_space_headroom

    arrays = _rec(_model())
    for s in (fa.FedMedian(min_available_nodes=1), fa.FedAvg(min_available_nodes=1)):
        msgs = sorted(s.configure_train(1, arrays, ConfigRecord(), Grid([1, 2, 3])),
                      key=lambda m: m.metadata.dst_node_id)
        replies = [_client("int8:block=8", {})(m) for m in msgs]
        s.aggregate_train(1, replies)  # (thread pools and allocator arenas mapped before the limit)
        rec = replies[1].content["arrays"]
        update, _ = read_compressed(rec)
        entries = {k: rec[k].numpy() for k in rec}
        entries[MARKER] = np.array([1, 1, update.numel, 2 ** 31 - 1])
        entries["scales"] = np.array([1e-3], dtype=np.float32)
        replies[1] = Message(RecordDict({"arrays": _rec(entries), "metrics": replies[1].content["metrics"]}),
                             reply_to=msgs[1])
        hostile, _ = read_compressed(replies[1].content["arrays"])
        assert hostile.block == 2 ** 31 - 1
        with _address_space_headroom(2 << 30):
            got, _ = s.aggregate_train(1, replies)
        assert got is not None and all(np.isfinite(a.numpy()).all() for a in got.values())


def _bad_compressed(kind, numel, bufs):
    """A compressed reply no quantizer writes (a hostile or broken node)."""
    from fastagg.compress import Fp8Blockwise, Int8Blockwise, SparseUpdate

    blocks = -(-numel // 8)
    if kind == "fp8-nan-code":
        update = Fp8Blockwise(torch.full((numel,), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn),
                              torch.ones(blocks), 8)
    elif kind == "sparse-nan-value":
        update = SparseUpdate(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1.0, float("nan")]), numel)
    elif kind == "code-128":
        update = Int8Blockwise(torch.full((numel,), -128, dtype=torch.int8), torch.ones(blocks), 8)
    elif kind == "negative-scale":
        update = Int8Blockwise(torch.ones(numel, dtype=torch.int8), -torch.ones(blocks), 8)
    else:  # "nan-buffer", "negative-var": valid codes, a NaN mean or a negative variance
        update = Int8Blockwise(torch.ones(numel, dtype=torch.int8), torch.ones(blocks), 8)
        name, value = ("1.running_mean", np.nan) if kind == "nan-buffer" else ("1.running_var", -1.0)
        bufs = dict(bufs, **{name: np.full_like(bufs[name], value)})
    return compressed_record(update, bufs)


@pytest.mark.parametrize("kind", ["fp8-nan-code", "sparse-nan-value", "code-128", "negative-scale", "nan-buffer",
                                  "negative-var"])
@pytest.mark.parametrize("name, theirs", [("FedMedian", lambda: fl.FedMedian(min_available_nodes=1)),
                                          ("Krum", lambda: fl.Krum(min_available_nodes=1, num_malicious_nodes=0)),
                                          ("FedTrimmedAvg", lambda: fl.FedTrimmedAvg(min_available_nodes=1))])
def test_robust_strategies_leave_out_a_bad_compressed_reply_as_they_leave_out_a_nan_float_one(kind, name, theirs):
    """Under a robust strategy (default on_nonfinite="raise") a compressed reply holding NaN, an invalid code or a
    scale <= 0 is an attack like a float reply holding NaN: left out and counted among f, the round made by the
    others (Flower's own strategy over the honest replies' full models; Krum with f = 0 over them, the left-out
    reply having used the one f allowed). It refused the whole round before."""
    kw = {"num_malicious_nodes": 1} if name == "Krum" else {}
    s = getattr(fa, name)(min_available_nodes=1, **kw)
    arrays = _rec(_model())
    nodes = [1, 2, 3, 4, 5]
    msgs = sorted(s.configure_train(1, arrays, ConfigRecord(), Grid(nodes)), key=lambda m: m.metadata.dst_node_id)
    replies = [_client("int8:block=8", {})(m) for m in msgs]
    update, bufs = read_compressed(replies[1].content["arrays"])
    bad = _bad_compressed(kind, update.numel, {k: np.array(v) for k, v in bufs.items()})
    replies[1] = Message(RecordDict({"arrays": bad, "metrics": replies[1].content["metrics"]}), reply_to=msgs[1])
    got, _ = s.aggregate_train(1, replies)
    assert got is not None and s.server_metrics[1]["robust-excluded"] == 1
    fl_s = theirs()
    honest = [1, 3, 4, 5]
    fmsgs = sorted(fl_s.configure_train(1, arrays, ConfigRecord(), Grid(honest)), key=lambda m: m.metadata.dst_node_id)
    want, _ = fl_s.aggregate_train(1, _as_full_models([replies[i] for i in (0, 2, 3, 4)], fmsgs))
    a, b = _arrays(got), _arrays(want)
    for k in a:
        if a[k].dtype.kind == "f":  # (buffers: the honest replies' average; none of the bad reply's)
            if "running" in k:  # the honest replies' average (Krum: weighted by examples)
                got_bufs = [read_compressed(replies[i].content["arrays"])[1][k] for i in (0, 2, 3, 4)]
                w = np.array([float(replies[i].content["metrics"]["num-examples"]) for i in (0, 2, 3, 4)])
                w = w if name == "Krum" else np.ones(4)
                assert_close(torch.from_numpy(a[k]), torch.from_numpy(np.tensordot(w / w.sum(), got_bufs, 1)),
                             rtol=1e-6, atol=1e-7, name=f"{kind} {k}")
                continue
            assert_close(torch.from_numpy(a[k]), torch.from_numpy(b[k].astype(a[k].dtype)), rtol=1e-5, atol=1e-6,
                         name=f"{kind} {k}")


@pytest.mark.parametrize("shape, payload", [((2 ** 62, 4), b""), ((2 ** 62 + 1, 4), b"\0" * 16)])
def test_a_header_whose_element_count_wraps_int64_is_refused_naming_the_entry(shape, payload):
    """(2^62 + 1) x 4 elements wrapped to 4 in int64: the byte count check passed on 16 bytes and numpy's reshape
    failed naming nothing. The count is now exact (Python ints)."""
    import io

    from fastagg.flower.records import ReplyError, array_view

    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False, "shape": shape})
    arr = Array(dtype="float32", shape=shape, stype="numpy.ndarray", data=head.getvalue() + payload)
    with pytest.raises(ReplyError, match=rf"1.running_mean holds {len(payload)} data bytes; its header says "
                                         rf"{shape[0] * shape[1]} x 4"):
        array_view(arr, "1.running_mean")
