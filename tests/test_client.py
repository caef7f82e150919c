"""Batched client local steps on every backend against the float64 reference, the papers' identities, the
safeguards row by row, per-client state through client_ids, and bad input."""
from __future__ import annotations

import pytest
import torch

from fastagg import client
from fastagg.testing import assert_close, assert_unchanged, cpu_backends, snapshot, threads_env

BACKENDS = cpu_backends()
N, M, D = 9, 4, 1031
IDS = torch.tensor([7, 2, 5, 0])


def problem(dtype=torch.float32, seed=0, m=M, d=D):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g, dtype=torch.float64)
    grads = torch.randn(m, d, generator=g, dtype=torch.float64)
    losses = 1.0 + torch.rand(m, generator=g, dtype=torch.float64)
    anchor = torch.randn(d, generator=g, dtype=torch.float64)
    c = 0.1 * torch.randn(d, generator=g, dtype=torch.float64)
    ci = 0.1 * torch.randn(N, d, generator=g, dtype=torch.float64)
    return dict(x=x.to(dtype), grads=grads.to(dtype), losses=losses, anchor=anchor.to(dtype), c=c, ci=ci)


# name -> (function, kwargs builder(p, state, cdt)); every step takes params=, grads= and backend=
def _common(p, cdt):
    return dict(prox=(p["anchor"], 0.01), control=(p["c"].to(cdt), p["ci"].to(cdt)), client_ids=IDS)


RULES = {
    "sps": (client.sps_step, lambda p, s, cdt: dict(losses=p["losses"], c=0.5, gamma_b=0.7)),
    "sps-corrections-clip": (client.sps_step, lambda p, s, cdt: dict(losses=p["losses"], c=0.5, gamma_b=0.7,
                                                                     clip_norm=10.0, **_common(p, cdt))),
    "sps-smooth": (client.sps_step, lambda p, s, cdt: dict(losses=p["losses"], cap="smooth", smooth_factor=1.05,
                                                           gamma_b=0.01, state=s, client_ids=IDS)),
    "sps-smooth-prev-step": (client.sps_step, lambda p, s, cdt: dict(losses=p["losses"], cap="smooth_prev_step",
                                                                     smooth_factor=1.05, state=s, client_ids=IDS)),
    "decsps": (client.decsps_step, lambda p, s, cdt: dict(losses=p["losses"], state=s, client_ids=IDS, c0=0.5)),
    "sgd": (client.local_step, lambda p, s, cdt: dict(lr=torch.tensor([0.1, 0.2, 0.05, 0.0]))),
    "sgd-everything": (client.local_step, lambda p, s, cdt: dict(lr=0.05, clip_norm=10.0, weight_decay=1e-2,
                                                                 momentum=0.9, nesterov=True, state=s,
                                                                 **_common(p, cdt))),
    "heavy-ball": (client.local_step, lambda p, s, cdt: dict(lr=0.05, momentum=0.9, state=s, client_ids=IDS)),
    "mass": (client.mass_step, lambda p, s, cdt: dict(state=s, client_ids=IDS, eta1=0.05, gam=0.5, eta2=0.01)),
}


def run_steps(fn, kwargs_of, p, dtype, backend, steps=3):
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    state = client.ClientState(N, p["x"].shape[1], dtype=cdt)
    x = p["x"].to(dtype).clone()
    outs = []
    for t in range(steps):
        grads = (p["grads"].double() * (1 + 0.1 * t) + 0.01 * x.double()).to(dtype)
        outs.append(fn(params=x, grads=grads, backend=backend, **kwargs_of(p, state, cdt)))
    return x, outs, state


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rule", list(RULES))
def test_rule_matches_fp64_reference(rule, dtype, backend):
    check_rule_against_reference(rule, dtype, backend, problem(dtype))


LONG_ROW_CASES = [(b, dt) for b in BACKENDS if b != "reference"
                  for dt in ((torch.float32, torch.bfloat16) if b == "cpu" else (torch.float32,))]


@pytest.mark.parametrize("backend,dtype", LONG_ROW_CASES, ids=str)
@pytest.mark.parametrize("rule", list(RULES))
def test_rule_on_long_rows_matches_fp64_reference(rule, backend, dtype):
    """Rows of 9 full 4096-blocks and a tail take the C++ kernel's interleaved block groups (4 blocks per norm
    group, 2 per update group, the rest one by one) and the Triton path that splits rows into chunks of columns
    (pass 1 partial norms, pass 2 every chunk's step and update): every rule against the fp64 reference."""
    check_rule_against_reference(rule, dtype, backend, problem(dtype, d=9 * 4096 + 123))


def check_rule_against_reference(rule, dtype, backend, p):
    fn, kwargs_of = RULES[rule]
    p64 = {k: v.double() for k, v in p.items()}
    got_x, got_steps, got_state = run_steps(fn, kwargs_of, p, dtype, backend)
    ref_x, ref_steps, ref_state = run_steps(fn, kwargs_of, p64, torch.float64, "reference")
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 params are rounded to 8 bits after every step
    for t, (a, b) in enumerate(zip(got_steps, ref_steps)):
        assert_close(a, b, rtol=1e-4 if dtype == torch.float32 else 5e-2, atol=1e-7, name=f"steps {t}")
    assert_close(got_x, ref_x, rtol=tol, atol=tol, name="params")
    for k, v in ref_state.vectors.items():
        assert_close(got_state.vectors[k], v, rtol=tol, atol=tol, name=f"state {k}")
    for k, v in ref_state.scalars.items():
        assert_close(got_state.scalars[k], v, rtol=1e-4 if dtype == torch.float32 else 5e-2, atol=1e-7,
                     name=f"state {k}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_sps_lands_on_zero_in_one_step_for_every_client(backend):
    a = torch.tensor([0.5, 1.0, 2.0, 4.0, 10.0], dtype=torch.float64)  # f_i(x) = (a_i/2) ||x||^2, 1/a_i <= 2
    x = torch.randn(5, 300, dtype=torch.float64).float()
    grads = (a[:, None] * x.double()).float()
    losses = 0.5 * a * x.double().square().sum(1)
    gamma = client.sps_step(params=x, grads=grads, losses=losses, c=0.5, gamma_b=2.5, l_star=0.0, backend=backend)
    assert_close(gamma, 1 / a, rtol=1e-5, atol=0, name="gamma = 1/a")
    assert float(x.abs().max()) < 1e-5, f"max |x| after one step: {float(x.abs().max())}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_decsps_steps_are_non_increasing(backend):
    state = client.ClientState(N, 64)
    x = torch.randn(3, 64)
    ids = torch.tensor([1, 4, 8])
    prev = torch.full((3,), float("inf"), dtype=torch.float64)
    for t in range(12):
        grads = x + 0.3 * torch.randn(3, 64)
        losses = 0.5 * x.double().square().sum(1) + 0.1
        gamma = client.decsps_step(params=x, grads=grads, losses=losses, state=state, client_ids=ids, c0=0.5,
                                   backend=backend)
        assert bool((gamma <= prev * (1 + 1e-12)).all()), (t, gamma, prev)
        prev = gamma
    assert state.scalars["decsps_steps"][ids].tolist() == [12.0, 12.0, 12.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_client_ids_leave_other_clients_state_untouched(backend):
    state = client.ClientState(N, D)
    for name in ("momentum", "mass"):
        state.vector(name).copy_(torch.randn(N, D))
    state.scalar("decsps_steps").copy_(torch.arange(N, dtype=torch.float64))
    before = snapshot([state.vectors, state.scalars])
    p = problem()
    others = torch.tensor([i for i in range(N) if i not in IDS.tolist()])
    client.local_step(params=p["x"].clone(), grads=p["grads"], lr=0.1, momentum=0.9, state=state, client_ids=IDS,
                      backend=backend)
    client.mass_step(params=p["x"].clone(), grads=p["grads"], state=state, client_ids=IDS, eta1=0.1, gam=0.5,
                     backend=backend)
    client.decsps_step(params=p["x"].clone(), grads=p["grads"], losses=p["losses"], state=state, client_ids=IDS,
                       backend=backend)
    for name in ("momentum", "mass"):
        assert torch.equal(state.vectors[name][others], before[0][name][others]), name
        assert not torch.equal(state.vectors[name][IDS], before[0][name][IDS]), name
    assert torch.equal(state.scalars["decsps_steps"][others], before[1]["decsps_steps"][others])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["tiny-grad", "loss-at-l-star", "loss-below-l-star", "nan-loss", "inf-loss",
                                  "nan-grad", "inf-grad"])
def test_safeguards_row_by_row(case, backend):
    p = problem()
    x, grads, losses = p["x"].clone(), p["grads"].clone(), p["losses"].clone()
    bad = 2
    if case == "tiny-grad":
        grads[bad] = 0.0
    elif case == "loss-at-l-star":
        losses[bad] = 0.0
    elif case == "loss-below-l-star":
        losses[bad] = -1.0
    elif case == "nan-loss":
        losses[bad] = float("nan")
    elif case == "inf-loss":
        losses[bad] = float("inf")
    elif case == "nan-grad":
        grads[bad, 5] = float("nan")
    else:
        grads[bad, 5] = float("inf")
    state = client.ClientState(N, D)
    row_before = x[bad].clone()
    gamma = client.decsps_step(params=x, grads=grads, losses=losses, state=state, client_ids=IDS, backend=backend)
    assert float(gamma[bad]) == 0.0
    assert torch.equal(x[bad], row_before), "the safeguarded row was written"
    assert torch.isfinite(x).all()
    assert float(state.scalars["decsps_steps"][IDS[bad]]) == 0.0
    assert torch.isnan(state.scalars["decsps_gamma"][IDS[bad]])  # never stored: still "not seen"
    # the other clients moved exactly as they would without the bad one
    keep = torch.tensor([i for i in range(M) if i != bad])
    x2 = p["x"][keep].clone()
    state2 = client.ClientState(N, D)
    gamma2 = client.decsps_step(params=x2, grads=grads[keep], losses=losses[keep], state=state2,
                                client_ids=IDS[keep], backend=backend)
    assert torch.equal(x[keep], x2) and torch.equal(gamma[keep], gamma2)
    if case.endswith("grad") and case != "tiny-grad":  # plain SGD skips non-finite rows too
        x3 = p["x"].clone()
        steps = client.local_step(params=x3, grads=grads, lr=0.1, backend=backend)
        assert float(steps[bad]) == 0.0 and torch.equal(x3[bad], p["x"][bad]) and torch.isfinite(x3).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_paper_004_nesterov_is_torch_nesterov_sgd(backend):
    """v_{t+1} = w_t - a g(w_t); w_{t+1} = v_{t+1} + b (v_{t+1} - v_t) equals torch's SGD(nesterov) for constant
    a, b -- checked against torch.optim.SGD itself and between the two fastagg paths."""
    a, b = 0.05, 0.9
    x0 = torch.randn(3, 200, dtype=torch.float64)
    target = torch.randn(3, 200, dtype=torch.float64)
    xs = x0.clone().float()
    xm = x0.clone().float()
    sm, sn = client.ClientState(5, 200), client.ClientState(5, 200)
    ids = torch.tensor([4, 0, 2])
    w = torch.nn.Parameter(x0.clone())
    opt = torch.optim.SGD([w], lr=a, momentum=b, nesterov=True)
    for _ in range(8):
        client.local_step(params=xs, grads=xs - target.float(), lr=a, momentum=b, nesterov=True, state=sn,
                          client_ids=ids, backend=backend)
        client.mass_step(params=xm, grads=xm - target.float(), state=sm, client_ids=ids, eta1=a, gam=b, eta2=0.0,
                         backend=backend)
        opt.zero_grad()
        w.grad = w.detach() - target
        opt.step()
    assert_close(xs, w.detach(), rtol=1e-5, atol=1e-5, name="fastagg nesterov vs torch SGD")
    assert_close(xm, w.detach(), rtol=1e-5, atol=1e-5, name="paper 004 form vs torch SGD")


def _args():
    p = problem()
    return p["x"].clone(), p["grads"].clone(), p["losses"].clone()


BAD = {
    "grads shape": (lambda x, g, f, s: client.sps_step(params=x, grads=g[:, :-1], losses=f), ValueError,
                    r"grads has shape \(4, 1030\); expected \(4, 1031\) like params"),
    "grads dtype": (lambda x, g, f, s: client.sps_step(params=x, grads=g.double(), losses=f), TypeError,
                    r"grads has dtype torch.float64; expected torch.float32 like params"),
    "grads device": (lambda x, g, f, s: client.sps_step(params=x, grads=g.to("meta"), losses=f), (ValueError, TypeError),
                     r"grads is on meta|grads has dtype"),
    "params 1-D": (lambda x, g, f, s: client.sps_step(params=x[0], grads=g[0], losses=f), ValueError,
                   r"params must be a 2-D"),
    "losses shape": (lambda x, g, f, s: client.sps_step(params=x, grads=g, losses=f[:2]), ValueError,
                     r"losses must be a tensor of shape \(4,\)"),
    "negative c": (lambda x, g, f, s: client.sps_step(params=x, grads=g, losses=f, c=-0.5), ValueError,
                   r"c must be a finite number > 0"),
    "zero gamma_b": (lambda x, g, f, s: client.sps_step(params=x, grads=g, losses=f, gamma_b=0.0), ValueError,
                     r"gamma_b must be a finite number > 0"),
    "negative gamma_b row": (lambda x, g, f, s: client.sps_step(params=x, grads=g, losses=f,
                                                                gamma_b=torch.tensor([1.0, -1.0, 1.0, 1.0])),
                             ValueError, r"gamma_b\[1\] is -1.0"),
    "negative lr": (lambda x, g, f, s: client.local_step(params=x, grads=g, lr=-0.1), ValueError,
                    r"lr must be a finite number >= 0"),
    "duplicate ids": (lambda x, g, f, s: client.decsps_step(params=x, grads=g, losses=f, state=s,
                                                            client_ids=torch.tensor([1, 2, 1, 3])),
                      ValueError, r"client_ids has duplicates"),
    "ids out of range": (lambda x, g, f, s: client.decsps_step(params=x, grads=g, losses=f, state=s,
                                                               client_ids=torch.tensor([1, 2, 9, 3])),
                         ValueError, r"client_ids must be in \[0, 9\)"),
    "momentum without state": (lambda x, g, f, s: client.local_step(params=x, grads=g, lr=0.1, momentum=0.9),
                               TypeError, r"pass state= and client_ids="),
    "state dim": (lambda x, g, f, s: client.decsps_step(params=x, grads=g, losses=f, state=client.ClientState(9, 5),
                                                        client_ids=IDS), ValueError,
                  r"state has dim 5; expected 1031 like params' columns"),
    "anchor shape": (lambda x, g, f, s: client.local_step(params=x, grads=g, lr=0.1, prox=(x[0, :5], 0.1)),
                     ValueError, r"prox anchor has shape \(5,\)"),
    "negative mu": (lambda x, g, f, s: client.local_step(params=x, grads=g, lr=0.1, prox=(x[0], -0.1)), ValueError,
                    r"prox mu must be a finite number >= 0"),
    "clip zero": (lambda x, g, f, s: client.local_step(params=x, grads=g, lr=0.1, clip_norm=0.0), ValueError,
                  r"clip_norm must be a finite number > 0"),
    "unknown cap": (lambda x, g, f, s: client.sps_step(params=x, grads=g, losses=f, cap="x"), ValueError,
                    r"cap must be one of"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_leaves_buffers_unchanged(case, backend):
    fn, err, pattern = BAD[case]
    x, g, f = _args()
    state = client.ClientState(N, D)
    state.vector("momentum")
    before = snapshot([x, g, f, state.vectors, state.scalars])
    with pytest.raises(err, match=pattern):
        fn(x, g, f, state)
    assert_unchanged(before, [x, g, f, state.vectors, state.scalars], "buffers")


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_rows_few_clients(backend):
    """Few long rows take the C++ backend's shared-row schedule (all threads on one row); same numbers."""
    g = torch.Generator().manual_seed(4)
    x0 = torch.randn(3, 40_000, generator=g)
    grads = torch.randn(3, 40_000, generator=g)
    losses = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    state = client.ClientState(3, 40_000)
    ids = torch.arange(3)
    x = x0.clone()
    gamma = client.sps_step(params=x, grads=grads, losses=losses, clip_norm=50.0, backend=backend)
    client.local_step(params=x, grads=grads, lr=0.01, momentum=0.9, state=state, client_ids=ids, backend=backend)
    x64 = x0.double().clone()
    state64 = client.ClientState(3, 40_000, dtype=torch.float64)
    gamma64 = client.sps_step(params=x64, grads=grads.double(), losses=losses, clip_norm=50.0, backend="reference")
    client.local_step(params=x64, grads=grads.double(), lr=0.01, momentum=0.9, state=state64, client_ids=ids,
                      backend="reference")
    assert_close(gamma, gamma64, rtol=1e-5, atol=0, name="gamma")
    assert_close(x, x64, rtol=1e-5, atol=1e-5, name="params")


def test_cpu_local_step_bit_identical_across_thread_counts(tmp_path):
    import os
    import subprocess
    import sys

    script = (
        "import torch, sys\n"
        "from fastagg import client\n"
        "g = torch.Generator().manual_seed(0)\n"
        "outs = {}\n"
        "for m, d in ((3, 50_000), (40, 3_000), (12, 70_000), (5, 70_001)):\n"
        "    x = torch.randn(m, d, generator=g); gr = torch.randn(m, d, generator=g)\n"
        "    f = torch.rand(m, generator=g, dtype=torch.float64) + 1\n"
        "    outs[m] = (client.sps_step(params=x, grads=gr, losses=f, clip_norm=30.0, backend='cpu'), x)\n"
        "torch.save(outs, sys.argv[1])\n"
    )
    results = []
    for threads in (1, 2, 3):
        path = tmp_path / f"t{threads}.pt"
        subprocess.run([sys.executable, "-c", script, str(path)], check=True,
                       env=threads_env(threads))
        results.append(torch.load(path))
    for other in results[1:]:
        for m in results[0]:
            for a, b in zip(results[0][m], other[m]):
                assert torch.equal(a, b), m


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_per_client_tensors_are_read_by_row(backend):
    """Losses, caps, learning rates and client ids that are views with a stride (a column of a table) give the same
    steps and state as contiguous copies: the kernels read them by row, not as raw memory."""
    p = problem()
    table = torch.stack([p["losses"], torch.full((M,), -7.0, dtype=torch.float64)], dim=1)  # column 0 = losses
    caps = torch.stack([torch.full((M,), 9.0, dtype=torch.float64), torch.tensor([0.7, 0.01, 0.3, 0.05],
                                                                                  dtype=torch.float64)], dim=1)
    lrs = torch.stack([torch.tensor([0.1, 0.2, 0.05, 0.0], dtype=torch.float64), torch.ones(M, dtype=torch.float64)], 1)
    for strided, contiguous in (
        (dict(losses=table[:, 0], gamma_b=caps[:, 1]), dict(losses=table[:, 0].clone(), gamma_b=caps[:, 1].clone())),
    ):
        x1, x2 = p["x"].clone(), p["x"].clone()
        g1 = client.sps_step(params=x1, grads=p["grads"], backend=backend, **strided)
        g2 = client.sps_step(params=x2, grads=p["grads"], backend=backend, **contiguous)
        assert torch.equal(g1, g2) and torch.equal(x1, x2)
        assert bool((g1 > 0).all())
    ids_table = torch.stack([IDS, torch.tensor([1, 3, 4, 6])], dim=1)  # column 0 = IDS, a strided view
    runs = []
    for ids in (ids_table[:, 0], IDS.clone()):
        x, state = p["x"].clone(), client.ClientState(N, D)
        runs.append((client.local_step(params=x, grads=p["grads"], lr=0.1, momentum=0.9, state=state,
                                       client_ids=ids, backend=backend), x, state.vectors["momentum"]))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    x1, x2 = p["x"].clone(), p["x"].clone()
    s1 = client.local_step(params=x1, grads=p["grads"], lr=lrs[:, 0], backend=backend)
    s2 = client.local_step(params=x2, grads=p["grads"], lr=lrs[:, 0].clone(), backend=backend)
    assert torch.equal(s1, s2) and torch.equal(x1, x2)


def test_client_state_device_spelled_without_index():
    """A state made with device="cpu:0" (or "cuda" on a GPU) works with params whose tensors report "cpu"
    ("cuda:0"): devices are compared as tensors report them, not as the user spelled them."""
    m, d = 3, 10
    state = client.ClientState(m, d, device="cpu:0")
    assert state.device == torch.device("cpu")
    x, g = torch.zeros(m, d), torch.ones(m, d)
    client.local_step(params=x, grads=g, lr=0.1, momentum=0.9, state=state, client_ids=torch.arange(m),
                      backend="reference")
    assert torch.allclose(x, torch.full((m, d), -0.1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sps_with_gradients_whose_squares_underflow_matches_the_float64_oracle(backend):
    """Gradients of 1e-21 square to float32 subnormals (1e-23 to zero): the SPS step divides by that norm, so the
    block is summed again in float64 and the step matches the oracle's."""
    g = torch.randn(3, 10_000, generator=torch.Generator().manual_seed(3)) * 1e-21
    g[1] *= 1e-2
    x0 = torch.randn(3, 10_000, generator=torch.Generator().manual_seed(4))
    losses = torch.full((3,), 1e-38, dtype=torch.float64)
    steps = {}
    for b, dt in ((backend, torch.float32), ("reference", torch.float64)):
        x = x0.to(dt).clone()
        steps[b if dt == torch.float32 else "oracle"] = client.sps_step(
            params=x, grads=g.to(dt), losses=losses, gamma_b=1e30, min_sq_norm=1e-300, backend=b)
    assert bool((steps["oracle"] > 0).all())
    assert_close(steps[backend], steps["oracle"], rtol=1e-5, atol=0, name="steps")


@pytest.mark.parametrize("backend", BACKENDS)
def test_sps_with_gradients_near_1e18_matches_the_float64_oracle(backend):
    """A 4096-element block of gradients near 1e18 has a squared norm beyond float32: that block is summed again in
    float64, so the Polyak step (tiny, not zero or NaN) matches the float64 oracle."""
    g = torch.randn(3, 10_000, generator=torch.Generator().manual_seed(3))
    g[1, 4096:8192] *= 1e18
    x = torch.randn(3, 10_000, generator=torch.Generator().manual_seed(4))
    f = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    x64 = x.double()
    step = client.sps_step(params=x, grads=g, losses=f, gamma_b=1.0, backend=backend)
    ref = client.sps_step(params=x64, grads=g.double(), losses=f, gamma_b=1.0, backend="reference")
    assert bool((step > 0).all())
    assert_close(step, ref, rtol=1e-5, atol=0, name="steps")
    assert_close(x, x64, rtol=1e-6, atol=1e-6, name="params")
