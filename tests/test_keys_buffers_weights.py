"""Safety round 2 (issue 19): keys matched by name, buffers checked before any write, buffers never written as
Inf or a wrapped integer, weights that would overflow a round's total. Each case is tried as a user or an attacker
would: a client that sends a wrong-shaped or mistyped buffer, the same keys in another order, a counter at its
maximum, weights of 1e308."""
from __future__ import annotations

import pytest
import torch

import fastagg
from fastagg import server
from fastagg.testing import assert_close, assert_unchanged, batchnorm_models, cpu_backends, snapshot

BACKENDS = cpu_backends()


def _reordered(sd: dict) -> dict:
    return dict(reversed(list(sd.items())))


# ---- client buffers: checked before anything is written --------------------------------------------------------


def _bad_buffer_cases(base: dict, models: list):
    wrong_shape = [{**m, "1.running_mean": m["1.running_mean"][:3]} for m in models]
    float_counter = [{**m, "1.num_batches_tracked": m["1.num_batches_tracked"].double() + 0.5} for m in models]
    complex_stat = [{**m, "1.running_var": m["1.running_var"].to(torch.complex128)} for m in models]
    return [("shape", wrong_shape, ValueError), ("float counter", float_counter, TypeError),
            ("complex", complex_stat, TypeError)]


@pytest.mark.parametrize("name", ["FedAvg", "FedAdam", "FedAvgM"])
@pytest.mark.parametrize("case", ["shape", "float counter", "complex"])
def test_a_bad_client_buffer_is_refused_before_params_or_state_change(name, case):
    base, models = batchnorm_models(3, seed=1)
    w = {k: v.clone() for k, v in base.items()}
    opt = getattr(server, name)(w)
    opt.step(models, base=base)  # one good round: state exists
    bad = dict((c, (m, e)) for c, m, e in _bad_buffer_cases(base, models))[case]
    before, state_before = snapshot(w), snapshot(opt.state_dict())
    with pytest.raises(bad[1]):
        opt.step(bad[0], base=base)
    assert_unchanged(before, w, "params")
    assert_unchanged(state_before["state"], opt.state_dict()["state"], "optimizer state")


@pytest.mark.parametrize("case", ["shape", "float counter", "complex"])
def test_the_functional_step_refuses_a_bad_buffer_before_writing(case):
    base, models = batchnorm_models(3, seed=2)
    w = {k: v.clone() for k, v in base.items()}
    bad = dict((c, (m, e)) for c, m, e in _bad_buffer_cases(base, models))[case]
    before = snapshot(w)
    with pytest.raises(bad[1]):
        fastagg.fedexp_step(models=bad[0], eps=1e-3, params=w)
    assert_unchanged(before, w, "params")


@pytest.mark.parametrize("case", ["shape", "float counter", "complex"])
def test_an_accumulator_refuses_a_bad_buffer_at_add(case):
    base, models = batchnorm_models(3, seed=3)
    acc = fastagg.Accumulator(like=base)
    acc.add(models[0], 1.0, base=base)
    bad = dict((c, (m, e)) for c, m, e in _bad_buffer_cases(base, models))[case]
    before = snapshot(acc.state_dict())
    with pytest.raises(bad[1]):
        acc.add(bad[0][1], 1.0, base=base)
    assert acc.num_clients == 1
    after = acc.state_dict()
    assert_unchanged(before["sum"], after["sum"]) and before["client_ids"] == after["client_ids"]


def test_a_base_with_a_wrong_shaped_buffer_is_not_broadcast():
    """add(base=) formed ``b - base_b`` by broadcasting: a base buffer of shape (1,) was silently accepted."""
    base, models = batchnorm_models(2, seed=4)
    acc = fastagg.Accumulator(like=base)
    bad_base = {**base, "1.running_var": base["1.running_var"][:1]}
    with pytest.raises(ValueError, match="shape"):
        acc.add(models[0], 1.0, base=bad_base)
    assert acc.num_clients == 0


def test_an_accumulator_buffer_of_another_shape_than_the_params_is_refused_before_writing():
    base, models = batchnorm_models(2, seed=5)
    acc = fastagg.Accumulator(like=base)
    for m in models:
        acc.add(m, 1.0, base=base)
    w = {k: v.clone() for k, v in base.items()}
    w["1.running_mean"] = torch.zeros(7, dtype=torch.float64)  # a global model whose buffer is another size
    before = snapshot(w)
    with pytest.raises(ValueError, match="running_mean"):
        server.FedAvg(w).step(acc)
    assert_unchanged(before, w, "params")


# ---- averaged buffers never become Inf or a wrapped integer ----------------------------------------------------


class _Counters(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("steps", torch.tensor(2**63 - 10, dtype=torch.int64))
        self.register_buffer("small", torch.tensor([250, 3], dtype=torch.uint8))
        self.register_buffer("stat16", torch.tensor([60000.0, 1.0], dtype=torch.float16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffers_that_would_overflow_or_wrap_keep_their_old_values(backend):
    """The global model is the module (its buffers known by name); clients send state_dicts whose buffers average
    to values the buffers' dtypes cannot hold: an int64 counter past INT64_MAX, a uint8 past 255, a float16
    statistic past 65504. Each keeps its old value; the parameters still take the step."""
    net = _Counters()
    base = {k: v.clone() for k, v in net.state_dict().items()}
    clients = []
    for i in range(2):
        sd = {k: v.clone() for k, v in base.items()}
        sd["lin.weight"] = sd["lin.weight"] + 0.1
        sd["steps"] = torch.tensor(2**63 - 1, dtype=torch.int64)  # advance 9: fine once, past INT64_MAX twice
        sd["small"] = torch.tensor([255, 4], dtype=torch.uint8)
        sd["stat16"] = torch.tensor([65504.0, 2.0], dtype=torch.float16)  # float16's largest finite value
        clients.append(sd)
    server.FedAvg(net, lr=1.0, backend=backend).step(clients, base=base)
    assert int(net.steps) == 2**63 - 1 and net.small.tolist() == [255, 4]
    assert net.stat16.tolist() == [65504.0, 2.0]
    assert_close(net.lin.weight, base["lin.weight"] + 0.1, rtol=1e-6, atol=1e-6, name="weight")
    # the clients' buffers now advance past what the dtypes hold: every buffer keeps its value
    base2 = {k: v.clone() for k, v in net.state_dict().items()}
    again = []
    for sd in clients:
        sd = {k: v.clone() for k, v in base2.items()}
        sd["steps"] = torch.tensor(2**63 - 1, dtype=torch.int64)
        sd["small"] = torch.tensor([255, 4], dtype=torch.uint8)
        again.append(sd)
    base2["steps"] = torch.tensor(2**63 - 20, dtype=torch.int64)  # advance 19 from INT64_MAX: would wrap
    base2["small"] = torch.tensor([10, 4], dtype=torch.uint8)  # advance 245 from 255: would wrap
    base2["stat16"] = torch.tensor([-65504.0, 2.0], dtype=torch.float16)  # advance 131008 from 65504: Inf
    again = [{**sd, "stat16": torch.tensor([65504.0, 2.0], dtype=torch.float16)} for sd in again]
    server.FedAvg(net, lr=1.0, backend=backend).step(again, base=base2)
    assert int(net.steps) == 2**63 - 1, "the counter wrapped"
    assert net.small.tolist() == [255, 4]
    assert torch.isfinite(net.stat16).all() and net.stat16.tolist() == [65504.0, 2.0]


# ---- keys matched by name ----------------------------------------------------------------------------------


def test_merge_matches_entries_and_buffers_by_key():
    base, models = batchnorm_models(4, seed=6)
    a, b = fastagg.Accumulator(like=base), fastagg.Accumulator(like=_reordered(base))
    ref = fastagg.Accumulator(like=base)
    for i, m in enumerate(models):
        (a if i < 2 else b).add(m if i < 2 else _reordered(m), float(i + 1),
                                base=base if i < 2 else _reordered(base))
        ref.add(m, float(i + 1), base=base)
    a.merge(b)
    for k in base:
        if k in a.weighted_sum:
            assert_close(a.weighted_sum[k], ref.weighted_sum[k], rtol=1e-12, atol=1e-15, name=k)
    w1, w2 = ({k: v.clone() for k, v in base.items()} for _ in range(2))
    a.fedavg_step(params=w1)
    ref.fedavg_step(params=w2)
    for k in w1:
        assert_close(w1[k], w2[k], rtol=1e-12, atol=1e-15, name=k)


def test_load_state_dict_matches_by_key_and_refuses_other_keys():
    base, models = batchnorm_models(3, seed=7)
    src = fastagg.Accumulator(like=_reordered(base))
    for i, m in enumerate(models):
        src.add(_reordered(m), float(i + 1), base=_reordered(base), client_id=f"c{i}")
    dst = fastagg.Accumulator(like=base)
    dst.load_state_dict(src.state_dict())
    for k in dst.weighted_sum:
        assert_close(dst.weighted_sum[k], src.weighted_sum[k], rtol=0, atol=0, name=k)
    assert dst.client_ids == ["c0", "c1", "c2"]
    other = {("x." + k): v for k, v in base.items()}
    stranger = fastagg.Accumulator(like=other)
    with pytest.raises(ValueError, match="entries"):
        stranger.load_state_dict(src.state_dict())
    assert stranger.num_clients == 0


def test_merge_refuses_accumulators_of_other_keys():
    base, models = batchnorm_models(2, seed=8)
    other = {("x." + k): v for k, v in base.items()}
    a, b = fastagg.Accumulator(like=base), fastagg.Accumulator(like=other)
    b.add({("x." + k): v for k, v in models[0].items()}, 1.0)
    with pytest.raises(ValueError):
        a.merge(b)
    assert a.num_clients == 0


# ---- weights and totals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_weights_never_overflow_the_total(backend):
    d = 101
    acc = fastagg.Accumulator(like=torch.zeros(d, dtype=torch.float64), backend=backend)
    x = torch.full((d,), 1e-300, dtype=torch.float64)
    assert acc.add(x, 1e308, client_id="a")
    with pytest.raises(ValueError, match="overflow the round's total weight"):
        acc.add(x, 1e308, client_id="b")
    assert acc.add(x, 1e308, client_id="c", on_nonfinite="skip") is False
    assert acc.client_ids == ["a"] and acc.total_weight == 1e308
    assert acc.add(x, 1.0, client_id="d")
    w = torch.zeros(d, dtype=torch.float64)
    acc.fedavg_step(params=w)
    assert torch.isfinite(w).all()
    again = fastagg.Accumulator(like=torch.zeros(d, dtype=torch.float64), backend=backend)
    again.load_state_dict(acc.state_dict())  # the round stays loadable
    assert again.client_ids == ["a", "d"]


# ---- optimizer checkpoints keep their rule's invariants --------------------------------------------------------


@pytest.mark.parametrize("name, entry", [("FedAdagrad", "v"), ("FedAdam", "v"), ("FedYogi", "v"), ("FedAMS", "v"),
                                         ("FedAMS", "vhat")])
def test_a_checkpoint_with_a_negative_second_moment_is_refused(name, entry):
    """A second moment is a sum of squares: a checkpoint holding a negative one (FedAdagrad then took a ~1400x
    step) is refused at load, and the optimizer keeps its state."""
    w = torch.zeros(64)
    opt = getattr(server, name)(w, lr=0.1)
    opt.step(torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 0.1)
    sd = opt.state_dict()
    st = sd["state"][0]  # the one parameter's state (torch's shape)
    st[entry] = st[entry].clone()
    st[entry][5] = -0.999 * float(st[entry].abs().max() + 1e-3)
    before = snapshot(opt.state_dict()["state"])
    with pytest.raises(ValueError, match="negative"):
        opt.load_state_dict(sd)
    assert_unchanged(before, opt.state_dict()["state"], "state")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_finite_client_too_large_to_ever_step_is_refused_and_the_round_steps(backend):
    """A client of finite float32 values near 3e38 (its norm passes float32's range): folded in, no step of the
    round could be taken, so one client would stop the round; it is refused like a NaN client instead."""
    d = 1000
    acc = fastagg.Accumulator(like=torch.zeros(d), backend=backend)
    honest = [torch.randn(d, generator=torch.Generator().manual_seed(i)) * 0.01 for i in range(3)]
    for i, x in enumerate(honest):
        assert acc.add(x, 1.0, client_id=i)
    huge = torch.full((d,), 3e38)
    assert acc.add(huge, 1.0, client_id="huge", on_nonfinite="skip") is False
    with pytest.raises(ValueError, match="so large that no step could take it"):
        acc.add(huge, 1.0, client_id="huge")
    assert acc.client_ids == [0, 1, 2]
    w = torch.zeros(d)
    res = acc.fedavg_step(params=w)
    assert bool(res.finite)
    assert_close(w, sum(honest) / 3, rtol=1e-5, atol=1e-7, name="params")
