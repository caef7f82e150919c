"""What users of the single-file ``fastagg.server`` relied on, kept by the package of one file per rule family
(issue 41): a refused step leaves no state behind, pickles made before the split load, the public names stay."""
from __future__ import annotations

import pickle

import pytest
import torch

from fastagg import compress, server
from fastagg.privacy import PrivacyAccountant
from fastagg.server import torch_compat

D = 12


def _bad_first_steps():
    w = torch.zeros(D)
    nan_scale = compress.quantize_int8(torch.randn(D), block=4)
    nan_scale.scales[0] = float("nan")
    return [
        ("wrong size", [torch.randn(D + 1)]),
        ("int dtype", [torch.ones(D, dtype=torch.int32)]),
        ("a string", "not clients"),
        ("NaN scale, raise", [nan_scale]),
        ("wrong-size Accumulator", _acc(D + 1)),
        ("aliasing the params", [w]),
    ]


def _acc(d):
    from fastagg import Accumulator

    acc = Accumulator(like=torch.zeros(d))
    acc.add(torch.randn(d))
    return acc


@pytest.mark.parametrize("case", range(6))
def test_a_refused_first_step_of_fedexpm_creates_no_state(case):
    """FedExP-M's momentum buffer v is made on first use: a first step refused before its stats pass (bad input)
    must not make it, as before the split (a model-sized zero buffer, and a state_dict with an extra entry)."""
    w = torch.zeros(D)
    opt = server.FedExPM(w, eps=1e-3)
    what, deltas = _bad_first_steps()[case]
    if what == "aliasing the params":
        deltas = [w]
    with pytest.raises((ValueError, TypeError)):
        opt.step(deltas)
    assert sorted(opt.flat_state) == ["numerator", "step"], what
    assert sorted(opt.state_dict()["state"][0]) == ["numerator", "step"], what
    assert torch.equal(w, torch.zeros(D))
    opt.step([torch.ones(D)])  # and the first good step then makes it
    assert "v" in opt.flat_state


def test_an_optimizer_pickled_by_the_single_file_server_loads():
    """Before the split the group reference was ``fastagg.server._GroupRef``: a pickle naming it still loads."""
    opt = server.FedAdam(torch.zeros(D))
    opt.step([torch.randn(D), torch.randn(D)])
    cls = torch_compat.GroupRef
    saved = cls.__module__, cls.__qualname__
    try:  # pickle as the single-file module did: the class found at fastagg.server._GroupRef
        cls.__module__, cls.__qualname__ = "fastagg.server", "_GroupRef"
        blob = pickle.dumps(opt)
    finally:
        cls.__module__, cls.__qualname__ = saved
    assert b"_GroupRef" in blob
    back = pickle.loads(blob)
    assert torch.equal(back.flat_state["m"], opt.flat_state["m"]) and back.round == 1
    back.step([torch.randn(D)])
    assert back.round == 2


def test_public_names_of_the_single_file_modules_remain():
    opt = server.FedAvg(torch.zeros(D))
    assert isinstance(opt.state, server.ParamState)
    assert {"FORMAT_VERSION", "flat_checkpoint", "torch_checkpoint", "BUFFER_POLICIES", "BIAS_CORRECTIONS",
            "StepStats", "ServerOptimizer"} <= set(dir(server))
    acc = PrivacyAccountant(noise_multiplier=1.0, delta=1e-5)
    for _ in range(3):
        acc.step()
    assert acc.from_scratch() == pytest.approx(acc.epsilon(), rel=1e-3)
