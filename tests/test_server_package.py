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


class _CountedFedAvg(server.ServerOptimizer):
    """A rule with a 0-d buffer of its own: ``w <- w + lr * mean``, ``total <- total + ||mean||^2``."""

    _hyper = ("lr",)
    _scalar_state = ("total",)

    def __init__(self, params, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self.lr = lr
        self._flat["total"] = torch.zeros((), dtype=torch.float64, device=self.device)

    def _round(self, stats):
        from fastagg.passes import device_scalar

        eta = device_scalar(self.lr, stats.mean_sq)
        finite = self._check_finite(stats, eta)
        self._apply(stats, eta, finite=finite)
        total = self._flat["total"]
        total.copy_(torch.where(finite, total + stats.mean_sq, total))
        return eta, finite


def test_a_new_rules_own_scalar_state_round_trips_a_checkpoint():
    """A rule's ``_scalar_state`` beyond fastagg's own (step, numerator) is saved as 0-d per parameter and read
    back as 0-d: the page's recipe (declare it, create it in __init__) is all a new rule needs."""
    params = [torch.zeros(3, 2), torch.zeros(5)]
    opt = _CountedFedAvg(params, lr=0.5)
    g = torch.Generator().manual_seed(0)
    expect = 0.0
    for _ in range(3):
        deltas = [[torch.randn(3, 2, generator=g), torch.randn(5, generator=g)] for _ in range(2)]
        mean = [(a + b) / 2 for a, b in zip(*deltas)]
        expect += sum(float((m.double() ** 2).sum()) for m in mean)
        opt.step(deltas)
    sd = opt.state_dict()
    assert all(sd["state"][k]["total"].dim() == 0 for k in range(2))
    back = _CountedFedAvg([torch.zeros(3, 2), torch.zeros(5)], lr=0.5)
    back.load_state_dict(sd)
    assert float(back.flat_state["total"]) == pytest.approx(expect, rel=1e-6)
    assert float(back.flat_state["total"]) == float(opt.flat_state["total"]) and back.round == 3
    sd["state"][1]["total"] = torch.tensor(1.0, dtype=torch.float64)  # the per-parameter copies must agree
    with pytest.raises(ValueError, match="'total' differs between parameters 0 and 1"):
        back.load_state_dict(sd)


def test_fedexpm_refuses_a_negative_numerator():
    """FedExP-M's A is a discounted sum of squared norms: a checkpoint holding A < 0 (eta 0 forever after: the
    model stops while rounds are counted) is refused, nothing changed."""
    opt = server.FedExPM(torch.zeros(D), eps=1e-3)
    opt.step([torch.randn(D), torch.randn(D)])
    sd = opt.state_dict()
    for k in sd["state"]:
        sd["state"][k]["numerator"] = torch.tensor(-1e6, dtype=torch.float64)
    before = {k: v.clone() for k, v in opt.flat_state.items()}
    with pytest.raises(ValueError, match="'numerator' holds negative values"):
        opt.load_state_dict(sd)
    assert all(torch.equal(before[k], v) for k, v in opt.flat_state.items())


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_a_buffer_that_holds_no_values_is_named(kind):
    opt = server.FedAvgM(torch.zeros(D), momentum=0.9)
    opt.step([torch.randn(D)])
    sd = opt.state_dict()
    buf = sd["state"][0]["momentum_buffer"]
    sd["state"][0]["momentum_buffer"] = buf.to("meta") if kind == "meta" else buf.to_sparse()
    with pytest.raises(TypeError, match="state_dict buffer 'momentum_buffer' .*is a .* tensor on .*; expected a dense"):
        opt.load_state_dict(sd)


def test_two_threads_stepping_one_optimizer_lose_no_round():
    """Steps share the optimizer's mean buffers: two threads stepping at once are taken one after the other, so
    every round's mean reaches the params (before: wrong params, no error)."""
    import threading

    w = torch.zeros(4096)
    opt = server.FedAvg(w, backend="cpu")
    g = torch.Generator().manual_seed(1)
    rounds = [[torch.randn(4096, generator=g) for _ in range(3)] for _ in range(60)]
    expect = sum(torch.stack(r).double().mean(0) for r in rounds)
    start = threading.Barrier(2)

    def run(part):
        start.wait()
        for r in part:
            opt.step(r)

    threads = [threading.Thread(target=run, args=(rounds[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert opt.round == 60
    assert torch.allclose(w.double(), expect, atol=1e-4)


@pytest.mark.parametrize("name, drop", [("FedAvgM", "momentum_buffer"), ("FedAdam", "m"), ("FedAdam", "v"),
                                        ("FedExPM", "v"), ("FedExPM", "numerator"), ("Scaffold", "control"),
                                        ("FedACG", "momentum")])
def test_a_checkpoint_past_round_0_missing_a_buffer_is_refused(name, drop):
    """A checkpoint of a rule past its first round that lacks one of the rule's buffers (say FedAdam without v)
    loaded before, restarting the buffer at zero: FedAdam's next step then moved the model ~80x further. It is
    refused, naming the buffer, nothing changed; FedAvgM without momentum keeps no buffer and loads."""
    make = {"FedAvgM": lambda w: server.FedAvgM(w, momentum=0.9), "FedAdam": server.FedAdam,
            "FedExPM": lambda w: server.FedExPM(w, eps=1e-3), "Scaffold": lambda w: server.Scaffold(w, num_clients=4),
            "FedACG": server.FedACG}[name]
    opt = make(torch.zeros(D))
    deltas = [torch.randn(D), torch.randn(D)]
    opt.step(deltas, deltas) if name == "Scaffold" else opt.step(deltas)
    sd = opt.state_dict()
    for k in sd["state"]:
        del sd["state"][k][drop]
    fresh = make(torch.zeros(D))
    before = {k: v.clone() for k, v in fresh.flat_state.items()}
    with pytest.raises(ValueError, match=f"state_dict has no '{drop}' buffer, which {name} keeps"):
        fresh.load_state_dict(sd)
    assert before.keys() == fresh.flat_state.keys() and all(torch.equal(before[k], fresh.flat_state[k]) for k in before)
    plain = server.FedAvgM(torch.zeros(D))
    plain.step(deltas)
    server.FedAvgM(torch.zeros(D)).load_state_dict(plain.state_dict())
