"""The streaming accumulator and the from-sums step give the batched call's result."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastagg
from fastagg import server
from fastagg.testing import assert_close, assert_round_close, assert_unchanged, cpu_backends, snapshot, tolerance

BACKENDS = cpu_backends()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("eps_mode", ["paper", "official"])
def test_accumulator_equals_batched(backend, dtype, eps_mode):
    g = torch.Generator().manual_seed(0)
    m, d = 6, 5003
    deltas = torch.randn(m, d, generator=g).to(dtype)
    n = [120, 30, 0, 500, 7, 64]
    w0 = torch.randn(d, generator=g).to(dtype)
    p_batch, p_stream = w0.clone(), w0.clone()
    batched = fastagg.fedexp_step(deltas, eps=1e-2, eps_mode=eps_mode, weights=n, params=p_batch, backend=backend)
    acc = fastagg.Accumulator(like=w0, backend=backend)
    for delta, weight in zip(deltas, n):
        before = snapshot(delta)
        assert acc.add(delta, weight=weight)
        assert_unchanged(before, delta, "delta")
    streamed = acc.fedexp_step(eps=1e-2, eps_mode=eps_mode, params=p_stream)
    assert_round_close(streamed, batched, dtype)
    rt, at = tolerance(dtype, "params")
    assert_close(p_stream, p_batch, rtol=rt, atol=at, name="params")
    assert_close(streamed.eval_params, batched.eval_params, rtol=rt, atol=at, name="eval_params")
    assert streamed.num_clients == m


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulator_per_layer_numpy_and_fedavg(backend):
    rng = np.random.default_rng(1)
    like = [np.zeros((4, 5), np.float32), np.zeros(3, np.float32)]
    clients = [[rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal(3).astype(np.float32)]
               for _ in range(4)]
    acc = fastagg.Accumulator(like=like, backend=backend)
    for c in clients:
        acc.add(c, weight=2.0)
    res = acc.fedavg_step(lr=1.0)
    batched = fastagg.fedavg_step(clients, lr=1.0, backend=backend)
    assert isinstance(res.mean[0], np.ndarray) and res.mean[0].shape == (4, 5)
    for a, b in zip(res.mean, batched.mean):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    acc.reset()
    assert acc.num_clients == 0 and float(np.abs(acc.weighted_sum[0]).max()) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_from_sums_equals_batched(backend):
    g = torch.Generator().manual_seed(2)
    m, d = 5, 777
    deltas = torch.randn(m, d, generator=g, dtype=torch.float64)
    n = torch.tensor([3.0, 1.0, 4.0, 1.0, 5.0], dtype=torch.float64)
    batched = fastagg.fedexp_step(deltas, eps=0.5, eps_mode="official", weights=n, backend=backend)
    s = n @ deltas
    sq = float((n * deltas.square().sum(1)).sum())
    before = snapshot(s)
    res = fastagg.fedexp_step_from_sums(s, sq, float(n.sum()), m, eps=0.5, eps_mode="official", backend=backend)
    assert_unchanged(before, s, "weighted_sum")
    for f in ("mean_flat", "mean_sq_norm", "avg_sq_norm", "eta", "update_flat"):
        assert_close(getattr(res, f), getattr(batched, f), rtol=1e-12, atol=1e-12, name=f)
    assert res.sq_norms is None
    # a non-finite sum is refused like a non-finite client
    s[3] = float("inf")
    with pytest.raises(ValueError, match=r"weighted_sum\[0\] contain NaN or Inf"):
        fastagg.fedexp_step_from_sums(s, sq, 14.0, m, eps=0.5, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_with_a_base_folds_model_minus_base(backend):
    """``add(model, base=sent)``: the update is formed inside the kernel; buffers fold their advance over the base."""
    g = torch.Generator().manual_seed(0)
    glob = {"w": torch.randn(5, 3, generator=g), "bn.running_mean": torch.randn(3, generator=g),
            "bn.num_batches_tracked": torch.tensor(7)}
    models = [{k: (v + torch.randn(v.shape, generator=g) if v.is_floating_point() else v + 3 + i)
               for k, v in glob.items()} for i in range(3)]
    a, b = fastagg.Accumulator(glob, backend=backend), fastagg.Accumulator(glob, backend=backend)
    for i, m in enumerate(models):
        a.add(m, weight=i + 1, base=glob)
        b.add({k: m[k] - glob[k] for k in m}, weight=i + 1)
    for x, y in zip(a.weighted_sum.values(), b.weighted_sum.values()):
        assert_close(x, y, rtol=1e-6, atol=1e-6, name="weighted sum")
    assert_close(a.weighted_sq_norm_sum, b.weighted_sq_norm_sum, rtol=1e-6, atol=0, name="weighted sq norms")
    w1, w2 = {k: v.clone() for k, v in glob.items()}, {k: v.clone() for k, v in glob.items()}
    from fastagg import server
    server.FedAvg(w1, backend=backend).step(a)
    server.FedAvg(w2, backend=backend).step(b)
    for k in w1:
        assert_close(w1[k], w2[k], rtol=1e-6, atol=1e-6, name=k)
    with pytest.raises(ValueError, match="base"):
        a.add(models[0], base=dict(glob, w=torch.zeros(2)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_takes_the_spare_sum_as_its_mean_and_later_adds_do_not_touch_it(backend):
    """The step's mean is written into the accumulator's spare buffer (no fresh d-vector at the end of a round) and
    handed over: a later add allocates a new spare, so the returned mean and the optimizer's round are not changed
    by it, and steps after more adds equal steps of a fresh accumulator of the same clients."""
    g = torch.Generator().manual_seed(5)
    d = 4099
    xs = [torch.randn(d, generator=g, dtype=torch.float64) for _ in range(3)]
    acc = fastagg.Accumulator(like=xs[0], backend=backend)
    acc.add(xs[0], 2.0)
    acc.add(xs[1], 1.0)
    spare = acc._scratch
    res = acc.fedexp_step(eps=1e-3, params=torch.zeros(d, dtype=torch.float64))
    assert res.mean_flat.data_ptr() == spare.data_ptr()
    kept = res.mean_flat.clone()
    acc.add(xs[2], 3.0)
    assert torch.equal(res.mean_flat, kept)
    fresh = fastagg.Accumulator(like=xs[0], backend=backend)
    for x, n in zip(xs, (2.0, 1.0, 3.0)):
        fresh.add(x, n)
    a, b = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    opt_a, opt_b = server.FedAdam(a, backend=backend), server.FedAdam(b, backend=backend)
    st = opt_a.step(acc)
    opt_b.step(fresh)
    assert not opt_a._means  # the optimizer kept no mean buffer of its own
    acc.add(xs[0] * 0.5, 1.0, client_id="late")
    assert torch.equal(a, b)
    assert st.num_clients == 3
    torch.testing.assert_close(acc.fedavg_step().mean_flat,
                               (2 * xs[0] + xs[1] + 3 * xs[2] + 0.5 * xs[0]) / 7.0, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_server_optimizer_gives_the_spare_back_after_its_step(backend):
    """Round after round on one accumulator (reset() between rounds), an optimizer borrows the spare as its mean
    and returns it: the accumulator's two buffers are the only model-sized ones, and the rounds equal fresh
    accumulators' (SCAFFOLD borrows from two accumulators at once)."""
    g = torch.Generator().manual_seed(9)
    d = 3001
    acc, ctl = fastagg.Accumulator(like=torch.zeros(d), backend=backend), fastagg.Accumulator(like=torch.zeros(d),
                                                                                             backend=backend)
    w, ref_w = torch.zeros(d), torch.zeros(d)
    opt, ref = server.FedAdam(w, backend=backend), server.FedAdam(ref_w, backend=backend)
    sc_w, sc_ref_w = torch.zeros(d), torch.zeros(d)
    sc, sc_ref = server.Scaffold(sc_w, num_clients=4, backend=backend), server.Scaffold(sc_ref_w, num_clients=4,
                                                                                      backend=backend)
    buffers = None
    for rnd in range(3):
        xs = [torch.randn(d, generator=g) * 0.1 for _ in range(3)]
        acc.reset()
        ctl.reset()
        fresh, fresh_ctl = (fastagg.Accumulator(like=torch.zeros(d), backend=backend) for _ in range(2))
        for x in xs:
            for a in (acc, fresh):
                a.add(x, 1.0)
            for a in (ctl, fresh_ctl):
                a.add(0.5 * x, 1.0)
        opt.step(acc)
        ref.step(fresh)
        assert torch.equal(w, ref_w)
        sc.step(acc, ctl)
        sc_ref.step(fresh, fresh_ctl)
        assert torch.equal(sc_w, sc_ref_w)
        now = {acc._sum.data_ptr(), acc._scratch.data_ptr(), ctl._sum.data_ptr(), ctl._scratch.data_ptr()}
        assert len(now) == 4 and (buffers is None or now == buffers)
        buffers = now
    assert not opt._means and not opt._borrowed


@pytest.mark.parametrize("backend", cpu_backends())
def test_an_accumulator_without_client_norms_steps_the_fedavg_family_alike_and_refuses_the_rest(backend):
    """``client_norms=False`` (the FedAvg family's sums alone): dense and compressed adds fold to the same sum, bit
    for bit, and FedAvg / FedAvgM / FedAdam step on it exactly as on an accumulator that keeps the norms; the norms,
    FedExP (functional and optimizer) and q-FedAvg are refused by name, and nothing changes."""
    from fastagg.compress import quantize_int8
    from fastagg.compress.codebook import Codebook8

    g = torch.Generator().manual_seed(3)
    d = 5003
    xs = [torch.randn(d, generator=g) * (1 + i) for i in range(4)]
    book = torch.sort(torch.randn(256, generator=g)).values
    cb = Codebook8(torch.randint(0, 256, (d,), generator=g, dtype=torch.uint8), torch.rand(2, generator=g) + 0.5,
                   4096, book)
    accs = [fastagg.Accumulator(like=torch.zeros(d), backend=backend, client_norms=n) for n in (True, False)]
    for acc in accs:
        acc.add(xs[0], 2.0)
        acc.add_many([quantize_int8(xs[1], 64), cb], [1.0, 3.0])
        acc.add_many(xs[2:], [1.0, 0.5])
    full, bare = accs
    assert torch.equal(bare.weighted_sum, full.weighted_sum) and bare.total_weight == full.total_weight
    assert bare.client_norms is False and "client_norms=False" in repr(bare)
    for name, kw in (("FedAvg", {}), ("FedAvgM", {"momentum": 0.9}), ("FedAdam", {"lr": 0.1})):
        ws = [torch.zeros(d), torch.zeros(d)]
        for w, acc in zip(ws, accs):
            getattr(server, name)(w, backend=backend, **kw).step(acc)
        assert torch.equal(ws[0], ws[1]), name
    for what in ("sq_norms", "weighted_sq_norm_sum"):
        with pytest.raises(RuntimeError, match="client_norms=False"):
            getattr(bare, what)
    with pytest.raises(RuntimeError, match="client_norms=False"):
        bare.fedexp_step(eps=1e-3)
    w = torch.zeros(d)
    for opt in (server.FedExP(w, eps=1e-3, backend=backend), server.FedExPM(w, eps=1e-3, backend=backend)):
        with pytest.raises(RuntimeError, match="client_norms=False"):
            opt.step(bare)
    assert torch.equal(w, torch.zeros(d))
    assert torch.equal(full.fedavg_step(params=torch.zeros(d)).update, bare.fedavg_step(params=torch.zeros(d)).update)
    with pytest.raises(TypeError, match="client_norms"):
        fastagg.Accumulator(like=torch.zeros(d), client_norms=1)


def test_client_norms_travel_with_state_dicts_and_merges():
    """A state saved without norms loads into an accumulator without them (not into one that keeps them: its steps
    would read norms that were never summed); one that keeps norms merges an accumulator without them only if it
    keeps none itself."""
    d = 301
    x = torch.arange(d, dtype=torch.float32)
    bare, full = (fastagg.Accumulator(like=torch.zeros(d), client_norms=n) for n in (False, True))
    bare.add(x, 2.0, client_id="a")
    full.add(x, 1.0, client_id="b")
    state = bare.state_dict()
    again = fastagg.Accumulator(like=torch.zeros(d), client_norms=False)
    again.load_state_dict(state)
    assert torch.equal(again.weighted_sum, bare.weighted_sum) and again.client_ids == ["a"]
    keeper = fastagg.Accumulator(like=torch.zeros(d))
    with pytest.raises(ValueError, match="client_norms=False"):
        keeper.load_state_dict(state)
    assert keeper.num_clients == 0
    forged = dict(state, client_norms="no")
    with pytest.raises(ValueError, match="client_norms"):
        again.load_state_dict(forged)
    flipped = dict(state)
    del flipped["client_norms"]  # the checksum covers the flag: a state that lost it is refused
    with pytest.raises(ValueError, match="checksum"):
        again.load_state_dict(flipped)
    bare_from_full = fastagg.Accumulator(like=torch.zeros(d), client_norms=False)
    bare_from_full.load_state_dict(full.state_dict())
    assert bare_from_full.client_ids == ["b"]
    with pytest.raises(ValueError, match="client_norms=False"):
        full.merge(bare)
    assert full.client_ids == ["b"]
    bare.merge(full)
    assert bare.client_ids == ["a", "b"] and torch.equal(bare.weighted_sum, 3 * x)


@pytest.mark.parametrize("backend", cpu_backends())
def test_a_new_round_reads_as_zeros_though_its_buffer_is_written_only_when_needed(backend):
    """reset() leaves the new sum's zeros unwritten (a round of compressed clients writes the sum in its first fold
    without reading it); every reader sees zeros all the same: the sum, a dense add, a merge, a state_dict, and a
    compressed fold never picks up the old round's values left in the buffer."""
    from fastagg.compress import dequantize, quantize_int8

    g = torch.Generator().manual_seed(5)
    d = 4099
    x, y = torch.randn(d, generator=g), torch.randn(d, generator=g)
    q = quantize_int8(y, 128)
    acc = fastagg.Accumulator(like=torch.zeros(d), backend=backend)
    for reader in ("sum", "dense", "compressed", "state", "merge"):
        acc.reset()
        acc.add(x * 7, 1.0)
        acc.add(x, 1.0)  # both buffers now hold old values
        acc.reset()
        if reader == "sum":
            assert torch.equal(acc.weighted_sum, torch.zeros(d))
        elif reader == "dense":
            acc.add(y, 1.0)
            assert torch.equal(acc.weighted_sum, y)
        elif reader == "compressed":
            acc.add(q, 2.0)
            assert_close(acc.weighted_sum, 2 * dequantize(q), rtol=1e-6, atol=1e-6, name="sum")
        elif reader == "state":
            assert torch.equal(acc.state_dict()["sum"], torch.zeros(d))
        else:
            other = fastagg.Accumulator(like=torch.zeros(d), backend=backend)
            other.add(y, 1.0)
            other.reset()
            other.add(y, 1.0, client_id="y")
            acc.merge(other)
            assert torch.equal(acc.weighted_sum, y)


def test_an_accumulator_does_not_keep_its_like_alive():
    """``like`` describes the updates (layout, dtype, device): the accumulator keeps that, not the tensor, so a model
    handed to it as ``like`` and then dropped or replaced is freed."""
    import gc
    import weakref

    w = {"a.weight": np.zeros((1000, 10), np.float32), "a.bias": np.zeros(10, np.float32)}  # (torch views of numpy
    refs = [weakref.ref(t) for t in w.values()]  # arrays keep the arrays themselves alive: weakrefs can see that)
    acc = fastagg.Accumulator(like=w)
    del w
    gc.collect()
    assert all(r() is None for r in refs)
    acc.add({"a.weight": np.ones((1000, 10), np.float32), "a.bias": np.ones(10, np.float32)})
    assert acc.num_clients == 1 and float(acc.weighted_sum["a.bias"][0]) == 1.0
