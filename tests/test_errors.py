"""Bad input: one table of inputs -> (error type, message pattern), run on every backend, checking that every
buffer is bit-identical afterwards."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastagg
from fastagg.testing import assert_unchanged, cpu_backends, snapshot

BACKENDS = cpu_backends()


def _x(m=3, d=10, dtype=torch.float32):
    return torch.randn(m, d).to(dtype)


def _w(d=10):
    return torch.randn(d)


# name -> (callable taking (x, w, backend), error type, message regex); x: deltas, w: params
CASES = {
    "empty list": (lambda x, w, b: fastagg.fedexp_step([], eps=1e-3, backend=b), ValueError, r"deltas is empty"),
    "empty matrix": (lambda x, w, b: fastagg.fedexp_step(torch.zeros(0, 5), eps=1e-3, backend=b), ValueError,
                     r"deltas is empty"),
    "1-D deltas": (lambda x, w, b: fastagg.fedexp_step(x[0], eps=1e-3, backend=b), ValueError,
                   r"deltas must be a 2-D"),
    "int dtype": (lambda x, w, b: fastagg.fedexp_step(torch.ones(3, 4, dtype=torch.int64), eps=1e-3, backend=b),
                  TypeError, r"deltas has dtype torch.int64; expected a floating dtype"),
    "int client in list": (lambda x, w, b: fastagg.fedexp_step([x[0], x[1].long()], eps=1e-3, backend=b),
                           TypeError, r"deltas\[1\] has dtype torch.int64; expected a floating dtype"),
    "mixed dtypes": (lambda x, w, b: fastagg.fedexp_step([x[0], x[1].double()], eps=1e-3, backend=b), TypeError,
                     r"deltas\[1\] has dtype torch.float64; expected torch.float32 like deltas\[0\]"),
    "mismatched sizes": (lambda x, w, b: fastagg.fedexp_step([x[0], x[1][:9]], eps=1e-3, backend=b), ValueError,
                         r"deltas\[1\] has shape \(9,\); expected \(10,\) like deltas\[0\]"),
    "mismatched layer": (lambda x, w, b: fastagg.fedexp_step([[x[0][:4], x[0][4:]], [x[1][:5], x[1][5:]]], eps=1e-3,
                                                             backend=b),
                         ValueError, r"deltas\[1\]\[0\] has shape \(5,\); expected \(4,\) like deltas\[0\]"),
    "non-contiguous layer": (lambda x, w, b: fastagg.fedexp_step([[x[:2, :2].t()], [x[:2, :2].t()]], eps=1e-3,
                                                                 backend=b),
                             ValueError, r"deltas\[0\]\[0\] is not contiguous"),
    "column-strided matrix": (lambda x, w, b: fastagg.fedexp_step(x[:, ::2], eps=1e-3, backend=b), ValueError,
                              r"unit stride along the parameter dimension"),
    "weights wrong length": (lambda x, w, b: fastagg.fedexp_step(x, eps=1e-3, weights=[1, 2], backend=b),
                             ValueError, r"weights must have shape \(3,\), got \(2,\)"),
    "weights wrong shape": (lambda x, w, b: fastagg.fedexp_step(x, eps=1e-3, weights=torch.ones(3, 1), backend=b),
                            ValueError, r"weights must have shape \(3,\), got \(3, 1\)"),
    "negative weight": (lambda x, w, b: fastagg.fedexp_step(x, eps=1e-3, weights=[1, -2, 3], backend=b), ValueError,
                        r"weights\[1\] is -2.0; weights must be finite and >= 0"),
    "nan weight": (lambda x, w, b: fastagg.fedexp_step(x, eps=1e-3, weights=[1, float("nan"), 3], backend=b),
                   ValueError, r"weights\[1\] is nan"),
    "all-zero weights": (lambda x, w, b: fastagg.fedexp_step(x, eps=1e-3, weights=[0, 0, 0], backend=b), ValueError,
                         r"weights are all zero"),
    "negative eps": (lambda x, w, b: fastagg.fedexp_step(x, eps=-1.0, backend=b), ValueError,
                     r"eps must be a finite number >= 0, got -1.0"),
    "nan eps": (lambda x, w, b: fastagg.fedexp_step(x, eps=float("nan"), backend=b), ValueError, r"eps must be"),
    "missing eps": (lambda x, w, b: fastagg.fedexp_step(x, backend=b), TypeError, r"needs eps"),
    "bad eps_mode": (lambda x, w, b: fastagg.fedexp_step(x, eps=1e-3, eps_mode="x", backend=b), ValueError,
                     r"eps_mode must be one of"),
    "bad on_nonfinite": (lambda x, w, b: fastagg.fedexp_step(x, eps=1e-3, on_nonfinite="x", backend=b), ValueError,
                         r"on_nonfinite must be one of"),
    "models without params": (lambda x, w, b: fastagg.fedexp_step(models=x, eps=1e-3, backend=b), TypeError,
                              r"models= needs params="),
    "deltas and models": (lambda x, w, b: fastagg.fedexp_step(x, models=x, params=w, eps=1e-3, backend=b),
                          TypeError, r"exactly one of deltas= .* or models="),
    "params wrong size": (lambda x, w, b: fastagg.fedexp_step(x, eps=1e-3, params=w[:9], backend=b), ValueError,
                          r"params has 9 elements; expected 10"),
    "params int": (lambda x, w, b: fastagg.fedexp_step(x, eps=1e-3, params=torch.zeros(10, dtype=torch.int32),
                                                       backend=b),
                   TypeError, r"params has dtype torch.int32"),
    "models dtype != params": (lambda x, w, b: fastagg.fedexp_step(models=x, params=w.double(), eps=1e-3, backend=b),
                               TypeError, r"params has dtype torch.float64; expected torch.float32 like models"),
    "read-only numpy params": (lambda x, w, b: fastagg.fedexp_step(x.numpy(), eps=1e-3, params=_readonly(w.numpy()),
                                                                   backend=b),
                               ValueError, r"params is a read-only numpy array"),
    "negative lr": (lambda x, w, b: fastagg.fedavg_step(x, lr=-1, backend=b), ValueError, r"lr must be"),
    "unknown backend": (lambda x, w, b: fastagg.fedexp_step(x, eps=1e-3, backend="gpu"), ValueError,
                        r"backend must be one of"),
    "from_sums zero weight": (lambda x, w, b: fastagg.fedexp_step_from_sums(x[0], 1.0, 0.0, 3, eps=1e-3, backend=b),
                              ValueError, r"total_weight must be a finite number > 0"),
    "from_sums bad count": (lambda x, w, b: fastagg.fedexp_step_from_sums(x[0], 1.0, 1.0, 0, eps=1e-3, backend=b),
                            ValueError, r"num_clients must be an integer >= 1"),
}


def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, backend):
    fn, err, pattern = CASES[case]
    x, w = _x(), _w()
    before = snapshot([x, w])
    with pytest.raises(err, match=pattern):
        fn(x, w, backend)
    assert_unchanged(before, [x, w], "buffers")


def test_explicit_backend_that_cannot_run_lists_what_can(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"backend='triton' runs on CUDA tensors .* Available here: \['reference', 'cpu'\]"):
        fastagg.fedexp_step(_x(), eps=1e-3, backend="triton")


def test_accumulator_rejects_bad_client_and_stays_unchanged():
    for backend in BACKENDS:
        acc = fastagg.Accumulator(like=_w(), backend=backend)
        acc.add(_w(), weight=2)
        s, sq, tw, n = acc._sum.clone(), acc.weighted_sq_norm_sum.clone(), acc.total_weight, acc.num_clients
        bad = _w()
        bad[3] = float("nan")
        with pytest.raises(ValueError, match=r"delta \(client 1\) contains NaN or Inf; the accumulator is unchanged"):
            acc.add(bad, weight=1)
        assert acc.add(bad, weight=1, on_nonfinite="skip") is False
        with pytest.raises(ValueError, match=r"delta has 9 elements; expected 10"):
            acc.add(_w(9))
        with pytest.raises(TypeError, match=r"delta\[0\] has dtype torch.float64; expected torch.float32 like the acc"):
            acc.add(_w().double())
        with pytest.raises(ValueError, match=r"weight must be a finite number >= 0"):
            acc.add(_w(), weight=-1)
        assert torch.equal(acc._sum, s) and torch.equal(acc.weighted_sq_norm_sum, sq)
        assert (acc.total_weight, acc.num_clients) == (tw, n)
    empty = fastagg.Accumulator(like=_w())
    with pytest.raises(ValueError, match="accumulator is empty"):
        empty.fedexp_step(eps=1e-3)
    zero = fastagg.Accumulator(like=_w())
    zero.add(_w(), weight=0)
    with pytest.raises(ValueError, match="total weight is 0"):
        zero.fedexp_step(eps=1e-3)


def test_numpy_read_only_deltas_are_fine():
    x = _readonly(np.random.default_rng(0).standard_normal((3, 10)).astype(np.float32))
    res = fastagg.fedexp_step(x, eps=1e-3)
    assert isinstance(res.mean, np.ndarray)


def test_device_mismatch_names_the_client():
    """(meta stands in for another device on a machine without one; it is refused first, naming the entry)"""
    x = torch.randn(5)
    with pytest.raises(ValueError, match=r"deltas\[1\] is on meta"):
        fastagg.fedexp_step([x, torch.empty(5, device="meta")], eps=1e-3)
    with pytest.raises(ValueError, match=r"params is on meta"):
        fastagg.fedexp_step([x, x], eps=1e-3, params=torch.empty(5, device="meta"))


def test_env_report_says_what_is_active():
    report = fastagg.env_report()
    assert "cpu backend: compiled module" in report and "backend='auto': cpu tensors -> cpu" in report
    assert str(cpu_backends()) in report


def test_mean_out_and_eval_out_are_checked():
    x = _x()
    with pytest.raises(ValueError, match=r"mean_out must be a contiguous 1-D torch.float32 buffer of 10 elements"):
        fastagg.fedexp_step(x, eps=1e-3, mean_out=torch.empty(9))
    with pytest.raises(TypeError, match=r"eval_out= needs params="):
        fastagg.fedexp_step(x, eps=1e-3, eval_out=torch.empty(10))
    out = torch.empty(10)
    res = fastagg.fedexp_step(x, eps=1e-3, mean_out=out)
    assert res.mean_flat.data_ptr() == out.data_ptr()
