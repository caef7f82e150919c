"""The Accumulator as a server for large models: merging edge accumulators, client ids that make folds idempotent,
and a half-finished round saved, reloaded after a killed process, and continued."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fastagg
from fastagg.testing import SweepCounter, assert_close, batchnorm_models


def _clients(m=6, d=2003, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, d, generator=g, dtype=torch.float64) * 0.1).to(dtype), \
        torch.rand(m, generator=g, dtype=torch.float64) * 10 + 1


def _acc(deltas, weights, ids=None, like=None):
    acc = fastagg.Accumulator(like=deltas[0] if like is None else like)
    for i, (x, n) in enumerate(zip(deltas, weights)):
        acc.add(x, float(n), client_id=None if ids is None else ids[i])
    return acc


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float64, 1e-13, 1e-16), (torch.float32, 2e-6, 1e-7)])
def test_merged_edge_accumulators_step_as_one(dtype, rtol, atol):
    """float32: the sums are added in another order (elements near zero carry the rounding as absolute error)."""
    deltas, weights = _clients(dtype=dtype)
    root, edge = _acc(deltas[:2], weights[:2], ids=["a", "b"]), _acc(deltas[2:], weights[2:], ids=[2, 3, 4, 5])
    edge_sum = torch.as_tensor(edge.weighted_sum).clone()
    root.merge(edge)
    assert root.num_clients == 6 and root.client_ids == ["a", "b", 2, 3, 4, 5]
    assert torch.equal(torch.as_tensor(edge.weighted_sum), edge_sum) and edge.num_clients == 4
    whole = _acc(deltas, weights)
    got, want = root.fedexp_step(eps=1e-3), whole.fedexp_step(eps=1e-3)
    assert_close(got.mean, want.mean, rtol=rtol, atol=atol, name="mean")
    assert float(got.eta) == pytest.approx(float(want.eta), rel=10 * rtol)
    assert torch.equal(torch.as_tensor(got.sq_norms), torch.as_tensor(want.sq_norms))


def test_merge_refuses_what_would_count_twice_or_does_not_match():
    deltas, weights = _clients()
    a, b = _acc(deltas[:3], weights[:3], ids=[0, 1, 2]), _acc(deltas[2:], weights[2:], ids=[2, 3, 4, 5])
    before = torch.as_tensor(a.weighted_sum).clone()
    with pytest.raises(ValueError, match="in both accumulators"):
        a.merge(b)
    assert torch.equal(torch.as_tensor(a.weighted_sum), before) and a.num_clients == 3
    with pytest.raises(ValueError, match="cannot merge itself"):
        a.merge(a)
    with pytest.raises(ValueError, match="has 5 elements"):
        a.merge(fastagg.Accumulator(like=torch.zeros(5, dtype=torch.float64)))
    with pytest.raises(TypeError, match="dtype"):
        a.merge(fastagg.Accumulator(like=torch.zeros(2003)))


def test_a_client_id_is_folded_once():
    deltas, weights = _clients(m=2)
    acc = _acc(deltas[:1], weights[:1], ids=["node-7"])
    before = torch.as_tensor(acc.weighted_sum).clone()
    with pytest.raises(ValueError, match="'node-7' was already folded"):
        acc.add(deltas[1], 3.0, client_id="node-7")
    assert torch.equal(torch.as_tensor(acc.weighted_sum), before) and acc.num_clients == 1
    with pytest.raises(TypeError, match="client_id must be a str or an int"):
        acc.add(deltas[1], 3.0, client_id=1.5)
    acc.reset()
    assert acc.add(deltas[1], 3.0, client_id="node-7")  # a new round


def test_a_half_finished_round_survives_a_killed_process(tmp_path):
    """A server process folds 3 of 6 clients, saves the round, and is killed; a new process loads it, refuses a
    client that resends, folds the other 3 and steps: the same result as one uninterrupted round."""
    path = tmp_path / "round.pt"
    script = textwrap.dedent(f"""
        import os, torch, fastagg
        g = torch.Generator().manual_seed(0)
        deltas = torch.randn(6, 2003, generator=g, dtype=torch.float64) * 0.1
        weights = torch.rand(6, generator=g, dtype=torch.float64) * 10 + 1
        acc = fastagg.Accumulator(like=deltas[0])
        for i in range(3):
            acc.add(deltas[i], float(weights[i]), client_id=f"c{{i}}")
        torch.save(acc.state_dict(), {str(path)!r})
        os._exit(9)  # killed mid-round
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 9, res.stderr
    deltas, weights = _clients()
    resumed = fastagg.Accumulator(like=deltas[0])
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert resumed.client_ids == ["c0", "c1", "c2"]
    with pytest.raises(ValueError, match="'c1' was already folded"):
        resumed.add(deltas[1], float(weights[1]), client_id="c1")
    for i in range(3, 6):
        resumed.add(deltas[i], float(weights[i]), client_id=f"c{i}")
    straight = _acc(deltas, weights, ids=[f"c{i}" for i in range(6)])
    a, b = resumed.fedexp_step(eps=1e-3), straight.fedexp_step(eps=1e-3)
    assert torch.equal(a.mean, b.mean) and float(a.eta) == float(b.eta)


@pytest.mark.parametrize("corrupt, message", [
    (lambda s: s.update(sum=s["sum"][:-1]), "sum must be"),
    (lambda s: s["sum"].__setitem__(5, float("nan")), "non-finite or negative"),
    (lambda s: s.update(client_ids=s["client_ids"][:-1]), "one per client id"),
    (lambda s: s.update(client_ids=["x", "x", "y"]), "ids repeat"),
    (lambda s: s.update(total_weight=-1.0), "non-finite or negative"),
    (lambda s: s.update(numel=7), "7 torch.float64 elements"),
    (lambda s: s.pop("sq_norms"), "no 'sq_norms'"),
    (lambda s: s.update(format=4), "format 1, 2 or 3"),
    (lambda s: s["sum"].__setitem__(5, s["sum"][5] + 1e-9), "checksum"),  # a flipped bit's worth, still finite
    (lambda s: s.update(total_weight=s["total_weight"] + 1.0), "checksum"),
    (lambda s: s.update(client_ids=["x", "y", "q"]), "checksum"),
    (lambda s: s.pop("crc32"), "no 'crc32'"),
])
def test_a_corrupted_round_state_is_refused_and_changes_nothing(corrupt, message):
    deltas, weights = _clients()
    state = _acc(deltas[:3], weights[:3], ids=["x", "y", "z"]).state_dict()
    corrupt(state)
    target = _acc(deltas[3:4], weights[3:4], ids=["w"])
    before = torch.as_tensor(target.weighted_sum).clone()
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    assert torch.equal(torch.as_tensor(target.weighted_sum), before) and target.client_ids == ["w"]


def test_a_state_saved_before_the_checksum_still_loads():
    deltas, weights = _clients()
    src = _acc(deltas[:3], weights[:3], ids=["x", "y", "z"])
    state = src.state_dict()
    del state["crc32"]
    state["format"] = 1
    target = fastagg.Accumulator(like=deltas[0])
    target.load_state_dict(state)
    assert torch.equal(torch.as_tensor(target.weighted_sum), torch.as_tensor(src.weighted_sum))


def test_a_flipped_byte_in_a_saved_round_is_caught(tmp_path):
    """torch.save'd round state with one byte of the sum's data flipped: the file still loads as valid tensors,
    the checksum refuses it."""
    deltas, weights = _clients()
    path = tmp_path / "round.pt"
    torch.save(_acc(deltas[:3], weights[:3]).state_dict(), path)
    raw = bytearray(path.read_bytes())
    marker = torch.as_tensor(_acc(deltas[:3], weights[:3]).weighted_sum).numpy().tobytes()[64:80]
    at = bytes(raw).index(marker)  # inside the sum's data
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))
    state = torch.load(path, weights_only=True)
    target = fastagg.Accumulator(like=deltas[0])
    with pytest.raises(ValueError, match="checksum"):
        target.load_state_dict(state)
    assert target.num_clients == 0


def test_merge_and_state_dict_carry_batchnorm_buffers():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
    sds = []
    for i in range(4):
        sd = {k: v.clone() for k, v in net.state_dict().items()}
        sd["1.running_mean"] += i
        sds.append(sd)
    a, b = _acc(sds[:2], [1.0, 2.0], like=net.state_dict()), _acc(sds[2:], [3.0, 4.0], like=net.state_dict())
    c = fastagg.Accumulator(like=net.state_dict())
    c.load_state_dict(b.state_dict())
    a.merge(c)
    w = {k: v.clone() for k, v in net.state_dict().items()}
    a.fedavg_step(params=w)
    expect = sum(n * float(s["1.running_mean"][0]) for n, s in zip([1, 2, 3, 4], sds)) / 10
    assert float(w["1.running_mean"][0]) == pytest.approx(expect + float(net.state_dict()["1.running_mean"][0]))


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float64, 1e-13, 1e-16), (torch.float32, 2e-6, 1e-7)])
def test_add_many_folds_several_clients_in_one_sweep(dtype, rtol, atol):
    deltas, weights = _clients(m=7, dtype=dtype)
    one_by_one = _acc(deltas, weights, ids=list(range(7)))
    many = fastagg.Accumulator(like=deltas[0])
    assert many.add_many(deltas[:4], weights[:4].tolist(), client_ids=[0, 1, 2, 3]) == [True] * 4
    assert many.add_many(list(deltas[4:]), weights[4:].tolist(), client_ids=[4, 5, 6]) == [True] * 3
    assert many.client_ids == list(range(7)) and many.total_weight == pytest.approx(one_by_one.total_weight)
    a, b = many.fedexp_step(eps=1e-3), one_by_one.fedexp_step(eps=1e-3)
    assert_close(a.mean, b.mean, rtol=rtol, atol=atol, name="mean")
    assert torch.equal(torch.as_tensor(a.sq_norms), torch.as_tensor(b.sq_norms))
    assert float(a.eta) == pytest.approx(float(b.eta), rel=10 * rtol)


def test_add_many_with_a_nan_client_raises_unchanged_or_skips_only_it():
    deltas, weights = _clients(m=4)
    deltas[2, 9] = float("nan")
    acc = _acc(deltas[:1], weights[:1], ids=["first"])
    before = torch.as_tensor(acc.weighted_sum).clone()
    with pytest.raises(ValueError, match=r"deltas\[2\] contains NaN"):
        acc.add_many(deltas, weights.tolist())
    assert torch.equal(torch.as_tensor(acc.weighted_sum), before) and acc.num_clients == 1
    assert acc.add_many(deltas, weights.tolist(), client_ids=["a", "b", "c", "d"], on_nonfinite="skip") == \
        [True, True, False, True]
    assert acc.client_ids == ["first", "a", "b", "d"]
    with pytest.raises(ValueError, match="'a' was already folded"):
        acc.add_many(deltas[:1], [1.0], client_ids=["a"])
    with pytest.raises(ValueError, match="2 clients, 1 weights"):
        acc.add_many(deltas[:2], [1.0])


def test_add_many_folds_full_models_with_batchnorm_in_one_sweep():
    """Full client models (state_dicts with BatchNorm buffers) against the model sent: one sweep, the same sums as
    one add per client; a NaN model raises with nothing folded, or is the only one left out."""
    base, models = batchnorm_models(4, seed=2)
    ws = [1.0, 2.0, 3.0, 4.0]
    one = fastagg.Accumulator(like=base)
    for m, w in zip(models, ws):
        one.add(m, w, base=base)
    many = fastagg.Accumulator(like=base)
    counter = SweepCounter(many)
    assert many.add_many(models, ws, base=base, client_ids=["a", "b", "c", "d"]) == [True] * 4
    assert counter.sweeps == 1
    w1, w2 = ({k: v.clone() for k, v in base.items()} for _ in range(2))
    one.fedavg_step(params=w1)
    many.fedavg_step(params=w2)
    for k in base:
        assert_close(w2[k], w1[k], rtol=1e-13, atol=1e-15, name=k)

    bad = [{k: v.clone() for k, v in m.items()} for m in models[:3]]
    bad[1]["0.bias"][0] = float("nan")
    acc = fastagg.Accumulator(like=base)
    with pytest.raises(ValueError, match=r"models\[1\] contains NaN"):
        acc.add_many(bad, base=base)
    assert acc.num_clients == 0 and torch.count_nonzero(torch.as_tensor(acc.weighted_sum["0.weight"])) == 0
    assert acc.add_many(bad, base=base, on_nonfinite="skip") == [True, False, True] and acc.num_clients == 2


def test_a_model_of_another_architecture_is_refused_naming_what_differs():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    acc = fastagg.Accumulator(like=net)
    with pytest.raises(ValueError, match=r"delta\[0\] has parameter entries 'weight', 'bias' not in the accumulator's"):
        acc.add(torch.nn.Linear(3, 3), 1.0)
    with pytest.raises(ValueError, match=r"lacks parameter entries '0.bias' of the accumulator's `like`"):
        acc.add({k: v for k, v in net.state_dict().items() if k != "0.bias"}, 1.0)
    with pytest.raises(ValueError, match=r"base\[0\] lacks parameter entries '0.bias' of the client models"):
        acc.add(net, 1.0, base={k: v for k, v in net.state_dict().items() if k != "0.bias"})
    assert acc.num_clients == 0


def test_params_that_are_the_accumulators_sum_are_refused_and_nothing_changes():
    """A step whose params are a view of the accumulator's own sum would rewrite the round's sums: refused by the
    functional steps and by a server optimizer, before anything is written."""
    from fastagg import server

    acc = fastagg.Accumulator(like=torch.zeros(10))
    acc.add(torch.ones(10), 2.0)
    view = acc.weighted_sum
    for step in (lambda: acc.fedavg_step(params=view), lambda: acc.fedexp_step(eps=1e-3, params=view),
                 lambda: server.FedAdam(view).step(acc)):
        with pytest.raises(ValueError, match="overlaps the accumulator's sum"):
            step()
        assert torch.equal(torch.as_tensor(acc.weighted_sum), torch.full((10,), 2.0)) and acc.num_clients == 1
