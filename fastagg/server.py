"""Stateful server optimizers, shaped like torch optimizers, built on the fused two-pass round.

Every ``step`` runs one stats pass over the client updates (or takes an :class:`~fastagg.Accumulator`'s sums),
computes the rule's scalars on the device, and runs one apply pass that reads the mean, the rule's state and the
params once and writes state and params once; the apply pass does nothing when a client was non-finite, and the
scalar state (round counter, FedExP-M's numerator) is updated on the device only when the round was applied.

Sign convention: ``delta_i = client model - the model the server broadcast``; the server adds its step.
Names follow torch (``lr``, ``momentum``, ``nesterov``, ``betas``), defaults follow Flower 1.42's message-API
strategies, so switching from Flower with the same settings gives the same numbers.
"""
from __future__ import annotations

import weakref

import collections
import contextlib
import copy
import dataclasses
import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from . import fedexp_rule as rules
from ._aliasing import check_writes
from ._checks import check_number, check_on_nonfinite, check_prob
from .backends import resolve
from .compress.fold import CompressedRows, check_batch, compressed_list, dense_rows, nonfinite_scales
from .passes import (RoundStats, buffer_updates, check_finite, check_overflow, client_stats, device_scalar,
                     like_params, overflow_counter, warn_unmatched_buffers, write_buffers)
from .flat import as_tensor, split_entries
from .rows import ParamRows, attach_base, client_rows, compute_dtype, param_rows, round_reads
from .stream import Accumulator
from .checkpoint import (FORMAT_VERSION, GROUP_KEYS, SCALAR_STATE, check_layout, flat_checkpoint, plain_number,
                         scalar_tensor, torch_checkpoint)


__all__ = ["ServerOptimizer", "FedAvg", "FedAvgM", "FedExP", "FedExPM", "Scaffold", "ScaffoldExP", "FedACG", "FedAdam",
           "FedYogi", "FedAdagrad", "FedAMS", "QFedAvg", "StepStats"]


@dataclasses.dataclass
class StepStats:
    """The last step's statistics (device tensors): the step size ``eta`` (the effective learning rate for the
    Adam family), ``mean_sq_norm`` (``||mean||^2``; FedExP-M: ``||v||^2``), ``avg_sq_norm``
    (``sum_i p_i ||delta_i||^2``), per-client ``sq_norms``, ``finite`` and per-client ``nonfinite``."""

    eta: torch.Tensor
    mean_sq_norm: torch.Tensor
    avg_sq_norm: torch.Tensor
    sq_norms: torch.Tensor
    finite: torch.Tensor
    nonfinite: torch.Tensor
    num_clients: int
    overflowed: torch.Tensor | None = None  # int32 [1]: elements left unchanged because their new value overflowed
    robust: Any = None  # with aggregate=: the round's fastagg.robust.RobustResult (selected, excluded, scores, ...)
    #                     or fastagg.privacy.DPResult (clipping norm, noise std, clipped, epsilon, ...)


def _per_client(stats) -> torch.Tensor:
    """One non-finite flag per client, whatever the input: an Accumulator's statistics carry one flag for its sum
    (a non-finite client was refused at ``add``, so each folded client gets the sum's flag)."""
    flags = stats.nonfinite
    return flags if flags.numel() == stats.num_clients else flags.reshape(-1)[:1].expand(stats.num_clients).clone()


def _no_clients_given(x: Any) -> bool:
    """An empty list of clients, or a [0, d] matrix: a rank of a group with no client this round."""
    if isinstance(x, (list, tuple)):
        return len(x) == 0
    return isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim == 2 and x.shape[0] == 0


class _GroupRef:
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


class _Hyper:
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

    def __init__(self, opt: "ServerOptimizer"):
        self._owner = weakref.ref(opt)  # weakly: the optimizer holds this, and a cycle would outlive its last user
        self._ids: tuple = (None, {})  # (the params list it indexes, id -> position)

    @property
    def _opt(self) -> "ServerOptimizer":
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


def _named_pairs(params: list) -> bool:
    """``model.named_parameters()`` materialized: (name, tensor) pairs."""
    return bool(params) and all(isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str)
                                and isinstance(e[1], torch.Tensor) for e in params)


BUFFER_POLICIES = ("average", "optimizer")


def _torch_params(p: ParamRows, buffers_count: bool = False) -> list:
    """The tensors torch.optim keeps in ``param_groups``: the module's Parameters (and floating buffers, when they
    count), or the user's own tensors (numpy arrays as tensors sharing their memory, a non-leaf view detached), in
    the order of the flat buffer."""
    orig = p.original
    if isinstance(orig, torch.nn.Module):
        extra = [b for _, b in orig.named_buffers() if b.is_floating_point()] if buffers_count else []
        return list(orig.parameters()) + extra
    named, _ = ([(None, orig)], None) if isinstance(orig, (torch.Tensor, np.ndarray)) else split_entries(
        orig, where="params", buffers_count=buffers_count)
    return [v if isinstance(v, torch.Tensor) and (v.is_leaf or v.retains_grad) else as_tensor(v).detach()
            for _, v in named]


class ServerOptimizer(torch.optim.Optimizer):
    """Base class: a ``torch.optim.Optimizer`` over the global model with one parameter group (the whole flattened
    model, one fused rule), flat state buffers created on first use (float32; float64 for float64 params), a device
    round counter, and ``state_dict`` / ``load_state_dict`` in torch's ``{state, param_groups}`` shape.

    Like torch's optimizers it follows its parameters: after ``model.to(device)``, ``model.double()`` or
    ``model.half()`` (or ``p.data = ...``) the next step works on the parameters' new storage, with the state
    moved and cast to match. Hyperparameters live in ``param_groups[0]`` (``lr`` in every optimizer), so
    ``torch.optim.lr_scheduler`` schedulers work; a value they set is checked as the constructor checks it.

    ``buffers="average"`` (default): a module's or state_dict's buffers (BatchNorm statistics, counters) become
    the clients' weighted average, never stepped or counted; ``"optimizer"``: floating buffers are parameters,
    stepped by the rule and counted in its statistics, as Flower's strategies treat every array (integer buffers
    keep the average rule).

    Subclasses define ``_hyper`` (the hyperparameters a checkpoint carries) and ``_round(stats)``, and set
    ``needs_client_norms`` when the rule reads the clients' norms (then an Accumulator built with
    ``client_norms=False`` is refused).
    """

    group = property(lambda self: self._group.get(), doc="The torch.distributed group of the step, or None.")

    # True where the rule writes the params by one _momentum call and reads no param value before it: its apply
    # pass can read them from a start model (_step_from)
    _apply_reads_start = False
    # True where the rule reads the round's mean only in that _momentum call (and its scalars from the stats):
    # stepping on an Accumulator, the stats pass then writes no mean and the apply reads the sum scaled
    _apply_reads_sum = False

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        for name in cls._hyper:
            if not isinstance(getattr(cls, name, None), _Hyper):
                setattr(cls, name, _Hyper(name))

    def __init__(self, params: Any, *, backend: str = "auto", on_nonfinite: str = "raise", group: Any = None,
                 sharded: bool = False, buffers: str = "average", aggregate: Any = None):
        if buffers not in BUFFER_POLICIES:
            raise ValueError(f"buffers must be one of {BUFFER_POLICIES}, got {buffers!r}")
        self.buffers = buffers
        if aggregate is not None:
            from . import privacy, robust

            if not isinstance(aggregate, robust.RULES + privacy.MECHANISMS):
                raise TypeError(f"aggregate must be a fastagg.robust rule ({', '.join(r.__name__ for r in robust.RULES)})"
                                f" or a fastagg.privacy mechanism ({', '.join(r.__name__ for r in privacy.MECHANISMS)})"
                                f", got {type(aggregate).__name__}")
            if group is not None:
                raise ValueError("aggregate= with group=: robust rules and DP mechanisms need every client's update on "
                                 "one rank (not yet across ranks); gather the updates first")
        self.aggregate = aggregate
        self._robust = None
        if isinstance(params, Iterator):  # model.parameters(), model.named_parameters()
            params = list(params)
        if isinstance(params, list) and params and all(isinstance(e, dict) and "params" in e for e in params):
            raise TypeError(f"{type(self).__name__} takes one parameter group (the whole model, updated by one fused "
                            "rule): pass the parameters or the module, and the hyperparameters as arguments")
        if isinstance(params, list) and _named_pairs(params):
            params = dict(params)  # named_parameters(): the state_dict form, keyed by name
        check_on_nonfinite(on_nonfinite)
        # torch.distributed (fastagg.distributed): with a group, each rank holds some clients' updates (default) or,
        # sharded, one slice of the params, of the state and of every client's update
        if sharded and group is None:
            raise ValueError("sharded=True needs group= (the ranks that hold the other slices)")
        self._group = _GroupRef(group)
        self.sharded = bool(sharded)
        self._p: ParamRows = param_rows(params, buffers_count=buffers == "optimizer")
        torch.optim.Optimizer.__init__(self, [{"params": _torch_params(self._p, buffers == "optimizer")}], {})
        self.state = ParamState(self)  # torch's per-parameter view of the flat buffers below
        self.layout = self._p.form
        self.device = self._p.device
        self.on_nonfinite = on_nonfinite
        self._backend_name = backend
        self._backend = resolve(backend, self.device)
        self._cdt = compute_dtype(self._p.dtype)
        self._flat: dict[str, torch.Tensor] = {"step": torch.zeros((), dtype=torch.float64, device=self.device)}
        self.last_stats: StepStats | None = None
        self._extra: ParamRows | None = None  # eval model or broadcast point, in params' dtype
        self._means: dict = {}  # reused mean buffers by dtype: a fresh 40 MB one costs ~17 ms of page faults
        self._borrowed: list = []  # (accumulator, spare) lent as a step's mean, given back when the step ends
        self._start: list | None = None  # _step_from's start model (flat parts), until the apply pass reads it
        self._checked_hyper: dict | None = None  # the group's values as last checked
        self._bound = self._binding()

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``; a fastagg optimizer holds exactly one group (one fused rule over the whole
        flattened model), so a second one is refused. The first is the one the constructor builds from validated
        params; it is set here without torch's version, whose first call imports torch._dynamo (~1 s, and
        dynamo imported after init_process_group keeps the default group alive past destroy_process_group, which
        made gloo abort at interpreter exit)."""
        if self.param_groups:
            raise ValueError(f"{type(self).__name__} holds one parameter group (the whole model, one fused rule); "
                             "build another optimizer for other parameters")
        self.param_groups.append({**self.defaults, **param_group, "params": list(param_group["params"])})

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``: clear the parameters' ``.grad`` (the pseudo-gradients :meth:`step` reads when
        called without deltas); without torch._dynamo (see :meth:`add_param_group`)."""
        for p in self.param_groups[0]["params"]:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False)
                p.grad.zero_()

    def __getstate__(self) -> dict:  # torch's keeps only defaults, state and param_groups; the backend by name
        return {k: v for k, v in self.__dict__.items() if k not in ("_backend", "state")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for name in ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            self.__dict__.setdefault(name, collections.OrderedDict())  # (as torch's __setstate__)
        self._backend = resolve(self._backend_name, self.device)
        self.state = ParamState(self)  # a view of the flat buffers restored above

    # -- following the parameters -------------------------------------------------------------------------------
    def _binding(self) -> tuple:
        """What the flat views were made from: each parameter's storage (a dtype or device change gives a new one)
        and, for a module, every entry of its modules', parameters' and buffers' tables (a replaced layer or a
        buffer moved by ``model.to``). Cheap: no module traversal per step."""
        ptrs = tuple(t.data_ptr() for t in self.param_groups[0]["params"])
        orig = self._p.original
        if not isinstance(orig, torch.nn.Module):
            return ptrs, ()
        tables = [d for m in orig.modules() for d in (m._modules, m._parameters, m._buffers) if d]
        return ptrs, tuple((d, len(d), tuple(d.items())) for d in tables)

    def _moved(self) -> bool:
        ptrs, tables = self._bound
        if ptrs != tuple(t.data_ptr() for t in self.param_groups[0]["params"]):
            return True
        for d, n, items in tables:
            if len(d) != n or any(d.get(k) is not v for k, v in items):
                return True
        return False

    def _follow(self) -> None:
        """Re-bind to the parameters when they moved (``model.to``/``.double()``/``.half()``): new views, the
        state moved to their device and cast to their compute dtype, the backend chosen for that device."""
        if not self._moved():
            return
        orig = self._p.original
        group = self.param_groups[0]["params"]
        mine = list(orig.parameters()) if isinstance(orig, torch.nn.Module) else []
        if [id(t) for t in mine] != [id(t) for t in group[:len(mine)]]:
            raise RuntimeError(f"the module's parameters were replaced since {type(self).__name__} was built (a "
                               "layer assigned anew?): build the optimizer again on the module")
        new = param_rows(orig, buffers_count=self.buffers == "optimizer")
        if new.segments.lens != self._p.segments.lens:
            raise RuntimeError(f"the parameters changed size since {type(self).__name__} was built "
                               f"({list(self._p.segments.lens)} -> {list(new.segments.lens)} elements)")
        cdt = compute_dtype(new.dtype)
        kinds = {"extra": new.dtype, **{k: cdt for k in self._vector_state}}
        self._flat = {k: v.to(device=new.device, dtype=kinds.get(k, v.dtype)) for k, v in self._flat.items()}
        self._p, self.layout, self.device, self._cdt = new, new.form, new.device, cdt
        self._backend = resolve(self._backend_name, self.device)
        self._means, self._extra = {}, None
        self._forget_views()
        if self.buffers == "optimizer":  # the module's buffers are new tensors after model.to()
            self.param_groups[0]["params"] = _torch_params(new, True)
        self._bound = self._binding()

    def _forget_views(self) -> None:
        """Drop cached views of the state buffers (after the buffers were replaced)."""

    def _check_group(self) -> None:
        """The hyperparameters in ``param_groups[0]`` (a scheduler may have changed them), checked as the
        constructor checks them, before a step uses them."""
        group = self.param_groups[0]
        missing = [k for k in self._hyper if k not in group]
        if missing:
            raise KeyError(f"param_groups[0] has no {missing[0]!r}; {type(self).__name__} needs "
                           f"{', '.join(self._hyper)}")
        now = {k: group[k] for k in self._hyper}
        if now == self._checked_hyper:
            return
        try:
            probe = self._probe(now)
        except (TypeError, ValueError) as e:
            raise type(e)(f"param_groups[0] holds an invalid value (set by a scheduler or by hand?): {e}") from e
        for k in self._hyper:
            group[k] = getattr(probe, k)
        self._checked_hyper = {k: group[k] for k in self._hyper}

    def _probe(self, hyper: dict) -> "ServerOptimizer":
        """An optimizer of this class on the same params with ``hyper``: its constructor checks every range and
        changes nothing here."""
        return type(self)(self._p.original, backend=self._backend_name, on_nonfinite=self.on_nonfinite,
                          buffers=self.buffers, aggregate=self.aggregate, **{k: (tuple(v) if k == "betas" else v) for k, v in hyper.items()})

    # -- hyperparameters and state ------------------------------------------------------------------------------
    _hyper: tuple = ()
    needs_client_norms: bool = False  # the rule reads the clients' norms (sum_i p_i ||delta_i||^2 or each one)
    _vector_state: tuple = ()  # names of the d-vector buffers a subclass keeps (beside 'extra')
    _nonnegative_state: tuple = ()  # buffers whose every element is >= 0 (load_state_dict checks it)
    _scalar_state: tuple = ()  # names of its 0-d buffers (beside 'step')

    @property
    def hyperparameters(self) -> dict:
        return {k: getattr(self, k) for k in self._hyper}

    def _buffer(self, name: str) -> torch.Tensor:
        """A flat state buffer (zeros on first use)."""
        if name not in self._flat:
            self._flat[name] = torch.zeros(self._p.segments.numel, dtype=self._cdt, device=self.device)
        return self._flat[name]

    def _extra_out(self) -> ParamRows:
        """The eval/broadcast buffer, a copy of the params until the first step writes it."""
        if "extra" not in self._flat:
            flat = torch.empty(self._p.segments.numel, dtype=self._p.dtype, device=self.device)
            for dst, src in zip(self._p.segments.slice(flat), self._start or self._p.parts):
                dst.copy_(src)
            self._flat["extra"] = flat
        if self._extra is None or self._extra.parts[0].data_ptr() != self._flat["extra"].data_ptr():
            self._extra = like_params(self._p, self._flat["extra"])
        return self._extra

    def _user_form(self, flat: torch.Tensor | None) -> Any:
        """The params' form with the parameter entries taken from ``flat`` (None: the params themselves): a flat
        tensor or array, a list, or -- for a module or a state_dict -- a full state_dict (buffers included, the
        params' own), so ``model.load_state_dict(...)`` takes it. Views, never copies."""
        orig = self._p.original
        if flat is None:
            views = list(self._p.parts)
            views = [v.reshape(s) for v, s in zip(views, self.layout.shapes)]
        else:
            views = [flat[o:o + n].reshape(sh) for o, n, sh in zip(self.layout.offsets, self.layout.numels,
                                                                     self.layout.shapes)]
        if self.layout.numpy:
            views = [v.numpy() for v in views]
        if self.layout.kind == "flat":
            return orig if flat is None else views[0]
        if isinstance(orig, torch.nn.Module):
            by_id = {id(p): v for p, v in zip(self.param_groups[0]["params"], views)}
            return {k: by_id[id(t)] if id(t) in by_id else t.detach()
                    for k, t in orig.state_dict(keep_vars=True).items()}
        if self.layout.kind == "dict":
            mine = dict(zip(self.layout.names, views))
            return {k: mine.get(k, v) for k, v in orig.items()}
        return views

    def _param_state(self, k: int) -> dict:
        """Parameter ``k``'s state: its slice of every vector buffer, shaped like it, and the 0-d buffers."""
        off, n, shape = self.layout.offsets[k], self.layout.numels[k], self.layout.shapes[k]
        return {name: t if t.dim() == 0 else t[off:off + n].view(shape) for name, t in self._flat.items()}

    @property
    def flat_state(self) -> dict:
        """The state as the fused step keeps it: buffer name -> one flat buffer over the whole model (0-d for the
        round counter and FedExP-M's numerator)."""
        return self._flat

    @property
    def round(self) -> int:
        """Rounds applied so far (a host read of the device counter)."""
        return int(self._flat["step"].item())

    def state_dict(self) -> dict:
        """torch's optimizer checkpoint: ``{"state": {i: {buffer: slice shaped like parameter i, "step": ...}},
        "param_groups": [{hyperparameters..., "params": [0, 1, ...]}]}``, plus ``"fastagg"``: the format version,
        the optimizer class and the parameter layout (and, sharded, which slice this is), which
        :meth:`load_state_dict` checks. Tensors are copies. Like torch optimizers, the parameters themselves are
        not included: save the model alongside. Hooks registered with ``register_state_dict_pre_hook`` /
        ``register_state_dict_post_hook`` run as torch.optim.Optimizer.state_dict runs them (a post hook's
        returned dict replaces the checkpoint)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._follow()
        flat = {"optimizer": type(self).__name__, "format": FORMAT_VERSION, "hyperparameters": self.hyperparameters,
                "group": {k: v for k, v in self.param_groups[0].items() if k not in self._hyper and k not in
                          GROUP_KEYS}, "layout": self.layout.signature(), "state": dict(self._flat)}
        if self.sharded:  # which slice this is: distributed.reshard puts the slices back in order by it
            import torch.distributed as dist

            flat["shard"] = {"rank": dist.get_rank(self.group), "world": dist.get_world_size(self.group)}
        out = torch_checkpoint(flat)
        if hasattr(self.aggregate, "state_dict"):  # a DP mechanism: its noise stream must continue, never replay
            out["fastagg"]["aggregate"] = {"class": type(self.aggregate).__name__,
                                           "state": self.aggregate.state_dict()}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a checkpoint of the same optimizer class and parameter layout (hyperparameters included), in
        torch's shape (:meth:`state_dict`) or fastagg's earlier flat one (format 1).

        Everything is checked before anything changes: the optimizer class, format and parameter layout; every
        hyperparameter's range (as the constructor checks it); every buffer by name -- one this optimizer keeps,
        with each parameter's slice shaped like the parameter, one dtype, finite -- and the round counter (a whole
        number >= 0, the same for every parameter). Buffers may come from another device (they are moved to the
        params'). Raises ValueError / TypeError naming the first problem; nothing is changed then.

        As in torch, a checkpoint saved from ``parameters()`` loads into an optimizer built on
        ``named_parameters()`` (or a module, or a state_dict) and the other way round: entries are matched by
        position, shape and dtype, and names are compared only when both sides have them. A plain-number ``step``
        is taken as torch takes it. Hooks registered with ``register_load_state_dict_pre_hook`` (given a shallow
        copy; a returned dict replaces it) and ``register_load_state_dict_post_hook`` run as torch runs them.
        """
        if isinstance(state_dict, Mapping):
            state_dict = dict(state_dict)  # a shallow copy, as torch's: a pre hook may edit it in place
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load(self, state_dict: Any) -> None:
        self._follow()
        ck = flat_checkpoint(state_dict)
        if ck["optimizer"] != type(self).__name__:
            raise ValueError(f"state_dict is from {ck['optimizer']}; this optimizer is {type(self).__name__}")
        self._check_shard(ck.get("shard"))
        check_layout(self.layout.signature(), ck["layout"])
        hyper, extras = ck["hyperparameters"], {}
        if ck["format"] == 1 and isinstance(hyper, dict) and "lr" in self._hyper and "lr" not in hyper:
            hyper = {**hyper, "lr": 1.0}  # format 1 of FedExP, FedExP-M, SCAFFOLD-ExP, FedACG: no lr (it was 1)
        if ck["format"] != 1 and isinstance(hyper, dict):  # a torch group: the settings and what schedulers keep
            extras = {**ck["group"], **{k: v for k, v in hyper.items() if k not in self._hyper}}
            hyper = {k: v for k, v in hyper.items() if k in self._hyper}
        if not isinstance(hyper, dict) or set(hyper) != set(self._hyper):
            raise ValueError(f"state_dict's hyperparameters {sorted(hyper) if isinstance(hyper, dict) else hyper!r} "
                             f"do not match {sorted(self._hyper)}")
        try:  # the constructor checks every range; a probe on the same params changes nothing here
            probe = self._probe(hyper)
        except (TypeError, ValueError) as e:
            raise type(e)(f"state_dict's hyperparameters are invalid: {e}") from e
        state = self._checked_state(ck["state"])
        agg = self._checked_aggregate_state(state_dict)
        for k in self._hyper:
            setattr(self, k, getattr(probe, k))
        if agg is not None:
            self.aggregate.load_state_dict(agg)
        self.param_groups[0].update(extras)  # what schedulers keep in the group (initial_lr, ...)
        self._flat = state
        self._extra = None
        self._forget_views()

    def _checked_aggregate_state(self, state_dict: Mapping):
        """The aggregate's (DP mechanism's) state in a checkpoint, checked on a copy of the mechanism; None when the
        checkpoint has none or this optimizer's aggregate keeps none."""
        meta = state_dict.get("fastagg") if isinstance(state_dict, Mapping) else None
        saved = meta.get("aggregate") if isinstance(meta, Mapping) else None
        if saved is None or not hasattr(self.aggregate, "load_state_dict"):
            return None
        if not isinstance(saved, Mapping) or saved.get("class") != type(self.aggregate).__name__:
            got = saved.get("class") if isinstance(saved, Mapping) else type(saved).__name__
            raise ValueError(f"state_dict's aggregate state is of {got!r}; this optimizer aggregates with "
                             f"{type(self.aggregate).__name__}")
        try:
            copy.copy(self.aggregate).load_state_dict(saved["state"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"state_dict's aggregate state is invalid: {e!r}") from None
        return saved["state"]

    def _check_shard(self, tag) -> None:
        """A sharded checkpoint is one rank's slice: only that rank of a group of that size may load it."""
        if tag is None:
            return
        if not self.sharded:
            raise ValueError(f"state_dict is one slice of a sharded optimizer ({tag!r}); this one is not sharded "
                             "(fastagg.distributed.reshard(..., 1) joins the slices)")
        import torch.distributed as dist

        mine = {"rank": dist.get_rank(self.group), "world": dist.get_world_size(self.group)}
        if not isinstance(tag, dict) or {k: tag.get(k) for k in mine} != mine:
            raise ValueError(f"state_dict is the slice of {tag!r}; this optimizer is rank {mine['rank']} of "
                             f"{mine['world']} (fastagg.distributed.reshard re-cuts the slices)")

    def _state_kinds(self) -> dict:
        """Name -> (shape, dtype) of every buffer this optimizer may keep."""
        d = self._p.segments.numel
        kinds = {"step": ((), torch.float64), "extra": ((d,), self._p.dtype)}
        for name in self._vector_state:
            kinds[name] = ((d,), self._cdt)
        for name in self._scalar_state:
            kinds[name] = ((), torch.float64)
        return kinds

    def _checked_state(self, given: Any) -> dict:
        if not isinstance(given, dict) or "step" not in given:
            raise ValueError("state_dict['state'] must be a dict with at least the round counter 'step'")
        kinds = self._state_kinds()
        out = {}
        for name, t in given.items():
            if name not in kinds:
                raise ValueError(f"state_dict buffer {name!r} is not one {type(self).__name__} keeps "
                                 f"({', '.join(sorted(kinds))})")
            if kinds[name][0] == ():
                t = scalar_tensor(t)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state_dict buffer {name!r} is a {type(t).__name__}; expected a tensor")
            shape, dtype = kinds[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"state_dict buffer {name!r} has shape {tuple(t.shape)}; expected {shape}")
            if t.dtype != dtype:
                raise TypeError(f"state_dict buffer {name!r} has dtype {t.dtype}; expected {dtype}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"state_dict buffer {name!r} holds NaN or Inf")
            if name in self._nonnegative_state and bool((t < 0).any()):
                raise ValueError(f"state_dict buffer {name!r} holds negative values; {type(self).__name__}'s "
                                 f"{name} is a sum of squares (a step would divide by the square root of it)")
            out[name] = t.detach().to(device=self.device, copy=True)
        step = float(out["step"])
        if step < 0 or step != int(step) or step > 2.0**53:  # beyond 2^53 the float64 counter stops counting
            raise ValueError(f"state_dict's round counter 'step' is {step!r}; expected a whole number in [0, 2^53]")
        return out

    # -- the step -----------------------------------------------------------------------------------------------
    def broadcast(self) -> Any:
        """What clients start the round from (the params; FedACG: its look-ahead point), in the params' form: the
        flat tensor or array, the list, or for a module or state_dict a full state_dict (buffers included) that
        ``model.load_state_dict`` takes. Views of the params, never copies."""
        self._follow()
        return self._user_form(None)

    def eval_params(self) -> Any:
        """The model to evaluate (the params; the FedExP family: the average of the last two iterates), in the same
        form as :meth:`broadcast`, every time."""
        self._follow()
        return self._user_form(None)

    def _aux(self):
        """(vector, coefficient) whose combination with the mean the stats pass should measure, or (None, 0)."""
        return None, 0.0

    def _mean_buffer(self, name: str, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        """The reused mean buffer of the stats pass over ``name`` (deltas, control_deltas, ...)."""
        if numel != self._p.segments.numel:
            return None  # a size error follows
        if (name, dtype) not in self._means:
            self._means[name, dtype] = torch.empty(numel, dtype=dtype, device=self.device)
        return self._means[name, dtype]

    def _written(self) -> list:
        """(name, tensor) of everything a step writes: the params, every state buffer, the eval/broadcast output."""
        out = [(f"params entry {k}", t) for k, t in enumerate(self._p.parts)]
        out += [(f"the optimizer's {k!r} buffer", v) for k, v in self._flat.items() if v.dim() > 0]
        return out

    def _rows(self, deltas: Any, weights: Any, name: str, base: Any):
        """This rank's input, validated: the clients' rows (None for an Accumulator, checked instead)."""
        if isinstance(deltas, Accumulator):
            if self.sharded:
                raise TypeError("a sharded optimizer takes each client's slice, not an Accumulator")
            if weights is not None:
                raise TypeError("weights= does not apply to an Accumulator: pass weights to its add()")
            if deltas.device != self.device:
                raise ValueError(f"the accumulator is on {deltas.device}; the params are on {self.device}")
            if deltas.numel != self._p.segments.numel:
                raise ValueError(f"the accumulator holds {deltas.numel} elements per client; the optimizer's params "
                                 f"have {self._p.segments.numel}")
            check_writes(self._written(), deltas._state_reads())
            return None
        if self.group is not None and not self.sharded and _no_clients_given(deltas):
            if weights is not None and len(weights) != 0:
                raise ValueError(f"no {name} on this rank but {len(weights)} weights")
            from .distributed import no_clients  # this rank sits the round out: a zero contribution

            return no_clients(self._p.segments, self._p.form, self._p.dtype, self.device)
        if base is not None:
            name = "models"
        rows = client_rows(deltas, name=name, params=self._p)
        if base is not None:
            rows, _ = attach_base(rows, base)
        if rows.device != self.device:
            raise ValueError(f"{name} are on {rows.device}; the params are on {self.device}")
        if rows.numel != self._p.segments.numel:
            raise ValueError(f"{name} have {rows.numel} elements per client; the optimizer's params have "
                             f"{self._p.segments.numel}")
        check_writes(self._written(), round_reads(rows))
        return rows

    def _gradients(self) -> Any:
        """The pseudo-gradients torch's outer optimizers take (``p.grad = global - local``), as one client in the
        params' form; the step negates them into fastagg's ``delta = local - global``. A frozen parameter
        (``requires_grad=False``) without ``.grad`` -- a fine-tuned model's fixed layers, which torch's optimizers skip
        -- takes a zero pseudo-gradient: with no state of its own yet it does not move, as under torch. A trainable
        one without ``.grad`` is refused, naming it (a missing pseudo-gradient is a bug of the caller's loop)."""
        grads = []
        for k, p in enumerate(self.param_groups[0]["params"]):
            if p.grad is None and not p.requires_grad:
                grads.append(torch.zeros_like(p))
                continue
            if p.grad is None:
                name = self.layout.names[k] if self.layout.names[k] is not None else k
                raise ValueError(f"step() without deltas reads each parameter's .grad (the pseudo-gradient global - "
                                 f"local, as torch's outer optimizers take it); parameter {name!r} has none")
            grads.append(p.grad)
        if self.layout.kind == "flat":
            return grads[0]
        return dict(zip(self.layout.names, grads)) if self.layout.kind == "dict" else grads

    def _stats(self, deltas: Any, weights: Any, name: str = "deltas", base: Any = None,
               negate: bool = False) -> RoundStats:
        stats = self._signed_stats(deltas, weights, name, base, -1.0 if negate else 1.0)
        if negate:  # the mean of -delta, measured with the aux term's sign flipped (norms do not see the sign)
            stats.mean.neg_()
        return stats

    def _signed_stats(self, deltas: Any, weights: Any, name: str, base: Any, sign: float) -> RoundStats:
        updates = compressed_list(deltas, name)
        if updates is not None:
            deltas = updates
            if base is not None:
                raise TypeError("base= does not apply to compressed updates: they are the updates themselves")
            if self.aggregate is not None:  # robust rules and DP read every client: dequantized rows, one each
                deltas = dense_rows(deltas, [f"{name}[{i}]" for i in range(len(deltas))],
                                    numel=self._p.segments.numel, device=self.device, dtype=self._p.dtype)
            elif self.group is not None:  # every rank folds its own clients where they lie, then one all_reduce
                return self._group_compressed_stats(deltas, weights, name, sign)
            else:
                deltas, weights = self._accumulate_compressed(deltas, weights, name), None
        if self.aggregate is not None and name != "control_deltas":
            return self._robust_stats(deltas, weights, name, base, sign)
        try:
            if isinstance(deltas, Accumulator) and self.needs_client_norms:
                deltas._need_norms(f"{type(self).__name__}'s step")
            rows = self._rows(deltas, weights, name, base)
        except Exception as e:  # noqa: BLE001 (with a group: every other rank learns at once, then this one raises)
            if self.group is not None:
                from .distributed import fail_step

                kind = "sharded" if self.sharded else "accumulator" if isinstance(deltas, Accumulator) else "clients"
                fail_step(self.group, kind, e, self.device)
            raise
        aux, aux_coef = self._aux()
        aux_coef = sign * aux_coef
        if base is not None:
            name = "models"
        if isinstance(deltas, Accumulator):
            if self.group is not None:  # every rank folded its own clients
                from .distributed import accumulator_stats

                return accumulator_stats(deltas, lambda device: self._backend, group=self.group, aux=aux,
                                         aux_coef=aux_coef, mean_out=self._mean_buffer(name, self._cdt, deltas.numel))
            if self._apply_reads_sum and aux is None and deltas.compute_dtype == self._cdt:
                return deltas.round_stats(lambda device: self._backend, keep_mean=False)
            with deltas._lock:  # the accumulator's spare sum becomes the mean, lent for the step (no model-sized
                spare = deltas._take_spare(self._cdt) if not self._means else None  # buffer kept here)
                if spare is not None:
                    self._borrowed.append((deltas, spare))
                return deltas.round_stats(lambda device: self._backend, aux=aux, aux_coef=aux_coef,
                                          mean_out=spare if spare is not None else
                                          self._mean_buffer(name, self._cdt, deltas.numel))
        if self.group is not None and self.sharded:  # fastagg.distributed: this rank's slice of every client
            from .distributed import sharded_stats

            return sharded_stats(rows, weights, self._backend, group=self.group, name=name, aux=aux,
                                 aux_coef=aux_coef, sync=self.on_nonfinite == "raise", mean_dtype=self._cdt,
                                 mean_out=self._mean_buffer(name, self._cdt, rows.numel))
        if self.group is not None:  # fastagg.distributed: the clients of every rank
            from .distributed import all_stats

            return all_stats(rows, weights, self._backend, group=self.group, name=name, aux=aux, aux_coef=aux_coef,
                             sync=self.on_nonfinite == "raise", mean_dtype=self._cdt,
                             mean_out=self._mean_buffer(name, self._cdt, rows.numel),
                             scratch=self._mean_buffer("norm scratch", self._cdt, rows.numel),
                             model_buffers=self._p.buffers)
        return client_stats(rows, weights, self._backend, name=name, aux=aux, aux_coef=aux_coef,
                            sync=self.on_nonfinite == "raise", mean_dtype=self._cdt,
                            mean_out=self._mean_buffer(name, self._cdt, rows.numel))

    def _group_compressed_stats(self, deltas: list, weights: Any, name: str, sign: float) -> RoundStats:
        """This rank's compressed clients in a step over the ranks of ``group=``: checked, those with a NaN/Inf scale
        or value left out (``on_nonfinite="skip"``, as the local path's Accumulator leaves them out) or raised on,
        then folded where they lie in the group's one stats exchange (fastagg.distributed.all_stats). Any failure is
        told to every rank first."""
        from .distributed import all_stats, fail_step

        names = [f"{name}[{i}]" for i in range(len(deltas))]
        try:
            if self.sharded:
                raise TypeError("sharded=True takes a slice of every client's float update; compressed updates are "
                                "whole vectors: use the default (each rank holds whole clients)")
            scans: dict = {}
            check_batch(deltas, names, numel=self._p.segments.numel, device=self.device, where="the params",
                        scans=scans)
            bad = nonfinite_scales(deltas, names, scans)
            if bad and self.on_nonfinite == "raise":
                raise ValueError(f"{', '.join(names[j] for j in bad)} {'has' if len(bad) == 1 else 'have'} a NaN or "
                                 "Inf scale or value; nothing was updated")
            left_out = set(bad)
            keep = [j for j in range(len(deltas)) if j not in left_out]
            if weights is not None:
                w = weights.detach().cpu().tolist() if isinstance(weights, torch.Tensor) else list(weights)
                if len(w) != len(deltas):
                    raise ValueError(f"{len(w)} weights for {len(deltas)} {name}")
                weights = [w[j] for j in keep]
            rows = CompressedRows([deltas[j] for j in keep], [names[j] for j in keep],
                                  numel=self._p.segments.numel, device=self.device, form=self._p.form)
        except Exception as e:  # noqa: BLE001 (every other rank learns at once, then this one raises)
            fail_step(self.group, "clients", e, self.device)
            raise
        aux, aux_coef = self._aux()
        return all_stats(rows, weights, self._backend, group=self.group, name=name, aux=aux,
                         aux_coef=sign * aux_coef, sync=self.on_nonfinite == "raise", mean_dtype=self._cdt,
                         mean_out=self._mean_buffer(name, self._cdt, rows.numel),
                         scratch=self._mean_buffer("norm scratch", self._cdt, rows.numel),
                         model_buffers=self._p.buffers)

    def _accumulate_compressed(self, deltas: list, weights: Any, name: str) -> Accumulator:
        """Compressed clients (fastagg.compress) folded where they lie into an Accumulator of the params' size,
        which the step then reads like any other (every rule, aux terms included). A client with a NaN/Inf scale
        raises, or with ``on_nonfinite="skip"`` is left out of the round."""
        acc = Accumulator(like=torch.empty(self._p.segments.numel, dtype=self._p.dtype, device=self.device),
                          backend=self._backend_name)
        ws = [1.0] * len(deltas) if weights is None else weights
        folded = acc.add_many(deltas, ws, on_nonfinite=self.on_nonfinite)
        if not any(folded):
            raise ValueError(f"every one of the {len(deltas)} {name} has a NaN or Inf scale or value, or codes "
                             "standing for values beyond float32; nothing was updated")
        return acc

    def _robust_stats(self, deltas: Any, weights: Any, name: str, base: Any, sign: float) -> RoundStats:
        """The round's statistics with the robust rule's estimate as the mean (fastagg.robust.robust_stats); the
        non-finite clients it left out are reported in ``last_stats.robust``, not raised on."""
        from .privacy.mechanisms import MECHANISMS, dp_stats
        from .robust import robust_stats

        if isinstance(deltas, Accumulator):
            raise TypeError(f"aggregate={self.aggregate!r} needs every client's update; an Accumulator keeps only "
                            "their sum")
        rows = self._rows(deltas, weights, name, base)
        if isinstance(self.aggregate, MECHANISMS):
            stats, self._robust = dp_stats(rows, weights, self.aggregate, self._backend,
                                           name="models" if base is not None else name,
                                           mean_out=self._mean_buffer(name, self._cdt, rows.numel),
                                           mean_dtype=self._cdt)
        else:
            stats, self._robust = robust_stats(rows, weights, self.aggregate, self._backend,
                                               name="models" if base is not None else name,
                                               mean_out=self._mean_buffer(name, self._cdt, rows.numel),
                                               mean_dtype=self._cdt, model_buffers=self._p.buffers)
        aux, aux_coef = self._aux()
        if aux is not None:  # FedExP-M measures ||mean + beta v||^2
            v = stats.mean.to(torch.float64) + sign * aux_coef * aux.to(torch.float64)
            stats.mean_sq = v @ v
        return stats

    def step(self, deltas: Any = None, weights: Any = None, *, base: Any = None,
             closure: Callable[[], Any] | None = None) -> Any:
        """Apply one server round.

        Args:
            deltas: the participating clients' updates measured from :meth:`broadcast` (any form
                :func:`fastagg.fedexp_step` accepts), or an :class:`~fastagg.Accumulator` they were folded into.
                None (``opt.step()``, as torch's outer optimizers are called, e.g. in DiLoCo): one update read from
                the parameters' ``.grad``, taken as a pseudo-gradient ``global - local`` (``delta = -grad``).
            weights: per-client weights (example counts), normalized over the participants; default uniform.
            base: the model the clients started from (what :meth:`broadcast` gave them, in the clients' form). With
                it, ``deltas`` are the clients' full models: each update ``model_i - base`` is formed inside the
                stats pass, never stored, and buffers become the clients' weighted average.
            closure: torch's ``step(closure)`` (PyTorch Lightning's call, ``opt.step(closure=...)``, or positional
                ``opt.step(closure)``): called once under ``torch.enable_grad()`` before the round, it usually runs
                the backward that fills ``.grad``; the round then reads ``deltas`` as without a closure (None: the
                pseudo-gradients in ``.grad``), and ``step`` returns the closure's value, as torch's optimizers do.

        Returns the round's :class:`StepStats` (also kept as ``last_stats``); with a closure, the closure's value.
        With ``on_nonfinite="raise"`` a non-finite client raises ``ValueError`` and params and state stay exactly as
        they were.
        """
        if callable(deltas) and not isinstance(deltas, (torch.Tensor, np.ndarray, Accumulator, list, tuple, Mapping,
                                                        torch.nn.Module)):
            if closure is not None:
                raise TypeError("step() got two closures (positional and closure=)")
            deltas, closure = None, deltas  # opt.step(closure), torch's positional form
        if closure is None:
            return self._step(deltas, weights, base=base)
        if not callable(closure):
            raise TypeError(f"closure must be callable, got {type(closure).__name__}")
        with torch.enable_grad():
            loss = closure()
        self._step(deltas, weights, base=base)
        return loss

    def _step(self, deltas: Any, weights: Any, *, base: Any) -> StepStats:
        with torch.no_grad():
            self._follow()
            self._check_group()
            negate = deltas is None
            if negate:
                if weights is not None or base is not None:
                    raise TypeError("step() without deltas reads the pseudo-gradients from .grad; weights= and base= "
                                    "go with deltas")
                deltas = [self._gradients()]
            if base is not None and isinstance(deltas, Accumulator):
                raise TypeError("base= does not apply to an Accumulator: pass base to its add()")
            # an Accumulator's lock is held for the whole step: the apply may read its sum (_apply_reads_sum)
            held = deltas._lock if isinstance(deltas, Accumulator) else contextlib.nullcontext()
            try:
                with held:
                    stats = self._stats(deltas, weights, base=base, negate=negate)
                    updates = buffer_updates(self._p, stats, models=base is not None)  # checked before any write
                    self._overflow = overflow_counter(stats.mean_sq)
                    eta, finite = self._round(stats)
                    self._finish(stats, finite, updates)
            finally:
                self._return_borrowed()
        self.last_stats = StepStats(eta, stats.mean_sq, stats.avg_sq, stats.sq_norms, finite, _per_client(stats),
                                    stats.num_clients, self._overflow,
                                    self._robust if self.aggregate is not None else None)
        check_overflow(self._overflow, self.on_nonfinite, "params or the optimizer's state")
        return self.last_stats

    def _step_from(self, start: Any, *args, **kw) -> StepStats:
        """``step(*args, **kw)`` as if the params had first been set to ``start`` (:meth:`_assign`), without that
        copy where the rule allows it: the momentum family's apply pass reads ``start`` where it writes the params
        (one pass; their old values are never read), so an aggregator whose params take fresh storage every round
        sets them by the step itself (fastagg.nvflare). Other rules, and a step that ends before its apply (a
        raise), copy ``start`` in."""
        with torch.no_grad():
            self._follow()
            parts = self._start_parts(start)
            if not self._apply_reads_start:
                self._copy_in(parts)
                return self.step(*args, **kw)
            self._start = parts
        try:
            return self.step(*args, **kw)
        finally:
            left, self._start = self._start, None
            if left is not None:  # no apply pass ran: the params are start's
                self._copy_in(left)

    def _assign(self, start: Any) -> None:
        """Set the params (and the model's buffers) to ``start``, a model of their form, layout, dtype and device."""
        with torch.no_grad():
            self._follow()
            self._copy_in(self._start_parts(start))

    def _start_parts(self, start: Any) -> list:
        """``start``'s flat parameter parts, checked against the params (entries by name, sizes, dtype, device; no
        overlap with anything a step writes); its buffers are copied into the model's now."""
        s = param_rows(start, buffers_count=self.buffers == "optimizer")
        if (s.segments.lens != self._p.segments.lens or s.dtype != self._p.dtype or s.device != self.device
                or [n for n, _ in s.buffers] != [n for n, _ in self._p.buffers]
                or (s.form.kind == self.layout.kind == "dict" and s.form.names != self.layout.names)):
            raise ValueError(f"start must be a model like the params (entries {list(self.layout.names)[:4]}... "
                             f"of {list(self._p.segments.lens)[:4]}... elements of {self._p.dtype} on "
                             f"{self.device}); got {list(s.form.names)[:4]}... of {list(s.segments.lens)[:4]}... "
                             f"of {s.dtype} on {s.device}")
        check_writes(self._written(), [(f"start entry {k}", t) for k, t in enumerate(s.parts)])
        for (_, dst), (_, src) in zip(self._p.buffers, s.buffers):
            dst.copy_(src)
        return s.parts

    def _copy_in(self, parts: list) -> None:
        with torch.no_grad():
            for dst, src in zip(self._p.parts, parts):
                dst.copy_(src)

    def _return_borrowed(self) -> None:
        """Give the accumulators back the spare buffers the step used as its mean (the step is over): a server
        that steps on the same accumulator round after round then allocates no model-sized buffer again."""
        while self._borrowed:
            acc, spare = self._borrowed.pop()
            acc._return_spare(spare)

    def _finish(self, stats: RoundStats, finite: torch.Tensor, updates: list) -> None:
        """After the apply pass: the model's buffers (averaged, never stepped; ``updates`` from
        :func:`~fastagg.passes.buffer_updates`) and the round counter."""
        write_buffers(updates, finite)
        warn_unmatched_buffers(self._p, stats)
        self._advance(finite)

    def _advance(self, finite: torch.Tensor) -> None:
        step = self._flat["step"]
        step.copy_(torch.where(finite, step + 1, step))  # in place: a captured CUDA graph replays into it

    def _round(self, stats: RoundStats):
        raise NotImplementedError

    def _momentum(self, stats: RoundStats, lr: torch.Tensor, *, finite: torch.Tensor, buf: str | None = None,
                  momentum: float = 0.0, nesterov: bool = False, extra_coef=None, extra_coef_skip=None) -> None:
        extra = None if extra_coef is None else self._extra_out()
        start, self._start = self._start, None
        kw = {} if start is None else {"start": start}
        if stats.mean is None:  # (_apply_reads_sum) the sum, scaled as the stats pass would have written the mean
            kw["mean_scale"] = stats.mean_scale
        self._backend.momentum_apply(
            params=self._p, mean=stats.mean if stats.mean is not None else stats.mean_sum, lr=lr, finite=finite,
            buf=None if buf is None else self._buffer(buf), momentum=momentum, nesterov=nesterov, extra_out=extra,
            extra_coef=extra_coef, extra_coef_skip=extra_coef_skip, overflow_out=self._overflow, **kw)

    def _check_finite(self, stats: RoundStats, step_size: torch.Tensor) -> torch.Tensor:
        """The round's finite flag (raises in "raise" mode), the step size checked against the params' dtype."""
        return check_finite(stats, step_size, self.on_nonfinite, dtype=self._cdt)

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters.items())
        return f"{type(self).__name__}({hp}, d={self._p.segments.numel}, backend={self._backend.name!r})"


class FedAvg(ServerOptimizer):
    """FedAvg's server step ``w <- w + lr * mean`` (lr = 1: plain model averaging; Flower's FedAvg)."""

    _hyper = ("lr",)
    _apply_reads_start = _apply_reads_sum = True

    def __init__(self, params, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self.lr = check_number(lr, "lr")

    def _round(self, stats):
        eta = device_scalar(self.lr, stats.mean_sq)
        finite = self._check_finite(stats, eta)
        self._momentum(stats, eta, finite=finite)
        return eta, finite


class FedAvgM(ServerOptimizer):
    """Server momentum (Flower's FedAvgM; Nesterov as torch SGD), with ``pg = -mean``::

        v <- momentum * v + pg          (v starts at 0, so the first round has v = pg, as in Flower)
        w <- w - lr * v                 (nesterov: w <- w - lr * (pg + momentum * v))

    Defaults follow Flower: ``lr=1.0, momentum=0.0``. The buffer is stored as ``-v`` (local-minus-global sign).
    """

    _hyper = ("lr", "momentum", "nesterov")
    _vector_state = ("momentum_buffer",)
    _apply_reads_start = _apply_reads_sum = True

    def __init__(self, params, lr: float = 1.0, momentum: float = 0.0, nesterov: bool = False, **kw):
        super().__init__(params, **kw)
        self.lr = check_number(lr, "lr")
        self.momentum = check_prob(momentum, "momentum")
        self.nesterov = bool(nesterov)
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0")

    def _round(self, stats):
        eta = device_scalar(self.lr, stats.mean_sq)
        finite = self._check_finite(stats, eta)
        buf = "momentum_buffer" if self.momentum > 0 else None
        self._momentum(stats, eta, finite=finite, buf=buf, momentum=self.momentum, nesterov=self.nesterov)
        return eta, finite


class _FedExPFamily(ServerOptimizer):
    """eps schedule and the evaluation model shared by FedExP, FedExP-M and SCAFFOLD-ExP."""

    needs_client_norms = True  # eta reads sum_i p_i ||delta_i||^2
    _apply_reads_start = True

    def _init_eps(self, eps, eps_mode, eps_decay, lr):
        self.lr = check_number(lr, "lr")
        if eps is None:
            raise TypeError(f"{type(self).__name__} needs eps (FedExP's denominator term, e.g. eps=1e-3)")
        self.eps = check_number(eps, "eps")
        if eps_mode not in rules.EPS_MODES:
            raise ValueError(f"eps_mode must be one of {rules.EPS_MODES}, got {eps_mode!r}")
        self.eps_mode = eps_mode
        self.eps_decay = check_number(eps_decay, "eps_decay", minimum=0.0, allow_equal=False)

    def _scaled(self, eta: torch.Tensor) -> torch.Tensor:
        """The rule's step size times ``lr`` (1 unless a user or a scheduler set it: the rule as published)."""
        return eta if self.lr == 1.0 else eta * self.lr

    def _eps_eff(self, num_clients: int) -> torch.Tensor:
        """``eps * eps_decay^(t+1)`` in round t (0-based; the official schedule decays before round 0), times M in
        the official convention."""
        eps = rules.effective_eps(self.eps, num_clients, self.eps_mode)
        if self.eps_decay == 1.0:
            return device_scalar(eps, self._flat["step"])
        return eps * torch.pow(self.eps_decay, self._flat["step"] + 1)

    def eval_params(self):
        """``(w_prev + w) / 2``, the FedExP evaluation model (paper 000, Sec. 5). fastagg's convention for round 0,
        before any step: the initial model (the average of two equal iterates), which the simulator's round-0
        metrics row reports; code that starts averaging only after the second iterate evaluates the first
        iterate at round 1 instead of (w0 + w1) / 2."""
        self._follow()
        return self._user_form(self._flat.get("extra"))

    def _fedexp_apply(self, stats, eta, finite, *, buf=None, momentum=0.0):
        self._momentum(stats, eta, finite=finite, buf=buf, momentum=momentum, extra_coef=-0.5 * eta)


_EPS_DOC = """eps: FedExP's denominator term (squared-update-norm units, >= 0).
        eps_mode: ``"paper"`` (``||mean||^2 + eps``) or ``"official"`` (``||mean||^2 + M * eps``).
        eps_decay: per-round factor; round t (0-based) uses ``eps * eps_decay^(t+1)`` (the official code's
            ``0.998**2``: pass ``eps_decay=0.998**2``). Default 1: constant.
        lr: a factor on the step, as torch's learning rate (``w <- w + lr * eta * ...``; the evaluation model
            follows); default 1, the rule as published. ``torch.optim.lr_scheduler`` schedulers set it;
            ``last_stats.eta`` is the step applied, ``lr * eta``."""


class FedExP(_FedExPFamily):
    """FedExP (Jhunjhunwala et al., ICLR 2023, Algorithm 1)::

        eta = max(1, sum_i p_i ||delta_i||^2 / (2 (||mean||^2 + eps_t)))    (exact_projection: no factor 1/2)
        w <- w + eta * mean;   eval_params() = w_new - (eta/2) mean

    Args:
        params: the global model (flat tensor, list of tensors, or ``model.parameters()``); updated in place.
        {eps_doc}
        exact_projection: the variant for exact local projections (paper Sec. 5, App. C.4.1): no factor 1/2.
    """

    _hyper = ("eps", "eps_mode", "eps_decay", "exact_projection", "lr")

    def __init__(self, params, eps: float | None = None, eps_mode: str = "paper", eps_decay: float = 1.0,
                 exact_projection: bool = False, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self._init_eps(eps, eps_mode, eps_decay, lr)
        self.exact_projection = bool(exact_projection)

    def _eta(self, stats):
        scale = 1.0 if self.exact_projection else 0.5
        return rules.fedexp_eta(stats.avg_sq, stats.mean_sq, self._eps_eff(stats.num_clients), scale=scale)

    def _round(self, stats):
        eta = self._scaled(self._eta(stats))
        finite = self._check_finite(stats, eta)
        self._fedexp_apply(stats, eta, finite)
        return eta, finite


class FedExPM(_FedExPFamily):
    """FedExP with server momentum (paper 000, App. F, eq. 115)::

        v <- mean + beta v;   A <- sum_i p_i ||delta_i||^2 + (beta/2) A      (v, A start at 0)
        eta = A / (2 (||v||^2 + eps_t))     (no max(1, .); 0/0 -> 1)
        w <- w + eta v;       eval_params() = w_new - (eta/2) v

    ``||v||^2`` is measured in the stats pass (``||mean + beta v_old||^2``), so v is written once, in the apply
    pass. The paper gives no beta; the official code uses 0.9.

    Args:
        params: the global model; updated in place.
        {eps_doc}
        beta: momentum coefficient in [0, 1).
    """

    _hyper = ("eps", "eps_mode", "eps_decay", "beta", "lr")
    _vector_state = ("v",)
    _scalar_state = ("numerator",)

    def __init__(self, params, eps: float | None = None, beta: float = 0.9, eps_mode: str = "paper",
                 eps_decay: float = 1.0, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self._init_eps(eps, eps_mode, eps_decay, lr)
        self.beta = check_prob(beta, "beta")
        self._flat["numerator"] = torch.zeros((), dtype=torch.float64, device=self.device)

    def _aux(self):
        return self._buffer("v"), self.beta

    def _round(self, stats):
        a_new = stats.avg_sq + (self.beta / 2) * self._flat["numerator"]
        eta = self._scaled(rules.fedexp_eta(a_new, stats.mean_sq, self._eps_eff(stats.num_clients), scale=0.5,
                                            floor=0.0))
        finite = self._check_finite(stats, eta)
        self._fedexp_apply(stats, eta, finite, buf="v", momentum=self.beta)
        self._flat["numerator"].copy_(torch.where(finite, a_new, self._flat["numerator"]))
        return eta, finite


class _ControlVariate:
    """SCAFFOLD's server side, shared by Scaffold and ScaffoldExP::

        w <- w + eta * mean_i (y_i - w)                  (eta: the subclass's rule, _server_eta)
        c <- c + (|S| / N) * mean_i (c_i_new - c_i)      (uniform mean over the participants)

    The control variate ``c`` (:attr:`control`) is kept incrementally; the server never holds an N x d matrix.
    """

    def _init_control(self, num_clients):
        if not isinstance(num_clients, int) or isinstance(num_clients, bool) or num_clients < 1:
            raise ValueError(f"num_clients must be an integer >= 1 (N, all clients), got {num_clients!r}")
        self.num_clients = num_clients
        self._control: ParamRows | None = None

    @property
    def control(self) -> torch.Tensor:
        """The server control variate c (flat, float32; float64 for float64 params)."""
        return self._buffer("control")

    def step(self, deltas: Any = None, control_deltas: Any = None, weights: Any = None) -> StepStats:  # type: ignore[override]
        """One round: ``deltas`` (y_i - w) with optional ``weights``, ``control_deltas`` (c_i_new - c_i, averaged
        uniformly over the participants, as SCAFFOLD does). Either may be an Accumulator."""
        if deltas is None or control_deltas is None:
            raise TypeError(f"{type(self).__name__}.step needs deltas and control_deltas (each participant's "
                            "c_i_new - c_i); it has no pseudo-gradient form")
        with torch.no_grad():
            self._follow()
            self._check_group()
            try:
                return self._scaffold_step(deltas, control_deltas, weights)
            finally:
                self._return_borrowed()

    def _scaffold_step(self, deltas, control_deltas, weights) -> StepStats:
        stats = self._stats(deltas, weights)
        cstats = self._stats(control_deltas, None, name="control_deltas")
        updates = buffer_updates(self._p, stats, models=False)  # checked before any write
        self._overflow = overflow_counter(stats.mean)
        if cstats.num_clients != stats.num_clients:
            raise ValueError(f"control_deltas has {cstats.num_clients} clients; deltas has {stats.num_clients}")
        if stats.num_clients > self.num_clients:
            raise ValueError(f"{stats.num_clients} participants; more than num_clients={self.num_clients}")
        eta = self._server_eta(stats)
        ratio = device_scalar(stats.num_clients / self.num_clients, eta)
        both = self._check_finite(stats, eta) & self._check_finite(cstats, ratio)
        self._server_apply(stats, eta, both)
        if self._control is None:
            self._control = like_params(self._p, self.control)
        self._backend.momentum_apply(params=self._control, mean=cstats.mean, lr=ratio, finite=both, buf=None,
                                     momentum=0.0, nesterov=False, extra_out=None, extra_coef=None,
                                     extra_coef_skip=None, overflow_out=self._overflow)
        self._finish(stats, both, updates)
        self.last_stats = StepStats(eta, stats.mean_sq, stats.avg_sq, stats.sq_norms, both, _per_client(stats),
                                    stats.num_clients, self._overflow,
                                    self._robust if self.aggregate is not None else None)
        check_overflow(self._overflow, self.on_nonfinite, "params or the control variate")
        return self.last_stats

    def _forget_views(self) -> None:
        self._control = None


class Scaffold(_ControlVariate, ServerOptimizer):
    """SCAFFOLD's server (Karimireddy et al.): ``w <- w + lr * mean_i (y_i - w)``, ``c`` as in ScaffoldExP.

    Args:
        params: the global model; updated in place.
        num_clients: N, the total number of clients.
        lr: the global step size eta_g (default 1).
    """

    _hyper = ("num_clients", "lr")
    _vector_state = ("control",)
    _apply_reads_start = True

    def __init__(self, params, num_clients: int, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self._init_control(num_clients)
        self.lr = check_number(lr, "lr")

    def _server_eta(self, stats):
        return device_scalar(self.lr, stats.mean)

    def _server_apply(self, stats, eta, finite):
        self._momentum(stats, eta, finite=finite)


class ScaffoldExP(_ControlVariate, _FedExPFamily):
    """SCAFFOLD with the FedExP server step size (paper 000, Algorithm 2)::

        w <- w + eta * mean_i (y_i - w)           eta: FedExP's rule on the model updates
        c <- c + (|S| / N) * mean_i (c_i_new - c_i)

    The server control variate ``c`` (:attr:`control`) is kept incrementally from the participants' control
    deltas; the server never holds an N x d matrix.

    Args:
        params: the global model; updated in place.
        num_clients: N, the total number of clients.
        {eps_doc}
    """

    _hyper = ("num_clients", "eps", "eps_mode", "eps_decay", "lr")
    _vector_state = ("control",)

    def __init__(self, params, num_clients: int, eps: float | None = None, eps_mode: str = "paper",
                 eps_decay: float = 1.0, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self._init_control(num_clients)
        self._init_eps(eps, eps_mode, eps_decay, lr)

    def _server_eta(self, stats):
        return self._scaled(rules.fedexp_eta(stats.avg_sq, stats.mean_sq, self._eps_eff(stats.num_clients)))

    def _server_apply(self, stats, eta, finite):
        self._fedexp_apply(stats, eta, finite)


class FedACG(ServerOptimizer):
    """FedACG (Kim et al., Algorithm 2): the server broadcasts a momentum look-ahead::

        b = w + lam m                   (m starts at 0: the first broadcast is w)
        clients return delta_i = theta_i - b
        m <- lam m + mean;   w <- w + m;   next b = w + lam m

    One parameter ``lam`` is both the look-ahead and the momentum decay (default 0.85). The model to evaluate is
    ``w`` (:meth:`eval_params`), not ``b`` (:meth:`broadcast`). The clients' regularizer ``(beta/2)||theta-b||^2``
    belongs to the local step (``fastagg.client``). ``lr`` (default 1, the paper's rule) scales the step,
    ``w <- w + lr m``, as torch's learning rate (for lr schedulers).
    """

    _hyper = ("lam", "lr")
    _vector_state = ("momentum",)
    _apply_reads_start = True

    def __init__(self, params, lam: float = 0.85, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self.lam = check_prob(lam, "lam")
        self.lr = check_number(lr, "lr")

    def broadcast(self):
        """``b = w + lam m`` in the params' form, from the params and momentum as they are now (params loaded or
        changed in place since the last step count), into a buffer the next step or broadcast rewrites."""
        extra = self._extra_out()
        m = self._flat.get("momentum")
        with torch.no_grad():
            for dst, w, mk in zip(extra.parts, self._p.parts,
                                  self._p.segments.slice(m) if m is not None else self._p.parts):
                dst.copy_(w if m is None else torch.add(w.to(mk.dtype), mk, alpha=self.lam))
        return self._user_form(self._flat["extra"])

    def _round(self, stats):
        lr = device_scalar(self.lr, stats.mean)
        finite = self._check_finite(stats, lr)
        lam = device_scalar(self.lam, stats.mean)
        self._momentum(stats, lr, finite=finite, buf="momentum", momentum=self.lam, extra_coef=lam)
        return lr, finite


BIAS_CORRECTIONS = ("flower", "adam", None)


class _AdamFamily(ServerOptimizer):
    _nonnegative_state = ("v", "vhat")  # second moments: load_state_dict refuses negative ones

    rule = "adam"

    def _init_adam(self, lr, betas, tau, bias_correction):
        self.lr = check_number(lr, "lr")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (b1, b2), got {betas!r}")
        self.betas = (check_prob(betas[0], "betas[0]"), check_prob(betas[1], "betas[1]"))
        self.tau = check_number(tau, "tau")
        if bias_correction not in BIAS_CORRECTIONS:
            raise ValueError(f"bias_correction must be one of {BIAS_CORRECTIONS}, got {bias_correction!r}")
        self.bias_correction = bias_correction

    def _lr(self, like: torch.Tensor) -> torch.Tensor:
        """``lr * sqrt(1 - b2^k) / (1 - b1^k)``: Flower uses k = round + 1 with rounds counted from 1 (k = 2 in
        the first round), Kingma & Ba k = round; without bias correction, lr."""
        if self.bias_correction is None:
            return device_scalar(self.lr, like)
        k = self._flat["step"] + (2.0 if self.bias_correction == "flower" else 1.0)
        b1, b2 = self.betas
        return self.lr * torch.sqrt(1 - torch.pow(b2, k)) / (1 - torch.pow(b1, k))

    def _round(self, stats):
        lr = self._lr(stats.mean)
        finite = self._check_finite(stats, lr)
        self._backend.adam_apply(
            params=self._p, mean=stats.mean, finite=finite,
            m=None if self.rule == "adagrad" else self._buffer("m"), v=self._buffer("v"),
            vhat=self._buffer("vhat") if self.rule == "ams" else None, rule=self.rule, lr=lr,
            beta1=self.betas[0], beta2=self.betas[1], tau=self.tau, ams_eps=getattr(self, "vhat_floor", 0.0),
            overflow_out=self._overflow)
        return lr, finite


class FedAdam(_AdamFamily):
    """FedAdam (Reddi et al.; Flower's FedAdam)::

        m <- b1 m + (1 - b1) mean;   v <- b2 v + (1 - b2) mean^2        (m, v start at 0)
        w <- w + lr * sqrt(1 - b2^k) / (1 - b1^k) * m / (sqrt(v) + tau)

    ``bias_correction="flower"`` (default): k = round + 1 with rounds from 1, as Flower 1.42; ``"adam"``: k = round
    (Kingma & Ba); ``None``: none. Defaults are Flower's message API: ``lr=0.1, betas=(0.9, 0.99), tau=1e-3``.
    """

    _hyper = ("lr", "betas", "tau", "bias_correction")
    _vector_state = ("m", "v")

    def __init__(self, params, lr: float = 0.1, betas=(0.9, 0.99), tau: float = 1e-3,
                 bias_correction: str | None = "flower", **kw):
        super().__init__(params, **kw)
        self._init_adam(lr, betas, tau, bias_correction)


class FedYogi(_AdamFamily):
    """FedYogi (Flower's FedYogi; no bias correction)::

        m <- b1 m + (1 - b1) mean;   v <- v - (1 - b2) mean^2 sign(v - mean^2)     (m, v start at 0)
        w <- w + lr * m / (sqrt(v) + tau)

    Defaults (Flower): ``lr=1e-2, betas=(0.9, 0.99), tau=1e-3``.
    """

    rule = "yogi"
    _hyper = ("lr", "betas", "tau")
    _vector_state = ("m", "v")

    def __init__(self, params, lr: float = 1e-2, betas=(0.9, 0.99), tau: float = 1e-3, **kw):
        super().__init__(params, **kw)
        self._init_adam(lr, betas, tau, None)


class FedAdagrad(_AdamFamily):
    """FedAdagrad (Flower's FedAdagrad: no first moment)::

        v <- v + mean^2;   w <- w + lr * mean / (sqrt(v) + tau)      (v starts at 0)

    Defaults (Flower's message API): ``lr=0.1, tau=1e-3``.
    """

    rule = "adagrad"
    _hyper = ("lr", "tau")
    _vector_state = ("v",)

    def __init__(self, params, lr: float = 0.1, tau: float = 1e-3, **kw):
        super().__init__(params, **kw)
        self._init_adam(lr, (0.0, 0.0), tau, None)


class FedAMS(_AdamFamily):
    """FedAMS (Wang et al., 2022; paper 003's baseline)::

        m, v as Adam;   vhat <- max(vhat, v, vhat_floor)       (vhat starts at 0)
        w <- w + lr * m / (sqrt(vhat) + tau)

    ``vhat_floor`` is the paper's "max stabilization factor" (tuned over 1e-8 ... 1 in paper 003). The FedCAMS
    code adds bias corrections and 1e-8 to the denominator: ``bias_correction="adam", tau=1e-8``.
    Defaults: ``lr=0.1, betas=(0.9, 0.99), vhat_floor=1e-8, tau=0, bias_correction=None``.
    """

    rule = "ams"
    _hyper = ("lr", "betas", "tau", "vhat_floor", "bias_correction")
    _vector_state = ("m", "v", "vhat")

    def __init__(self, params, lr: float = 0.1, betas=(0.9, 0.99), vhat_floor: float = 1e-8, tau: float = 0.0,
                 bias_correction: str | None = None, **kw):
        super().__init__(params, **kw)
        self._init_adam(lr, betas, tau, bias_correction)
        self.vhat_floor = check_number(vhat_floor, "vhat_floor")


class QFedAvg(ServerOptimizer):
    """q-FedAvg (Li, Sanjabi, Beirami and Smith, "Fair Resource Allocation in Federated Learning", ICLR 2020;
    Flower 1.42's ``QFedAvg``): clients with a larger training loss weigh more (``q`` sets how much)::

        L = 1 / client_learning_rate,   F_i = loss_i + 1e-10,   d_i = w_i - w   (client i's update)
        h_i = q F_i^(q-1) L^2 ||d_i||^2 + L F_i^q
        w  <- w + lr * L sum_i F_i^q d_i / sum_i h_i

    (Flower writes it with ``Delta_i = L (w - w_i)``, ``delta_i = F_i^q Delta_i``, ``w <- w - sum delta_i / sum
    h_i``; ``lr`` is fastagg's server learning rate, 1 in Flower.) One read of the updates: the stats pass
    weighs them by ``F_i^q`` and gives every ``||d_i||^2``, so the step is ``eta * mean`` with
    ``eta = lr L sum_i F_i^q / sum_i h_i``. ``q = 0`` is FedAvg with equal weights. ``step(deltas, losses)``:
    each client's training loss (finite, >= 0) in the order of ``deltas``.
    """

    needs_client_norms = True  # h_i reads ||d_i||^2
    _apply_reads_start = True

    _hyper = ("lr", "client_learning_rate", "q")

    def __init__(self, params, client_learning_rate: float, q: float = 0.1, lr: float = 1.0, **kw):
        super().__init__(params, **kw)
        self.client_learning_rate = check_number(client_learning_rate, "client_learning_rate", allow_equal=False)
        self.q = check_number(q, "q")
        self.lr = check_number(lr, "lr")
        self._f: torch.Tensor | None = None

    def step(self, deltas: Any = None, losses: Any = None, *, base: Any = None) -> StepStats:  # type: ignore[override]
        if deltas is None or losses is None:
            raise TypeError("QFedAvg.step needs deltas and losses (each client's training loss, Flower's "
                            "train_loss): it has no pseudo-gradient form")
        if isinstance(deltas, Accumulator):
            raise TypeError("QFedAvg weighs each client by its loss and its own norm: pass the updates, not an "
                            "Accumulator of their sum")
        f = _losses(losses) + 1e-10
        self._f = f
        try:
            return super().step(deltas, weights=f ** self.q, base=base)
        except ValueError as e:
            if str(e).startswith("weights must have shape"):
                raise ValueError(f"losses must hold one value per client ({e})") from None
            raise
        finally:
            self._f = None

    def _round(self, stats):
        inv_lr = 1.0 / self.client_learning_rate
        f = self._f.to(device=stats.mean.device, dtype=torch.float64)
        fq = f ** self.q
        h = self.q * f ** (self.q - 1) * inv_lr * inv_lr * stats.sq_norms + inv_lr * fq
        eta = (self.lr * inv_lr * fq.sum() / h.sum()).reshape(())
        finite = self._check_finite(stats, eta)
        self._momentum(stats, eta, finite=finite)
        return eta, finite


def _losses(losses: Any) -> torch.Tensor:
    """Training losses as float64 on the host: finite and >= 0 (a ValueError names the first bad one)."""
    if isinstance(losses, torch.Tensor):
        if losses.is_complex() or losses.dtype == torch.bool or losses.device.type == "meta":
            raise TypeError(f"losses must be real numbers, got a {losses.dtype} tensor on {losses.device}")
        t = losses.detach().to("cpu", torch.float64).reshape(-1)
    else:
        values = list(losses) if not isinstance(losses, (int, float)) else [losses]
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"losses[{i}] must be a real number, got {type(v).__name__}")
        try:
            t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        except OverflowError:
            raise ValueError("losses hold an integer too large for a float") from None
    bad = ~torch.isfinite(t) | (t < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"losses[{i}] = {float(t[i])!r}; a training loss must be a finite number >= 0")
    return t


for _cls in (FedExP, FedExPM, ScaffoldExP):
    _cls.__doc__ = _cls.__doc__.replace("{eps_doc}", _EPS_DOC)
del _cls
