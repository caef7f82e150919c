"""Hostile or mistaken arguments left from the first safety round (issue 19): each gets a TypeError or ValueError
naming the argument, never a truncation, a silent skip, an OverflowError, a RuntimeError or NotImplementedError
from deep inside torch, and nothing is written."""
from __future__ import annotations

import pytest
import torch

import fastagg
from fastagg import client, flat
from fastagg import server  # noqa: F401 (fastagg.server)
from fastagg.testing import assert_unchanged, snapshot

X = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
F64 = dict(dtype=torch.float64)


def _acc_state(mutate):
    acc = fastagg.Accumulator(like=torch.zeros(10))
    acc.add(torch.ones(10), 2.0, client_id="a")
    sd = acc.state_dict()
    mutate(sd)
    return sd


CASES = [
    ("flatten into an int64 buffer", TypeError, "out has dtype torch.int64",
     lambda: flat.flatten([torch.ones(3) * 0.5], out=torch.zeros(3, dtype=torch.int64))),
    ("flatten to an integer dtype", TypeError, "dtype must be a floating",
     lambda: flat.flatten([torch.ones(3) * 0.5], dtype=torch.int32)),
    ("a negative squared-norm sum as a tensor", ValueError, "weighted_sq_norm_sum",
     lambda: fastagg.fedexp_step_from_sums(torch.ones(10), torch.tensor(-1.0, **F64), 3.0, 3, eps=1e-3)),
    ("a complex squared-norm sum", ValueError, "weighted_sq_norm_sum",
     lambda: fastagg.fedexp_step_from_sums(torch.ones(10), torch.tensor(1 + 1j), 3.0, 3, eps=1e-3)),
    ("min_sq_norm=nan", ValueError, "min_sq_norm",
     lambda: client.sps_step(params=X.clone(), grads=X, losses=torch.ones(3, **F64), min_sq_norm=float("nan"))),
    ("ClientState(True, True)", ValueError, "num_clients", lambda: client.ClientState(True, True)),
    ("ClientState(4, True)", ValueError, "dim", lambda: client.ClientState(4, True)),
    ("weights as strings", TypeError, r"weights\[0\] is '1'",
     lambda: fastagg.fedexp_step(X, eps=1e-3, weights=["1", "2", "3"])),
    ("weights as bools", TypeError, "weights", lambda: fastagg.fedexp_step(X, eps=1e-3, weights=[True, True, False])),
    ("a weight of 10**400", ValueError, r"weights\[1\].*too large",
     lambda: fastagg.fedexp_step(X, eps=1e-3, weights=[1, 10**400, 1])),
    ("complex weights", TypeError, "weights", lambda: fastagg.fedexp_step(X, eps=1e-3, weights=torch.ones(3) * 1j)),
    ("eps=10**400", ValueError, "eps.*too large", lambda: fastagg.fedexp_step(X, eps=10**400)),
    ("lr=10**400 for a server optimizer", ValueError, "lr.*too large",
     lambda: fastagg.server.FedAvg(torch.zeros(10), lr=10**400)),
    ("meta deltas", ValueError, "deltas is on meta",
     lambda: fastagg.fedexp_step(torch.empty(3, 10, device="meta"), eps=1e-3)),
    ("meta params", ValueError, "params is on meta",
     lambda: fastagg.fedexp_step(X, eps=1e-3, params=torch.empty(10, device="meta"))),
    ("meta entry of a state_dict", ValueError, r"params\['b'\] is on meta",
     lambda: fastagg.server.FedAvg({"a": torch.zeros(4), "b": torch.empty(6, device="meta")})),
    ("a meta like", ValueError, "meta device", lambda: fastagg.Accumulator(like=torch.empty(10, device="meta"))),
    ("a meta client gradient", ValueError, "grads is on meta",
     lambda: client.sps_step(params=X.clone(), grads=torch.empty(3, 10, device="meta"),
                             losses=torch.ones(3, **F64))),
    ("a meta weight", ValueError, "meta", lambda: fastagg.fedexp_step(X, eps=1e-3, weights=torch.empty(3, device="meta"))),
    ("a saved round with complex norms", ValueError, "sq_norms has dtype torch.complex128",
     lambda: fastagg.Accumulator(like=torch.zeros(10)).load_state_dict(
         _acc_state(lambda s: s.update(sq_norms=s["sq_norms"].to(torch.complex128))))),
    ("a saved round on the meta device", ValueError, "meta device",
     lambda: fastagg.Accumulator(like=torch.zeros(10)).load_state_dict(
         _acc_state(lambda s: s.update(sum=torch.empty(10, device="meta"))))),
    ("a saved round with a weight of 10**400", ValueError, "total_weight",
     lambda: fastagg.Accumulator(like=torch.zeros(10)).load_state_dict(
         _acc_state(lambda s: s.update(total_weight=10**400)))),
    ("a saved round whose ids are a string", ValueError, "client_ids must be a list",
     lambda: fastagg.Accumulator(like=torch.zeros(10)).load_state_dict(
         _acc_state(lambda s: s.update(client_ids="abc")))),
]


@pytest.mark.parametrize("what, error, message, call", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_argument_gets_a_clear_error(what, error, message, call):
    before = snapshot(X)
    with pytest.raises(error, match=message):
        call()
    assert_unchanged(before, X, "inputs")


def test_grads_on_the_meta_device_leave_params_unchanged():
    x = X.clone()
    before = snapshot(x)
    with pytest.raises(ValueError, match="meta"):
        client.local_step(params=x, grads=torch.empty(3, 10, device="meta"), lr=0.1)
    assert_unchanged(before, x, "params")
