"""The Triton kernels on the device they are for, against the float64 reference computed on the CPU.

On a machine with a CUDA GPU this runs the compiled kernels on the GPU (`pytest tests/test_on_device.py`, the
device check of bench/device_check.sh). Without one, conftest sets TRITON_INTERPRET=1 and the same checks run
the kernels through the interpreter on CPU tensors, so these tests stay tested where CI runs. Shapes are chosen
to cross the kernels' paths on a GPU: several column blocks and a ragged tail, client tiles over M > 8, and
client rows long enough to be split into column chunks as well as many short rows.
"""
from __future__ import annotations

import pytest
import torch

import fastagg
from fastagg import client, server
from fastagg.testing import assert_close, tolerance

# Without CUDA the root conftest has set TRITON_INTERPRET=1, so the triton backend runs on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_fedexp_round_on_device(dtype):
    m, d = 11, 70_001
    deltas = 0.1 * _randn(m, d, seed=1, dtype=dtype)
    params = _randn(d, seed=2, dtype=dtype)
    weights = list(range(1, m + 1))
    w_dev = params.to(DEVICE, copy=True)
    got = fastagg.fedexp_step(deltas.to(DEVICE), eps=1e-3, weights=weights, params=w_dev, backend="triton")
    ref_params = params.double()
    ref = fastagg.fedexp_step(deltas.double(), eps=1e-3, weights=weights, params=ref_params, backend="reference")
    for what, a, b, kind in (("mean", got.mean_flat, ref.mean_flat, "mean"), ("sq_norms", got.sq_norms, ref.sq_norms, "norm"),
                             ("eta", got.eta, ref.eta, "norm"), ("params", w_dev, ref_params.to(dtype), "params"),
                             ("eval", got.eval_params, ref.eval_params.to(dtype), "params")):
        rtol, atol = tolerance(dtype, kind)
        assert_close(a.cpu(), b, rtol=rtol, atol=atol, name=what)


@pytest.mark.parametrize("name,hyper", [("FedAvgM", dict(lr=0.5, momentum=0.9, nesterov=True)),
                                        ("FedExPM", dict(eps=1e-3, beta=0.9)), ("FedACG", dict(lam=0.85)),
                                        ("FedAdam", dict(lr=0.1, tau=1e-3)), ("FedAMS", dict(lr=0.1))])
def test_server_optimizer_on_device(name, hyper):
    d = 50_003
    w0 = _randn(d, seed=3)
    w_dev, w_ref = w0.to(DEVICE, copy=True), w0.double()
    opt = getattr(server, name)(w_dev, backend="triton", **hyper)
    ref = getattr(server, name)(w_ref, backend="reference", **hyper)
    for t, m in enumerate((3, 9, 5)):
        deltas = 0.1 * _randn(m, d, seed=10 + t) + 0.01
        opt.step(deltas.to(DEVICE), weights=list(range(1, m + 1)))
        ref.step(deltas.double(), weights=list(range(1, m + 1)))
        assert_close(w_dev.cpu(), w_ref, rtol=1e-5, atol=1e-5, name=f"{name} params, round {t}")


@pytest.mark.parametrize("m,d", [(64, 1_000), (3, 70_000)], ids=["many short rows", "few long rows (chunks)"])
def test_client_steps_on_device(m, d):
    x0 = _randn(m, d, seed=4)
    grads = [_randn(m, d, seed=5 + t) for t in range(3)]
    losses = 1.0 + torch.rand(m, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ids = torch.arange(m)
    anchor = _randn(d, seed=7)

    def run(device, dtype, backend):
        x = x0.to(device, dtype, copy=True)
        state = client.ClientState(m, d, dtype=dtype, device=device)
        steps = []
        for g in grads:
            g = g.to(device, dtype)
            steps.append(client.sps_step(params=x, grads=g, losses=losses.to(device), c=0.5, gamma_b=0.3,
                                         prox=(anchor.to(device, dtype), 0.01), clip_norm=30.0, backend=backend))
            steps.append(client.local_step(params=x, grads=g, lr=0.05, momentum=0.9, nesterov=True, state=state,
                                           client_ids=ids, weight_decay=1e-3, backend=backend))
            steps.append(client.mass_step(params=x, grads=g, state=state, client_ids=ids, eta1=0.05, gam=0.5,
                                          eta2=0.01, backend=backend))
        return x.cpu(), [s.cpu() for s in steps], {k: v.cpu() for k, v in state.vectors.items()}

    got_x, got_steps, got_state = run(DEVICE, torch.float32, "triton")
    ref_x, ref_steps, ref_state = run("cpu", torch.float64, "reference")
    for t, (a, b) in enumerate(zip(got_steps, ref_steps)):
        assert_close(a, b, rtol=1e-4, atol=1e-7, name=f"steps {t}")
    assert_close(got_x, ref_x, rtol=1e-4, atol=1e-5, name="params")
    for k, v in ref_state.items():
        assert_close(got_state[k], v, rtol=1e-4, atol=1e-5, name=f"state {k}")
