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
