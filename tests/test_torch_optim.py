"""fastagg's server optimizers are torch.optim Optimizers: param_groups and lr schedulers, state keyed by parameter,
torch's checkpoint shape (and fastagg's earlier one), following model.to()/double()/half(), the pseudo-gradient
step of outer optimizers (DiLoCo, torchft), and eval_params() a model can load."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from fastagg import server

SEED = 0


def _net(bn: bool = True) -> torch.nn.Module:
    torch.manual_seed(SEED)
    layers = [torch.nn.Linear(5, 4)] + ([torch.nn.BatchNorm1d(4)] if bn else []) + [torch.nn.ReLU(),
                                                                                  torch.nn.Linear(4, 3)]
    return torch.nn.Sequential(*layers)


def _deltas(model, n=3, seed=1, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return [{k: scale * torch.randn(v.shape, generator=g) for k, v in model.named_parameters()} for _ in range(n)]


def _make(name, params, **kw):
    extra = {"FedExP": dict(eps=1e-3), "FedExPM": dict(eps=1e-3), "ScaffoldExP": dict(eps=1e-3, num_clients=8),
             "Scaffold": dict(num_clients=8)}.get(name, {})
    return getattr(server, name)(params, **extra, **kw)


ALL = ["FedAvg", "FedAvgM", "FedExP", "FedExPM", "Scaffold", "ScaffoldExP", "FedACG", "FedAdam", "FedYogi",
       "FedAdagrad", "FedAMS"]
NO_CONTROL = [n for n in ALL if "Scaffold" not in n]


def _step(opt, deltas):
    if isinstance(opt, (server.Scaffold, server.ScaffoldExP)):
        return opt.step(deltas, [{k: 0.5 * v for k, v in d.items()} for d in deltas])
    return opt.step(deltas)


@pytest.mark.parametrize("name", ALL)
def test_every_server_optimizer_is_a_torch_optimizer_with_lr_in_its_group(name):
    model = _net()
    opt = _make(name, model)
    assert isinstance(opt, torch.optim.Optimizer)
    assert len(opt.param_groups) == 1
    group = opt.param_groups[0]
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]
    assert set(opt._hyper) <= set(group) and "lr" in group
    assert {k: group[k] for k in opt._hyper} == opt.hyperparameters


@pytest.mark.parametrize("name", ALL)
def test_a_scheduler_steps_lr_like_setting_it_by_hand(name):
    """StepLR halves lr every round; an optimizer whose lr is set by hand to the same values takes the same steps."""
    a, b = _net(), _net()
    oa, ob = _make(name, a), _make(name, b)
    sched = torch.optim.lr_scheduler.StepLR(oa, step_size=1, gamma=0.5)
    lr0 = ob.lr
    for t in range(3):
        d = _deltas(a, seed=t)
        _step(oa, d)
        sched.step()
        ob.lr = lr0 * 0.5 ** t
        _step(ob, d)
        ob.lr = lr0 * 0.5 ** (t + 1)
        assert oa.param_groups[0]["lr"] == pytest.approx(lr0 * 0.5 ** (t + 1))
    for (k, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), k
    c = _net()  # and the scheduled lr really acted: a constant lr gives another model
    oc = _make(name, c)
    for t in range(3):
        _step(oc, _deltas(c, seed=t))
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_a_value_a_scheduler_sets_is_checked_before_the_step_and_nothing_changes():
    model = _net()
    opt = server.FedAvgM(model, lr=1.0, momentum=0.9)
    opt.step(_deltas(model))
    before = [p.detach().clone() for p in model.parameters()]
    buf = opt.flat_state["momentum_buffer"].clone()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: -1.0)  # a schedule gone wrong
    assert opt.param_groups[0]["lr"] == -1.0
    with pytest.raises(ValueError, match=r"param_groups\[0\] holds an invalid value.*lr must be"):
        opt.step(_deltas(model))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert torch.equal(opt.flat_state["momentum_buffer"], buf)
    opt.param_groups[0]["momentum"] = 1.5
    opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(ValueError, match="momentum"):
        opt.step(_deltas(model))
    opt.param_groups[0]["momentum"] = np.float64(0.5)  # a numpy number is taken, as the constructor takes it
    opt.step(_deltas(model))
    assert type(opt.momentum) is float and opt.momentum == 0.5
    del sched


def test_one_parameter_group_only():
    model = _net()
    with pytest.raises(TypeError, match="one parameter group"):
        server.FedAdam([{"params": model.parameters(), "lr": 0.1}])
    opt = server.FedAdam(model)
    with pytest.raises(ValueError, match="holds one parameter group"):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})


def test_named_parameters_are_taken_as_a_state_dict_form():
    model = _net(bn=False)
    opt = server.FedAvg(model.named_parameters())
    d = _deltas(model)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt.step(d)
    for k, p in model.named_parameters():
        assert torch.allclose(p, before[k] + sum(x[k] for x in d) / 3, atol=1e-6), k
    assert set(opt.broadcast()) == set(before)


@pytest.mark.parametrize("name", ["FedAvgM", "FedAdam", "FedExPM"])
def test_state_is_keyed_by_parameter_and_shaped_like_it(name):
    model = _net()
    opt = _make(name, model, **({"momentum": 0.9} if name == "FedAvgM" else {}))
    _step(opt, _deltas(model))
    params = list(model.parameters())
    assert list(opt.state) == params and len(opt.state) == len(params)
    vec = [k for k in opt.flat_state if opt.flat_state[k].dim() == 1 and k != "extra"]
    assert vec, opt.flat_state.keys()
    off = 0
    for p in params:
        st = opt.state[p]
        assert p in opt.state
        for k in vec:
            assert st[k].shape == p.shape
            assert torch.equal(st[k].reshape(-1), opt.flat_state[k][off:off + p.numel()])
        assert float(st["step"]) == 1.0
        off += p.numel()
    assert torch.zeros(3) not in opt.state
    with pytest.raises(KeyError):
        opt.state[torch.zeros(3)]
    first = opt.state[params[0]][vec[0]].clone()
    _step(opt, _deltas(model, seed=9))  # the slices are views: current after the next step
    assert not torch.equal(opt.state[params[0]][vec[0]], first)


@pytest.mark.parametrize("name", ALL)
def test_torch_shaped_checkpoint_resumes_bit_for_bit(name):
    a, b = _net(), _net()
    oa = _make(name, a)
    for t in range(2):
        _step(oa, _deltas(a, seed=t))
    sd = oa.state_dict()
    assert set(sd) == {"state", "param_groups", "fastagg"}
    assert sd["param_groups"][0]["params"] == list(range(len(list(a.parameters()))))
    for i, p in enumerate(a.parameters()):
        for k, v in sd["state"][i].items():
            assert v.shape == (p.shape if v.dim() else ()), (i, k)
    b.load_state_dict(a.state_dict())
    ob = _make(name, b)
    ob.load_state_dict(pickle.loads(pickle.dumps(sd)))
    for t in range(2, 4):
        _step(oa, _deltas(a, seed=t))
        _step(ob, _deltas(b, seed=t))
    for (k, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), k


@pytest.mark.parametrize("name", ["FedExP", "FedACG", "FedAdam"])
def test_format_1_checkpoints_still_load(name):
    """A checkpoint written before the optimizers were torch Optimizers (flat buffers by name; FedExP and FedACG
    had no lr then) loads and continues exactly as the torch-shaped one."""
    w = torch.randn(50, generator=torch.Generator().manual_seed(3))
    opt = _make(name, w.clone())
    opt.step(0.1 * torch.randn(4, 50, generator=torch.Generator().manual_seed(4)))
    hyper = {k: v for k, v in opt.hyperparameters.items() if not (k == "lr" and name != "FedAdam")}
    old = {"format": 1, "optimizer": name, "hyperparameters": hyper, "layout": opt.layout.signature(),
           "state": {k: v.clone() for k, v in opt.flat_state.items()}}
    p1, p2 = opt._p.original.clone(), opt._p.original.clone()
    o1, o2 = _make(name, p1), _make(name, p2)
    o1.load_state_dict(old)
    o2.load_state_dict(opt.state_dict())
    d = 0.1 * torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    o1.step(d)
    o2.step(d)
    assert torch.equal(p1, p2) and o1.lr == o2.lr


def test_scheduler_and_optimizer_checkpoints_together():
    """A scheduler's initial_lr lives in the group; saving and loading both resumes the schedule."""
    a, b = _net(), _net()
    oa = server.FedAdam(a, lr=0.1)
    sa = torch.optim.lr_scheduler.ExponentialLR(oa, gamma=0.9)
    for t in range(3):
        oa.step(_deltas(a, seed=t))
        sa.step()
    b.load_state_dict(a.state_dict())
    ob = server.FedAdam(b, lr=0.1)
    ob.load_state_dict(oa.state_dict())
    sb = torch.optim.lr_scheduler.ExponentialLR(ob, gamma=0.9)
    sb.load_state_dict(sa.state_dict())
    assert ob.param_groups[0]["initial_lr"] == 0.1
    for t in range(3, 5):
        oa.step(_deltas(a, seed=t))
        sa.step()
        ob.step(_deltas(b, seed=t))
        sb.step()
    assert ob.lr == pytest.approx(0.1 * 0.9 ** 5) and oa.lr == ob.lr
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("convert", ["double", "half", "to-float64", "data"])
def test_the_optimizer_follows_its_parameters_like_torch_optim(convert):
    """model.double()/.half()/.to(dtype) after the optimizer was built: steps still reach the model (they were
    silent no-ops), with the state cast along; the result equals an optimizer built on the converted model with the
    state loaded."""
    model = _net()
    opt = server.FedAvgM(model, lr=0.7, momentum=0.9)
    opt.step(_deltas(model))
    if convert == "double":
        model.double()
    elif convert == "half":
        model.half()
    elif convert == "to-float64":
        model.to(torch.float64)
    else:
        for p in model.parameters():
            p.data = p.data.clone()
    dtype = next(model.parameters()).dtype
    twin = copy.deepcopy(model)
    ref = server.FedAvgM(twin, lr=0.7, momentum=0.9)
    sd = opt.state_dict()
    ref_sd = ref.state_dict()  # the layout's dtypes differ after a cast: move the state by hand
    for i in sd["state"]:
        ref_sd["state"][i] = {k: (v.to(dtype) if k == "extra" else v) for k, v in sd["state"][i].items()}
    ref_sd["state"] = {i: {k: v.to(torch.float64 if dtype == torch.float64 else v.dtype) if v.dim() else v
                           for k, v in s.items()} for i, s in ref_sd["state"].items()}
    ref.load_state_dict(ref_sd)
    before = [p.detach().clone() for p in model.parameters()]
    d = [{k: v.to(dtype) for k, v in x.items()} for x in _deltas(model, seed=7)]
    opt.step(d)
    ref.step(d)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before)), "the step was a no-op"
    for (k, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), k
    assert opt.flat_state["momentum_buffer"].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert opt.state[next(model.parameters())]["momentum_buffer"].shape == next(model.parameters()).shape


def test_a_replaced_layer_is_refused_not_silently_ignored():
    model = _net()
    opt = server.FedAdam(model)
    model[0] = torch.nn.Linear(5, 4)
    with pytest.raises(RuntimeError, match="parameters were replaced"):
        opt.step(_deltas(model))


def test_buffers_follow_too():
    """BatchNorm statistics moved by model.double() are still averaged from the clients' state_dicts."""
    model = _net()
    opt = server.FedAvg(model)
    model.double()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    clients = [{k: (v + 1.0 if "running_mean" in k else v) for k, v in sd.items()} for _ in range(2)]
    opt.step(clients, base=sd)
    assert torch.equal(model[1].running_mean, sd["1.running_mean"] + 1.0)


@pytest.mark.parametrize("name", NO_CONTROL)
def test_step_without_deltas_reads_pseudo_gradients_from_grad(name):
    """``p.grad = global - local`` then ``opt.step()`` (how DiLoCo calls an outer optimizer) is the same round as
    ``opt.step([local - global])``, bit for bit; the grads are not changed."""
    a, b = _net(bn=False), _net(bn=False)
    oa, ob = _make(name, a), _make(name, b)
    for t in range(3):
        d = _deltas(a, n=1, seed=t)[0]
        for k, p in a.named_parameters():
            p.grad = -d[k]
        grads = [p.grad.clone() for p in a.parameters()]
        sa = oa.step()
        sb = ob.step([d])
        assert all(torch.equal(p.grad, g) for p, g in zip(a.parameters(), grads))
        assert torch.equal(sa.eta, sb.eta) and torch.equal(sa.mean_sq_norm, sb.mean_sq_norm)
        for (k, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(pa, pb), (t, k)
        oa.zero_grad()
        assert all(p.grad is None for p in a.parameters())


def test_step_without_deltas_needs_every_grad_and_no_weights():
    model = _net(bn=False)
    opt = server.FedAvgM(model, momentum=0.9)
    with pytest.raises(ValueError, match=r"parameter '0.weight' has none"):
        opt.step()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(TypeError, match="weights= and base= go with deltas"):
        opt.step(weights=[1.0])
    with pytest.raises(TypeError, match="no pseudo-gradient form"):
        server.Scaffold(model, num_clients=4).step()


@pytest.mark.parametrize("name", ["FedAvgM", "FedAdam", "FedExP"])
def test_a_frozen_parameter_without_grad_stays_as_torch_leaves_it(name):
    """A model with a frozen layer (requires_grad=False, .grad None), as Lightning fine-tuning runs pass
    ``model.parameters()``: torch.optim.SGD skips it; fastagg's optimizers take a zero pseudo-gradient for it, so
    it stays bit for bit, and the trainable layers step as with explicit deltas of zero there."""
    a, b = _net(bn=False), _net(bn=False)
    for m in (a, b):
        m[0].weight.requires_grad_(False)
    oa, ob = _make(name, a), _make(name, b)
    frozen = a[0].weight.detach().clone()
    for t in range(2):
        d = _deltas(a, n=1, seed=t)[0]
        d["0.weight"] = torch.zeros_like(d["0.weight"])
        for k, p in a.named_parameters():
            p.grad = None if k == "0.weight" else -d[k]
        oa.step()
        ob.step([d])
        assert torch.equal(a[0].weight, frozen)
        for (k, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(pa, pb), (t, k)
    a[0].weight.requires_grad_(True)  # trainable again, still without .grad: refused, naming it
    with pytest.raises(ValueError, match=r"parameter '0.weight' has none"):
        oa.step()


def _diloco(outer_factory, rounds=4, replicas=3, local_steps=5):
    """A DiLoCo loop: each replica trains ``local_steps`` AdamW steps from the global model on its own data; the
    pseudo-gradient global - local is averaged over the replicas (what all_reduce does across ranks) into .grad;
    the outer optimizer steps the global model."""
    torch.manual_seed(0)
    global_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    outer = outer_factory(global_model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(replicas)]
    for _ in range(rounds):
        pseudo = [torch.zeros_like(p) for p in global_model.parameters()]
        for x, y in data:
            local = copy.deepcopy(global_model)
            inner = torch.optim.AdamW(local.parameters(), lr=1e-2)
            for _ in range(local_steps):
                inner.zero_grad()
                torch.nn.functional.mse_loss(local(x), y).backward()
                inner.step()
            for acc, pg, pl in zip(pseudo, global_model.parameters(), local.parameters()):
                acc += (pg.detach() - pl.detach()) / replicas
        for p, pg in zip(global_model.parameters(), pseudo):
            p.grad = pg
        outer.step()
        outer.zero_grad()
    return global_model


def test_fedavgm_nesterov_is_diloco_outer_sgd():
    """FedAvgM(lr, momentum, nesterov=True) as DiLoCo's outer optimizer gives torch SGD's(lr, momentum, nesterov)
    model, to float32 rounding."""
    ours = _diloco(lambda m: server.FedAvgM(m, lr=0.7, momentum=0.9, nesterov=True))
    torchs = _diloco(lambda m: torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True))
    for (k, p), q in zip(ours.named_parameters(), torchs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    moved = _diloco(lambda m: server.FedAvgM(m, lr=0.0 + 1e-12, momentum=0.0))
    assert any(not torch.allclose(p, q) for p, q in zip(ours.parameters(), moved.parameters()))


def test_torchft_diloco_takes_a_fastagg_outer_optimizer():
    """torchft's DiLoCo (with a single-replica Manager stand-in, as torchft's own unit tests run it) drives
    fastagg's FedAvgM exactly as torch's SGD: same model after 3 syncs, and its checkpoint functions save and
    restore fastagg's state."""
    from unittest.mock import create_autospec

    from torchft import local_sgd  # a test dependency (pyproject [test]): a missing one fails here
    from torchft.manager import Manager
    from torchft.work import _DummyWork

    def run(outer_factory):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 5))
        inner = torch.optim.AdamW(model.parameters(), lr=4e-2)
        outer = outer_factory(model)
        manager = create_autospec(Manager)
        manager.errored.return_value = None
        manager.allreduce.side_effect = lambda t, should_quantize=False: _DummyWork(t)
        manager._use_async_quorum = False
        manager.should_commit.return_value = True
        manager.current_step.return_value = 0
        x = torch.rand(8, 3, generator=torch.Generator().manual_seed(2))
        with local_sgd.DiLoCo(manager, [model], inner, outer, sync_every=2):
            for _ in range(6):
                inner.zero_grad()
                model(x).square().mean().backward()
                inner.step()
        save = manager.register_state_dict_fn.call_args.args[2]
        return model, outer, save

    ours, outer, save = run(lambda m: server.FedAvgM(m, lr=0.7, momentum=0.9, nesterov=True))
    ref, _, _ = run(lambda m: torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True))
    for (k, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    assert outer.round == 3
    ckpt = save()
    fresh = server.FedAvgM(copy.deepcopy(ours), lr=0.7, momentum=0.9, nesterov=True)
    fresh.load_state_dict(ckpt["outer_optimizer"])
    assert torch.equal(fresh.flat_state["momentum_buffer"], outer.flat_state["momentum_buffer"])


@pytest.mark.parametrize("name", ["FedAvg", "FedExP", "FedACG"])
def test_eval_params_and_broadcast_are_one_loadable_form_every_time(name):
    """For a module: a full state_dict (buffers included) before and after the first step, which
    ``model.load_state_dict`` takes strictly; for tensors: a tensor; for a list: a list."""
    model = _net()
    opt = _make(name, model)
    keys = list(model.state_dict())
    for t in range(2):
        for got in (opt.eval_params(), opt.broadcast()):
            assert isinstance(got, dict) and list(got) == keys, t
            copy.deepcopy(model).load_state_dict(got)  # strict
        opt.step([{k: v for k, v in d.items()} for d in _deltas(model, seed=t)])
    flat = _make(name, torch.zeros(10))
    listed = _make(name, [torch.zeros(4), torch.zeros(6)])
    for t in range(2):
        assert isinstance(flat.eval_params(), torch.Tensor) and isinstance(flat.broadcast(), torch.Tensor)
        assert isinstance(listed.eval_params(), list) and [x.shape for x in listed.eval_params()] == [(4,), (6,)]
        flat.step(torch.ones(2, 10))
        listed.step([[torch.ones(4), torch.ones(6)]])


def test_fedexp_eval_model_loaded_into_a_batchnorm_model():
    """The FedExP evaluation model (average of the last two iterates) is the params' state_dict with them replaced:
    loading it gives the model (w_prev + w) / 2 and the averaged BatchNorm statistics."""
    model = _net()
    opt = server.FedExP(model, eps=1e-3)
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    clients = [{k: (v + 0.1 * (i + 1) if v.is_floating_point() else v) for k, v in sd.items()} for i in range(3)]
    opt.step(clients, base=sd)
    ev = opt.eval_params()
    target = copy.deepcopy(model)
    target.load_state_dict(ev)
    for k, p in target.named_parameters():
        torch.testing.assert_close(p, (w0[k] + dict(model.named_parameters())[k]) / 2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(target[1].running_mean, sd["1.running_mean"] + 0.2)


def test_deepcopy_and_pickle_keep_working_optimizers():
    model = _net()
    opt = server.FedAdam(model)
    opt.step(_deltas(model))
    twin = copy.deepcopy(opt)
    twin_model = twin._p.original
    twin.step(_deltas(model, seed=5))
    opt.step(_deltas(model, seed=5))
    for (k, p), q in zip(model.named_parameters(), twin_model.parameters()):
        assert torch.equal(p, q), k
    again = pickle.loads(pickle.dumps(opt))
    assert again.round == 2 and torch.equal(again.flat_state["m"], opt.flat_state["m"])


def test_lr_scales_the_fedexp_step_and_reports_it():
    """lr (default 1: the published rule) multiplies FedExP's step; last_stats.eta is lr * eta."""
    d = 0.1 * torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    w1, w2 = torch.zeros(40), torch.zeros(40)
    s1 = server.FedExP(w1, eps=1e-3).step(d)
    s2 = server.FedExP(w2, eps=1e-3, lr=0.5).step(d)
    torch.testing.assert_close(s2.eta, 0.5 * s1.eta)
    torch.testing.assert_close(w2, 0.5 * w1)


# -- torch's own optimizer conventions (torch/testing/_internal/common_optimizers.py checks them for torch's) ------
def _hooked(opt, log):
    """Register one of each state_dict / load_state_dict hook on ``opt``, logging what torch says they get."""
    opt.register_state_dict_pre_hook(lambda o: log.append(("sd_pre", o is opt)))
    opt.register_state_dict_pre_hook(lambda o: log.append(("sd_pre_first", o is opt)), prepend=True)

    def sd_post(o, sd):
        log.append(("sd_post", o is opt, "state" in sd))
        return {**sd, "note": "added by a post hook"}

    def load_pre(o, sd):
        log.append(("load_pre", o is opt, "note" in sd))
        sd.pop("note")  # a shallow copy: the caller's dict keeps it
        return None

    opt.register_state_dict_post_hook(sd_post)
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: log.append(("load_post", o is opt)))


def test_state_dict_and_load_hooks_run_as_torchs_do():
    """torch.optim.Adam and fastagg's FedAdam with the same hooks: the same calls in the same order, the post hook's
    dict is the checkpoint, the load pre hook edits a shallow copy, the load post hook sees the loaded state."""
    logs = {}
    for kind in ("torch", "fastagg"):
        model = _net(bn=False)
        opt = torch.optim.Adam(model.parameters(), lr=0.1) if kind == "torch" else server.FedAdam(model)
        if kind == "torch":
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
        else:
            opt.step([_deltas(model, n=1)[0]])
        log = logs[kind] = []
        _hooked(opt, log)
        sd = opt.state_dict()
        assert sd["note"] == "added by a post hook"
        opt.register_load_state_dict_post_hook(lambda o: log.append(("step", float(o.state[next(iter(
            o.param_groups[0]["params"]))]["step"]))))
        opt.load_state_dict(sd)
        assert sd["note"] == "added by a post hook"  # the caller's dict is not the one the pre hook edited
    assert logs["fastagg"] == logs["torch"] == [
        ("sd_pre_first", True), ("sd_pre", True), ("sd_post", True, True), ("load_pre", True, True),
        ("load_post", True), ("step", 1.0)]


def test_a_load_pre_hook_may_return_the_checkpoint_to_load():
    """torch: a load pre hook's returned dict replaces the one given (e.g. a checkpoint converter)."""
    model = _net(bn=False)
    src = server.FedAdam(model)
    src.step([_deltas(model, n=1)[0]])
    saved = src.state_dict()
    opt = server.FedAdam(_net(bn=False))
    opt.register_load_state_dict_pre_hook(lambda o, sd: sd["wrapped"])
    opt.load_state_dict({"wrapped": saved})
    assert opt.round == 1 and torch.equal(opt.flat_state["m"], src.flat_state["m"])


def _lightning_run(make, closure_form):
    """Three steps of ``opt.step(closure)`` as PyTorch Lightning calls it (the closure zeroes the grads, runs the
    forward and the backward, returns the loss), from inside ``torch.no_grad()`` as torch's own step runs."""
    torch.manual_seed(SEED)
    model = torch.nn.Linear(5, 3)
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    opt = make(model)
    losses = []
    for _ in range(3):
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        with torch.no_grad():
            losses.append(opt.step(closure) if closure_form == "positional" else opt.step(closure=closure))
    return model, losses


@pytest.mark.parametrize("closure_form", ["positional", "keyword"])
def test_step_closure_is_torchs(closure_form):
    """``step(closure)``: the closure runs with grad enabled, its value is returned, and the round reads the grads
    it left: FedAvgM(lr, momentum) on those pseudo-gradients is torch SGD(lr, momentum), to float32 rounding."""
    ours, ours_losses = _lightning_run(lambda m: server.FedAvgM(m, lr=0.3, momentum=0.9), closure_form)
    theirs, their_losses = _lightning_run(lambda m: torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9),
                                          closure_form)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in ours_losses)
    torch.testing.assert_close(torch.stack(ours_losses), torch.stack(their_losses), rtol=1e-5, atol=1e-7)
    assert float(ours_losses[-1].detach()) < float(ours_losses[0].detach())  # it did train
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_step_closure_with_deltas_and_bad_closure():
    w = torch.zeros(4)
    opt = server.FedAvg(w)
    assert opt.step([torch.ones(4)], closure=lambda: 3.5) == 3.5 and torch.equal(w, torch.ones(4))
    with pytest.raises(TypeError, match="closure must be callable, got int"):
        opt.step([torch.ones(4)], closure=7)
    with pytest.raises(TypeError, match="two closures"):
        opt.step(lambda: 1.0, closure=lambda: 2.0)
    assert torch.equal(w, torch.ones(4)) and opt.round == 1


@pytest.mark.parametrize("direction", ["parameters->named", "named->parameters", "module->parameters"])
def test_checkpoint_loads_across_parameters_and_named_parameters(direction):
    """As torch.optim.Adam does, a checkpoint saved from ``parameters()`` loads into an optimizer built on
    ``named_parameters()`` (or the module) and back, and the run continues exactly as the saving one."""
    src_of, dst_of = {"parameters->named": (lambda m: m.parameters(), lambda m: m.named_parameters()),
                      "named->parameters": (lambda m: m.named_parameters(), lambda m: m.parameters()),
                      "module->parameters": (lambda m: m, lambda m: m.parameters())}[direction]
    for torch_side in (True, False):  # torch's Adam first: the convention itself
        a, b = _net(bn=False), _net(bn=False)
        make = (lambda p: torch.optim.Adam(p, lr=0.01)) if torch_side else server.FedAdam
        src = (lambda m: m.named_parameters()) if torch_side and direction.startswith("module") else src_of
        oa = make(src(a))
        for t in range(2):
            _torch_or_ours_step(oa, a, t, torch_side)
        b.load_state_dict(a.state_dict())
        ob = make(dst_of(b))
        ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # (torch's state_dict and load share tensors)
        for t in range(2, 4):
            _torch_or_ours_step(oa, a, t, torch_side)
            _torch_or_ours_step(ob, b, t, torch_side)
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb), (direction, torch_side)


def _torch_or_ours_step(opt, model, t, torch_side):
    d = _deltas(model, n=1, seed=t)[0]
    if torch_side:
        for k, p in model.named_parameters():
            p.grad = -d[k]
        opt.step()
    else:
        opt.step([d])


def test_a_refused_checkpoint_names_the_real_difference():
    """Only the names differ: the error names them (not two equal shapes); a shape differs: it names the shapes;
    nothing changes."""
    src = server.FedAdam({"w": torch.zeros(3, 2), "b": torch.zeros(3)})
    src.step([{"w": torch.ones(3, 2), "b": torch.ones(3)}])
    other_names = server.FedAdam({"weight": torch.zeros(3, 2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"entry 0: it is named 'w'; this parameter is 'weight'"):
        other_names.load_state_dict(src.state_dict())
    other_shape = server.FedAdam([torch.zeros(2, 3), torch.zeros(3)])
    with pytest.raises(ValueError, match=r"entry 0 \(w\): its shape is \(3, 2\); this parameter's is \(2, 3\)"):
        other_shape.load_state_dict(src.state_dict())
    other_dtype = server.FedAdam([torch.zeros(3, 2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"its dtype is torch.float32; this parameter's is torch.float64"):
        other_dtype.load_state_dict(src.state_dict())
    for opt in (other_names, other_shape, other_dtype):
        assert opt.round == 0 and set(opt.flat_state) == {"step"}


def test_plain_number_step_in_a_loaded_state_is_taken_as_torch_takes_it():
    """torch.optim.Adam loads ``"step": 2`` (a plain number, as older checkpoints kept it) and continues as from the
    tensor; fastagg's FedAdam too. A step that is no whole number >= 0 is still refused, naming it."""
    for torch_side in (True, False):
        a, b = _net(bn=False), _net(bn=False)
        make = (lambda p: torch.optim.Adam(p.parameters(), lr=0.01)) if torch_side else server.FedAdam
        oa = make(a)
        for t in range(2):
            _torch_or_ours_step(oa, a, t, torch_side)
        sd = copy.deepcopy(oa.state_dict())  # (torch's state_dict holds its live state tensors)
        for s in sd["state"].values():
            s["step"] = int(s["step"])
        b.load_state_dict(a.state_dict())
        ob = make(b)
        ob.load_state_dict(sd)
        _torch_or_ours_step(oa, a, 2, torch_side)
        _torch_or_ours_step(ob, b, 2, torch_side)
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb), torch_side
    assert ob.round == 3
    for s in sd["state"].values():
        s["step"] = 1.5
    with pytest.raises(ValueError, match=r"'step' is 1.5; expected a whole number in \[0, 2\^53\]"):
        ob.load_state_dict(sd)
    assert ob.round == 3


def test_a_step_tensor_of_torchs_dtypes_loads_and_a_bad_one_is_refused_naming_it():
    """torch.optim.Adam keeps ``step`` as a float32 0-d tensor (others an int64 one) and loads either; fastagg takes
    them too (float32 and ints within 2^53 convert exactly). Refused, naming the problem, with nothing changed: a
    step beyond 2^53 (the float64 counter would stop counting: round + 1 == round), NaN, a 1-element 1-d tensor."""
    net = _net(bn=False)
    opt = server.FedAdam(net)
    _torch_or_ours_step(opt, net, 0, False)
    good = copy.deepcopy(opt.state_dict())
    for step in (torch.tensor(7.0), torch.tensor(7), torch.tensor(7, dtype=torch.int32), 7, 7.0):
        sd = copy.deepcopy(good)
        for s in sd["state"].values():
            s["step"] = step.clone() if isinstance(step, torch.Tensor) else step
        fresh = server.FedAdam(_net(bn=False))
        fresh.load_state_dict(sd)
        assert fresh.round == 7, step
    for step, message in ((torch.tensor(2.0**60), r"expected a whole number in \[0, 2\^53\]"),
                          (2**70, r"expected a whole number in \[0, 2\^53\]"),
                          (1e300, r"expected a whole number in \[0, 2\^53\]"),
                          (torch.tensor(float("nan")), r"'step' of parameter 0 is nan; expected a finite number"),
                          (torch.tensor([3.0]), r"'step' of parameter 0 has shape \(1,\); expected a number or a 0-d")):
        sd = copy.deepcopy(good)
        for s in sd["state"].values():
            s["step"] = step
        with pytest.raises(ValueError, match=message):
            opt.load_state_dict(sd)
        assert opt.round == 1, step


@pytest.mark.parametrize("name", ["FedAdam", "FedExPM", "FedAvgM"])
def test_flat_checkpoint_output_loads_and_resumes(name):
    """``flat_checkpoint(opt.state_dict())`` (the flat form, format 2) loads into ``load_state_dict`` and the run
    continues exactly as from the torch-shaped checkpoint."""
    a = _net(bn=False)
    oa = _make(name, a)
    for t in range(2):
        _step(oa, _deltas(a, seed=t))
    sd = oa.state_dict()
    flat = server.flat_checkpoint(sd)
    assert flat["format"] == server.FORMAT_VERSION
    b1, b2 = _net(bn=False), _net(bn=False)
    b1.load_state_dict(a.state_dict())
    b2.load_state_dict(a.state_dict())
    o1, o2 = _make(name, b1), _make(name, b2)
    o1.load_state_dict(flat)
    o2.load_state_dict(sd)
    assert server.flat_checkpoint(o1.state_dict())["layout"] == flat["layout"]
    _step(o1, _deltas(a, seed=5))
    _step(o2, _deltas(a, seed=5))
    for p, q in zip(b1.parameters(), b2.parameters()):
        assert torch.equal(p, q)


def test_a_refused_flat_checkpoint_names_its_real_problem():
    opt = server.FedAdam(torch.zeros(6))
    opt.step([torch.ones(6)])
    flat = server.flat_checkpoint(opt.state_dict())
    before = {k: v.clone() for k, v in opt.flat_state.items()}
    with pytest.raises(ValueError, match=r"has format 3; expected 2 or 1"):
        opt.load_state_dict({**flat, "format": 3})
    with pytest.raises(ValueError, match=r"no 'layout' entry"):
        opt.load_state_dict({k: v for k, v in flat.items() if k != "layout"})
    with pytest.raises(ValueError, match=r"state_dict is from FedYogi; this optimizer is FedAdam"):
        opt.load_state_dict({**flat, "optimizer": "FedYogi"})
    with pytest.raises(ValueError, match=r"'m' has shape \(5,\); expected \(6,\)"):
        opt.load_state_dict({**flat, "state": {**flat["state"], "m": torch.zeros(5)}})
    assert all(torch.equal(opt.flat_state[k], v) for k, v in before.items())
