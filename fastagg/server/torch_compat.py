"""What torch.optim expects of an optimizer, over fastagg's flat buffers: hyperparameters kept in
``param_groups[0]`` (where lr schedulers read and write them), ``state`` as a per-parameter view, and the
torch.distributed group held weakly."""
from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Mapping

import numpy as np
import torch

from ..backends import resolve
from ..stream import Accumulator

__all__ = ["Hyper", "ParamState", "GroupRef", "check_group", "add_param_group", "zero_grad", "restore", "with_closure"]


class GroupRef:
    """The optimizer's torch.distributed group, held weakly: torch's registry keeps a group alive until
    ``destroy_process_group``, and an optimizer still holding it afterwards would make the group's C++ object die
    during interpreter shutdown, which made gloo abort at exit ("terminate called without an active exception",
    1 run in 4-10 of the README's two-rank block; 0 in 15 with the reference dropped). A step after the group was
    destroyed raises a clear error."""

    def __init__(self, group):
        self.strong = self.weak = None
        if group is not None:
            try:
                self.weak = weakref.ref(group)
            except TypeError:  # a group object without weak references: held as given
                self.strong = group

    def get(self):
        if self.weak is None:
            return self.strong
        group = self.weak()
        if group is None:
            raise RuntimeError("this optimizer's torch.distributed group was destroyed (destroy_process_group): "
                               "build the optimizer again on a live group")
        return group


class Hyper:
    """A hyperparameter kept in ``param_groups[0]``, where torch's lr schedulers read and write it; the step checks
    a changed value as the constructor does before using it."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, cls=None):
        return self if obj is None else obj.param_groups[0][self.name]

    def __set__(self, obj, value) -> None:
        obj.param_groups[0][self.name] = value
        obj.defaults[self.name] = value


class ParamState(Mapping):
    """torch.optim's ``state``: parameter -> ``{buffer name: that parameter's slice of the buffer, shaped like it}``
    plus the shared 0-d ``step`` (rounds applied). The slices are views of the flat buffers the fused step writes
    (:attr:`ServerOptimizer.flat_state`), so they are current after every step. A buffer's name as the key
    (``opt.state["momentum_buffer"]``) gives the whole flat buffer, as fastagg's optimizers did before they were
    torch Optimizers; iteration yields the parameters only."""

    def __init__(self, opt: "torch.optim.Optimizer"):
        self._owner = weakref.ref(opt)  # weakly: the optimizer holds this, and a cycle would outlive its last user
        self._ids: tuple = (None, {})  # (the params list it indexes, id -> position)

    @property
    def _opt(self) -> "torch.optim.Optimizer":
        opt = self._owner()
        if opt is None:
            raise RuntimeError("the optimizer this state belongs to was deleted")
        return opt

    def _index(self, key) -> int | None:
        params = self._opt.param_groups[0]["params"]
        if self._ids[0] is not params or len(self._ids[1]) != len(params):  # built once per params list
            self._ids = (params, {id(p): k for k, p in enumerate(params)})
        k = self._ids[1].get(id(key))
        return k if k is not None and params[k] is key else None

    def __getitem__(self, key):
        if isinstance(key, str):
            return self._opt._flat[key]
        k = self._index(key)
        if k is None:
            raise KeyError("not a parameter of this optimizer")
        return self._opt._param_state(k)

    def __contains__(self, key) -> bool:
        return key in self._opt._flat if isinstance(key, str) else self._index(key) is not None

    def __iter__(self):
        return iter(self._opt.param_groups[0]["params"])

    def __len__(self) -> int:
        return len(self._opt.param_groups[0]["params"])

    def __repr__(self) -> str:
        return f"ParamState({len(self)} parameters; buffers {sorted(self._opt._flat)})"



def check_group(opt) -> None:
    """The hyperparameters in ``opt.param_groups[0]`` (a scheduler may have changed them), checked as the
    constructor checks them (on a probe optimizer, ``opt._probe``), before a step uses them; checked values are
    remembered, so an unchanged group costs one dict comparison."""
    group = opt.param_groups[0]
    missing = [k for k in opt._hyper if k not in group]
    if missing:
        raise KeyError(f"param_groups[0] has no {missing[0]!r}; {type(opt).__name__} needs {', '.join(opt._hyper)}")
    now = {k: group[k] for k in opt._hyper}
    if now == opt._checked_hyper:
        return
    try:
        probe = opt._probe(now)
    except (TypeError, ValueError) as e:
        raise type(e)(f"param_groups[0] holds an invalid value (set by a scheduler or by hand?): {e}") from e
    for k in opt._hyper:
        group[k] = getattr(probe, k)
    opt._checked_hyper = {k: group[k] for k in opt._hyper}


def add_param_group(opt, param_group: dict) -> None:
    """torch's ``add_param_group`` for an optimizer that holds exactly one group (one fused rule over the whole
    flattened model): a second one is refused. The first is the one the constructor builds from validated params;
    it is set here without torch's version, whose first call imports torch._dynamo (~1 s, and dynamo imported after
    init_process_group keeps the default group alive past destroy_process_group, which made gloo abort at
    interpreter exit)."""
    if opt.param_groups:
        raise ValueError(f"{type(opt).__name__} holds one parameter group (the whole model, one fused rule); "
                         "build another optimizer for other parameters")
    opt.param_groups.append({**opt.defaults, **param_group, "params": list(param_group["params"])})


def zero_grad(tensors: list, set_to_none: bool = True) -> None:
    """torch's ``zero_grad`` over ``tensors``, without torch._dynamo (see :func:`add_param_group`)."""
    for p in tensors:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.detach_().requires_grad_(False)
            p.grad.zero_()


def restore(opt, state: dict) -> None:
    """``__setstate__`` (unpickling): the attributes back, torch's hook tables where an older pickle has none (as
    torch's ``__setstate__``), the backend resolved by name, ``state`` as a view of the restored buffers, and a
    fresh lock for the steps."""
    opt.__dict__.update(state)
    for name in ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                 "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
        opt.__dict__.setdefault(name, collections.OrderedDict())
    opt._backend = resolve(opt._backend_name, opt.device)
    opt.state = ParamState(opt)
    opt._serial = threading.RLock()


def with_closure(step, deltas, weights, base, closure):
    """torch's ``step(closure)`` protocol around ``step(deltas, weights, base=base)``: a callable first argument that
    is no input form is torch's positional closure; the closure runs once under ``torch.enable_grad()`` before the
    round (it usually runs the backward that fills ``.grad``) and its value is returned, as torch's optimizers do."""
    if callable(deltas) and not isinstance(deltas, (torch.Tensor, np.ndarray, Accumulator, list, tuple, Mapping,
                                                    torch.nn.Module)):
        if closure is not None:
            raise TypeError("step() got two closures (positional and closure=)")
        deltas, closure = None, deltas  # opt.step(closure), torch's positional form
    if closure is None:
        return step(deltas, weights, base=base)
    if not callable(closure):
        raise TypeError(f"closure must be callable, got {type(closure).__name__}")
    with torch.enable_grad():
        loss = closure()
    step(deltas, weights, base=base)
    return loss
