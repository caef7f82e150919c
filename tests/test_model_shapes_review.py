"""What a hostile review of issue 42's shortcuts found (each failed on the code before its fix): a client whose extra
entry is an integer in one client and floating in another, entries the compiled binding cannot take as they are
(no elements; more than 8 dimensions), a uint64 counter past 2^63 in an update, buffers sent with requires_grad, a
Flower Array declaring its dtype with a str subclass or holding a non-contiguous memoryview, and a reply's floating
value for the model's integer counter (refused, as a count is not a measurement)."""
from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import fastagg
from fastagg import flower as fa
from fastagg import server
from fastagg.flower.records import ReplyError, array_view


def test_an_entry_integer_in_one_client_and_floating_in_another_is_named():
    g = {"fc.weight": torch.ones(2, 3), "fc.bias": torch.zeros(2)}
    c0 = {"fc.weight": torch.full((2, 3), 2.0), "fc.bias": torch.ones(2), "zz.w": torch.tensor([1, 2])}
    c1 = {"fc.weight": torch.full((2, 3), 4.0), "fc.bias": torch.ones(2), "zz.w": torch.tensor([1.5, 2.5])}
    before = {k: v.clone() for k, v in g.items()}
    with pytest.raises(ValueError, match=r"deltas\[1\] has parameter entries 'zz.w' not in params"):
        fastagg.fedavg_step(deltas=[c0, c1], params=g)
    assert all(torch.equal(g[k], before[k]) for k in g)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_an_entry_with_no_elements_and_one_of_nine_dimensions(backend):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"empty": torch.nn.Linear(0, 3), "fc": torch.nn.Linear(4, 2)})
    clients = []
    for i in range(2):
        c = copy.deepcopy(model)
        with torch.no_grad():
            for p in c.parameters():
                p.add_(1.0 + i)
        clients.append(c.state_dict())
    base = {k: v.clone() for k, v in model.state_dict().items()}
    want = model.fc.bias.detach() + 1.5
    server.FedAvg(model, backend=backend).step(clients, base=base)
    torch.testing.assert_close(model.fc.bias.detach(), want)
    shape = (1, 2, 1, 2, 1, 1, 2, 1, 1)
    g = {"a.weight": torch.zeros(shape), "b.weight": torch.zeros(4)}
    cs = [{"a.weight": torch.full(shape, float(i)), "b.weight": torch.full((4,), float(i))} for i in range(2)]
    fastagg.fedavg_step(deltas=cs, params=g, backend=backend)
    assert torch.equal(g["a.weight"], torch.full(shape, 0.5))


def test_a_uint64_counter_past_2_63_in_an_update_does_not_wrap():
    g = {"w": torch.zeros(3), "bn.num_batches_tracked": torch.tensor(1000)}
    cs = [{"w": torch.ones(3), "bn.num_batches_tracked": torch.tensor(4)} for _ in range(3)]
    cs.append({"w": torch.ones(3), "bn.num_batches_tracked": torch.tensor(2 ** 63 + 5, dtype=torch.uint64)})
    server.FedAvg(g).step(cs)
    advance = (3 * 4.0 + float(2 ** 63 + 5)) / 4  # the updates' weighted average in float64, then rounded
    assert g["bn.num_batches_tracked"].item() == 1000 + int(round(advance))


def test_buffers_sent_with_requires_grad_are_values():
    g = {"w": torch.zeros(3), "bn.running_mean": torch.zeros(2)}
    cs = [{"w": torch.ones(3), "bn.running_mean": torch.ones(2, requires_grad=True) * 2} for _ in range(2)]
    fastagg.fedavg_step(models=cs, params=g)
    assert g["bn.running_mean"].tolist() == [2.0, 2.0] and not g["bn.running_mean"].requires_grad
    acc = fastagg.Accumulator(like=g)
    assert acc.add(cs[0], weight=1.0, base=g)


def test_a_str_subclass_declaring_the_dtype_never_reuses_a_kept_plan():
    class Liar(str):
        def __hash__(self):
            return hash("<f4")

        def __eq__(self, other):
            return True

    good = Array(np.arange(12, dtype=np.float32).reshape(3, 4))
    good.dtype = "<f4"  # (what Liar hashes as)
    array_view(good, "first")
    bad = Array(dtype=Liar("<f8"), shape=(3, 4), stype=good.stype, data=good.data)
    with pytest.raises(ReplyError, match="second declares dtype <f8"):
        array_view(bad, "second")


def test_a_non_contiguous_memoryview_is_a_reply_error():
    good = Array(np.arange(12, dtype=np.float32))
    bad = Array(dtype="float32", shape=(12,), stype=good.stype, data=good.data)
    bad.data = memoryview(bytes(good.data) * 2)[::2]
    with pytest.raises(ReplyError, match="not a valid .npy header"):
        array_view(bad, "reply['w']")


def test_a_reply_s_floating_counter_is_refused_not_cast():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    logging.getLogger("flwr").setLevel(logging.WARNING)

    class Grid:
        def get_node_ids(self):
            return [1, 2]

    model = {"fc.weight": np.ones((2, 3), np.float32), "bn.num_batches_tracked": np.array(3, np.int64)}
    s = fa.FedAvg(min_available_nodes=1)
    arrays = ArrayRecord({k: Array(v) for k, v in model.items()})
    msgs = sorted(s.configure_train(1, arrays, ConfigRecord(), Grid()), key=lambda m: m.metadata.dst_node_id)
    replies = []
    for node, m in enumerate(msgs, 1):
        sent = dict(model)
        if node == 2:
            sent["bn.num_batches_tracked"] = np.array(7.9)  # float64 for the int64 counter
        replies.append(Message(content=RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in sent.items()}),
                                                   "metrics": MetricRecord({"num-examples": 10})}), reply_to=m))
    with pytest.raises(Exception, match=r"'bn.num_batches_tracked'\] has shape \(\) dtype float64; the global "
                                        r"model's is shape \(\) dtype int64"):
        s.aggregate_train(1, replies)


def _shrunk(t: torch.Tensor, nbytes: int = 0) -> torch.Tensor:
    t.untyped_storage().resize_(nbytes)
    return t


@pytest.mark.parametrize("kind, match", [
    ("neg", "lazily negated or conjugated view"),
    ("zero", "efficient zero tensor"),
    ("shrunk", "needs 16 bytes of storage but its storage holds 0"),
    ("short", "needs 16 bytes of storage but its storage holds 8"),  # (still allocated: a nonzero address)
])
@pytest.mark.parametrize("form", ["state_dict", "flat", "params"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_tensors_whose_memory_is_not_their_values_are_refused(kind, match, form, backend):
    """Older than the wave (the same review): the compiled pass read a negated view's stored bytes (3.0 where the
    reference gave 2.0), and a tensor whose storage was shrunk under it past the storage's end."""
    make = {"neg": lambda: torch._neg_view(torch.full((4,), 5.0)), "zero": lambda: torch._efficientzerotensor(4),
            "shrunk": lambda: _shrunk(torch.full((4,), 7.0)), "short": lambda: _shrunk(torch.full((4,), 7.0), 8)}[kind]
    g = {"w": torch.zeros(4), "b": torch.zeros(3)}
    cs = [{"w": torch.full((4,), 1.0 + i), "b": torch.full((3,), 2.0)} for i in range(2)]
    if form == "state_dict":
        cs[1]["w"] = make()
    elif form == "params":
        g["w"] = make()
    before = {k: v.clone() for k, v in g.items() if not (form == "params" and k == "w")}
    with pytest.raises(ValueError, match=match):
        if form == "flat":
            fastagg.fedavg_step(deltas=[torch.ones(4), make()], params=torch.zeros(4), backend=backend)
        else:
            fastagg.fedavg_step(deltas=cs, params=g, backend=backend)
    assert all(torch.equal(g[k], v) for k, v in before.items())


@pytest.mark.parametrize("kind, match", [
    ("freed", "needs 16 bytes of storage but its storage holds 0"),  # (read freed memory: SIGSEGV before)
    ("short", "needs 16 bytes of storage but its storage holds 8"),  # (read past the allocation: garbage before)
    ("zero", "efficient zero tensor"),
])
@pytest.mark.parametrize("entry", ["bn.running_var", "bn.num_batches_tracked"])
@pytest.mark.parametrize("how", ["step", "functional", "accumulator"])
def test_a_client_buffer_whose_memory_is_not_its_values_is_refused(kind, match, entry, how):
    """The review of issue 42's shortcut: a client's BatchNorm buffer with its storage freed or shrunk under it
    was read past its memory (the parameters' memory was checked, the buffers' not), in the code before the wave
    too. Refused naming the client and entry; nothing written."""
    g = {"fc.weight": torch.ones(2, 3), "bn.running_var": torch.ones(4),
         "bn.num_batches_tracked": torch.tensor(7, dtype=torch.int64)}
    cs = [{k: v + 1 for k, v in g.items()} for _ in range(3)]
    if kind == "zero":
        t = torch._efficientzerotensor(g[entry].shape, dtype=g[entry].dtype)
    elif entry == "bn.running_var":
        t = _shrunk(torch.full((4,), 2.0), 0 if kind == "freed" else 8)  # 16 bytes needed
    else:  # the counter as the second int64 of its storage (16 bytes needed)
        t = torch.tensor([8, 8], dtype=torch.int64)[1]
        _shrunk(t, 0 if kind == "freed" else 8)
    cs[1][entry] = t
    before = {k: v.clone() for k, v in g.items()}
    with pytest.raises(ValueError, match=match) as err:
        if how == "step":
            server.FedAvg(g).step(cs, base={k: v.clone() for k, v in before.items()})
        elif how == "functional":
            fastagg.fedavg_step(models=cs, params=g)
        else:
            acc = fastagg.Accumulator(like=g)
            for c in cs:
                acc.add(c, base=before)
    assert entry in str(err.value)
    assert all(torch.equal(g[k], v) for k, v in before.items())


def test_an_efficient_zero_tensor_without_elements_is_refused_as_the_general_path_does():
    """The review: the shortcut took a zero tensor with no elements (no address to check) that the general path
    refuses; both refuse it now."""
    g = {"w": torch.zeros(3), "e": torch.zeros(0)}
    cs = [{"w": torch.ones(3), "e": torch.zeros(0)} for _ in range(2)]
    cs[1]["e"] = torch._efficientzerotensor((0,))
    for clients in (cs, [list(c.values()) for c in cs]):
        params = g if isinstance(clients[0], dict) else list(g.values())
        with pytest.raises(ValueError, match="efficient zero tensor"):
            fastagg.fedavg_step(models=clients, params=params)
