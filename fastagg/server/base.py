"""The base of every server optimizer: construction, torch.optim compatibility, following the params, the step loop.

A rule is a subclass that declares what it keeps and needs (the class attributes at the top of
:class:`ServerOptimizer`, one sentence each) and defines ``_round(stats) -> (eta, finite)``: the rule's scalars on
the device from the round's statistics, then one apply pass (:meth:`ServerOptimizer._apply` for every rule linear
in the mean, ``backend.adam_apply`` for the Adam family). See docs/ARCHITECTURE.md, "Adding a server rule".
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from .._checks import check_on_nonfinite
from ..backends import resolve
from ..inputs import Target, give_back, round_stats
from ..passes import RoundStats, buffer_updates, check_finite, check_overflow, finish_writes, overflow_counter
from ..privacy.mechanisms import MECHANISMS, dp_stats
from ..robust import RULES, robust_stats
from ..rows import ParamRows, compute_dtype, param_rows
from ..stream import Accumulator
from . import params as following
from . import start as starting
from . import state
from .torch_compat import (GroupRef, Hyper, ParamState, add_param_group, check_group, restore, with_closure,
                           zero_grad)

__all__ = ["ServerOptimizer", "StepStats", "BUFFER_POLICIES"]

BUFFER_POLICIES = ("average", "optimizer")


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


def _checked_aggregate(aggregate: Any, group: Any) -> Any:
    """``aggregate=``: None, a fastagg.robust rule or a fastagg.privacy mechanism, on one rank (no group)."""
    if aggregate is None:
        return None
    if not isinstance(aggregate, RULES + MECHANISMS):
        raise TypeError(f"aggregate must be a fastagg.robust rule ({', '.join(r.__name__ for r in RULES)})"
                        f" or a fastagg.privacy mechanism ({', '.join(r.__name__ for r in MECHANISMS)})"
                        f", got {type(aggregate).__name__}")
    if group is not None:
        raise ValueError("aggregate= with group=: robust rules and DP mechanisms need every client's update on "
                         "one rank (not yet across ranks); gather the updates first")
    return aggregate


def _target(opt: "ServerOptimizer") -> Target:
    """What the input path (:func:`fastagg.inputs.round_stats`) needs to know of ``opt`` for one stats pass."""
    aggregate_stats = None if opt.aggregate is None else dp_stats if isinstance(opt.aggregate, MECHANISMS) \
        else functools.partial(robust_stats, model_buffers=opt._p.buffers)
    return Target(opt._p, opt._backend, opt._backend_name, opt.on_nonfinite, opt._cdt, opt._mean_buffer,
                  opt._written, group=opt.group, sharded=opt.sharded, aggregate=opt.aggregate,
                  aggregate_stats=aggregate_stats, aux_of=opt._aux,
                  needs_client_norms=opt.needs_client_norms, reads_sum=opt._apply_reads_sum,
                  lend_spare=not opt._means, what=f"{type(opt).__name__}'s step", borrowed=opt._borrowed)


def _per_client(stats) -> torch.Tensor:
    """One non-finite flag per client, whatever the input: an Accumulator's statistics carry one flag for its sum
    (a non-finite client was refused at ``add``, so each folded client gets the sum's flag)."""
    flags = stats.nonfinite
    return flags if flags.numel() == stats.num_clients else flags.reshape(-1)[:1].expand(stats.num_clients).clone()


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
    """

    # -- what a rule declares (class attributes; defaults here) and defines (_round, optionally _aux) -------------
    _hyper: tuple = ()  # its hyperparameters: kept in param_groups[0], checked each step, saved in checkpoints
    _vector_state: tuple = ()  # its d-vector state buffers (zeros on first use, the compute dtype)
    _scalar_state: tuple = ()  # its 0-d float64 state buffers, beside the round counter 'step'
    _nonnegative_state: tuple = ()  # buffers whose every element is >= 0 (load_state_dict refuses others)
    needs_client_norms: bool = False  # it reads sum_i p_i ||delta_i||^2 or each one (a norm-less Accumulator refused)
    _apply_reads_start = False  # its apply is one _apply call reading no param before it: it can start from a model
    _apply_reads_sum = False  # it reads the mean only in that _apply call: an Accumulator's sum is read in place

    def _round(self, stats: RoundStats) -> tuple:
        """The rule: ``(eta, finite)`` from the round's statistics, after its one apply pass (required)."""
        raise NotImplementedError

    def _aux(self) -> tuple:
        """(vector, coefficient) whose combination ``mean + coef * vector`` the stats pass measures (FedExP-M's
        ``||mean + beta v||^2``), or (None, 0)."""
        return None, 0.0

    def _forget_views(self) -> None:
        """Drop views of the state buffers the rule keeps (after the buffers were replaced: a load, a move)."""

    def _used_state(self) -> tuple:
        """The buffers every applied round keeps (a checkpoint past round 0 must hold them): all it declares."""
        return self._vector_state + self._scalar_state

    # A rule may also override broadcast() (what clients start from: FedACG), eval_params() (the model to evaluate:
    # the FedExP family) and step() with its own arguments (SCAFFOLD's control_deltas, q-FedAvg's losses).

    group = property(lambda self: self._group.get(), doc="The torch.distributed group of the step, or None.")

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        for name in cls._hyper:
            if not isinstance(getattr(cls, name, None), Hyper):
                setattr(cls, name, Hyper(name))

    def __init__(self, params: Any, *, backend: str = "auto", on_nonfinite: str = "raise", group: Any = None,
                 sharded: bool = False, buffers: str = "average", aggregate: Any = None):
        if buffers not in BUFFER_POLICIES:
            raise ValueError(f"buffers must be one of {BUFFER_POLICIES}, got {buffers!r}")
        self.buffers = buffers
        self.aggregate = _checked_aggregate(aggregate, group)
        self._robust = None
        params = following.one_group(params, type(self).__name__)
        check_on_nonfinite(on_nonfinite)
        # with a group (fastagg.distributed) each rank holds some clients (default) or, sharded, a slice of everything
        if sharded and group is None:
            raise ValueError("sharded=True needs group= (the ranks that hold the other slices)")
        self._group = GroupRef(group)
        self.sharded = bool(sharded)
        self._p: ParamRows = param_rows(params, buffers_count=buffers == "optimizer")
        torch.optim.Optimizer.__init__(self, [{"params": following.torch_params(self._p, buffers == "optimizer")}],
                                       {})
        self.state = ParamState(self)  # torch's per-parameter view of the flat buffers below
        self.layout, self.device, self.on_nonfinite = self._p.form, self._p.device, on_nonfinite
        self._backend_name, self._backend = backend, resolve(backend, self.device)
        self._cdt = compute_dtype(self._p.dtype)
        self._flat: dict[str, torch.Tensor] = {"step": torch.zeros((), dtype=torch.float64, device=self.device)}
        self.last_stats: StepStats | None = None
        self._extra: ParamRows | None = None  # eval model or broadcast point, in params' dtype
        self._means: dict = {}  # reused mean buffers by dtype: a fresh 40 MB one costs ~17 ms of page faults
        self._borrowed: list = []  # (accumulator, spare) lent as a step's mean, given back when the step ends
        self._start: list | None = None  # _step_from's start model (flat parts), until the apply pass reads it
        self._checked_hyper: dict | None = None  # the group's values as last checked
        self._serial = threading.RLock()  # one step, load or save at a time: steps share the mean buffers and state
        self._bound = following.binding(self.param_groups[0]["params"], self._p.original)

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``; a fastagg optimizer holds exactly one group (one fused rule over the whole
        flattened model): :func:`fastagg.server.torch_compat.add_param_group`."""
        add_param_group(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``: clear the parameters' ``.grad`` (the pseudo-gradients :meth:`step` reads when
        called without deltas); without torch._dynamo (see :meth:`add_param_group`)."""
        zero_grad(self.param_groups[0]["params"], set_to_none)

    def __getstate__(self) -> dict:  # torch's keeps only defaults, state and param_groups; the backend by name
        return {k: v for k, v in self.__dict__.items() if k not in ("_backend", "state", "_serial")}

    def __setstate__(self, state: dict) -> None:
        restore(self, state)

    def _follow(self) -> None:
        """Re-bind to the parameters when they moved (``model.to``/``.double()``/``.half()``): new views, the state
        moved and cast to match, the backend chosen for their device (:func:`fastagg.server.params.follow`)."""
        following.follow(self)

    def _check_group(self) -> None:
        """The hyperparameters in ``param_groups[0]`` (a scheduler may have changed them), checked as the
        constructor checks them, before a step uses them."""
        check_group(self)

    def _probe(self, hyper: dict) -> "ServerOptimizer":
        """An optimizer of this class on the same params with ``hyper``: its constructor checks every range and
        changes nothing here."""
        return type(self)(self._p.original, backend=self._backend_name, on_nonfinite=self.on_nonfinite,
                          buffers=self.buffers, aggregate=self.aggregate,
                          **{k: (tuple(v) if k == "betas" else v) for k, v in hyper.items()})

    # -- hyperparameters and state ------------------------------------------------------------------------------
    @property
    def hyperparameters(self) -> dict:
        return {k: getattr(self, k) for k in self._hyper}

    def _buffer(self, name: str) -> torch.Tensor:
        """A flat state buffer (zeros on first use)."""
        if name not in self._flat:
            self._flat[name] = torch.zeros(self._p.segments.numel, dtype=self._cdt, device=self.device)
        return self._flat[name]

    def _extra_out(self) -> ParamRows:
        """The eval/broadcast buffer ``extra``, a copy of the params until the first step writes it."""
        self._extra = following.extra_out(self._p, self._flat, self._extra, self._start)
        return self._extra

    def _user_form(self, flat: torch.Tensor | None) -> Any:
        return following.user_form(self._p, self.param_groups[0]["params"], flat)

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
        """torch's optimizer checkpoint, ``{"state", "param_groups"}`` plus ``"fastagg"`` (format, class, layout):
        :func:`fastagg.server.state.state_dict`."""
        return state.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a checkpoint of the same optimizer class and parameter layout, every part checked before anything
        changes: :func:`fastagg.server.state.load_state_dict`."""
        state.load_state_dict(self, state_dict)

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

    def _stats(self, deltas: Any, weights: Any, name: str = "deltas", base: Any = None,
               negate: bool = False) -> RoundStats:
        """The round's statistics through the one input path (:func:`fastagg.inputs.round_stats`); ``negate``:
        ``deltas`` are pseudo-gradients (the mean of ``-delta``, the aux term measured with its sign flipped)."""
        t = _target(self)
        stats = round_stats(t, deltas, weights, name=name, base=base, sign=-1.0 if negate else 1.0)
        if t.robust is not None:
            self._robust = t.robust
        if negate:  # the mean of -delta, measured with the aux term's sign flipped (norms do not see the sign)
            stats.mean.neg_()
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
        with self._serial:  # two threads stepping at once would share the mean buffers: one after the other
            return with_closure(self._step, deltas, weights, base, closure)

    def _step(self, deltas: Any, weights: Any, *, base: Any) -> StepStats:
        with torch.no_grad():
            self._follow()
            self._check_group()
            negate = deltas is None
            if negate:
                if weights is not None or base is not None:
                    raise TypeError("step() without deltas reads the pseudo-gradients from .grad; weights= and base= "
                                    "go with deltas")
                deltas = [following.gradients(self.param_groups[0]["params"], self.layout)]
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
                give_back(self._borrowed)
        self.last_stats = self._step_stats(stats, eta, finite)
        check_overflow(self._overflow, self.on_nonfinite, "params or the optimizer's state")
        return self.last_stats

    def _step_stats(self, stats: RoundStats, eta: torch.Tensor, finite: torch.Tensor) -> StepStats:
        return StepStats(eta, stats.mean_sq, stats.avg_sq, stats.sq_norms, finite, _per_client(stats),
                         stats.num_clients, self._overflow, self._robust if self.aggregate is not None else None)

    def _step_from(self, start: Any, *args, **kw) -> StepStats:
        """``step(*args, **kw)`` as if the params had first been set to ``start``
        (:func:`fastagg.server.start.step_from`)."""
        return starting.step_from(self, start, *args, **kw)

    def _assign(self, start: Any) -> None:
        """Set the params (and the model's buffers) to ``start``, a model of their form, layout, dtype and device."""
        starting.assign(self, start)

    def _finish(self, stats: RoundStats, finite: torch.Tensor, updates: list) -> None:
        """After the apply pass: the model's buffers (averaged, never stepped; ``updates`` from
        :func:`~fastagg.passes.buffer_updates`) and the round counter."""
        finish_writes(self._p, stats, updates, finite)
        step = self._flat["step"]
        step.copy_(torch.where(finite, step + 1, step))  # in place: a captured CUDA graph replays into it

    def _apply(self, stats: RoundStats, lr: torch.Tensor, *, finite: torch.Tensor, buf: str | None = None,
               momentum: float = 0.0, nesterov: bool = False, extra_coef=None, extra_coef_skip=None) -> None:
        """The apply pass of every rule linear in the mean (all but the Adam family), one read and write of each
        d-vector (``backend.momentum_apply``), nothing when ``finite`` is False::

            buf <- momentum * buf + mean          (buf given; else buf = mean)
            w   <- w + lr * buf                   (nesterov: w + lr * (mean + momentum * buf))
            extra <- w_new + extra_coef * buf     (extra_coef given: FedExP's eval model, FedACG's look-ahead)
        """
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
