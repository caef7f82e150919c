"""An optimizer's checkpoint: torch's ``state_dict`` / ``load_state_dict`` over the flat state buffers, in the
format of :mod:`fastagg.checkpoint` (which also holds every check a load runs before it changes anything)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


from .. import checkpoint

__all__ = ["state_dict", "load_state_dict"]


def _shard_tag(opt) -> dict:
    """Which slice of a sharded optimizer this rank holds."""
    import torch.distributed as dist

    return {"rank": dist.get_rank(opt.group), "world": dist.get_world_size(opt.group)}


def state_dict(opt) -> dict:
    """torch's optimizer checkpoint: ``{"state": {i: {buffer: slice shaped like parameter i, "step": ...}},
    "param_groups": [{hyperparameters..., "params": [0, 1, ...]}]}``, plus ``"fastagg"``: the format version, the
    optimizer class and the parameter layout (and, sharded, which slice this is), which :func:`load_state_dict`
    checks. Tensors are copies. Like torch optimizers, the parameters themselves are not included: save the model
    alongside. Hooks registered with ``register_state_dict_pre_hook`` / ``register_state_dict_post_hook`` run as
    torch.optim.Optimizer.state_dict runs them (a post hook's returned dict replaces the checkpoint)."""
    with opt._serial:  # (not torn by a step in another thread)
        return _state_dict(opt)


def _state_dict(opt) -> dict:
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    opt._follow()
    flat = {"optimizer": type(opt).__name__, "format": checkpoint.FORMAT_VERSION,
            "hyperparameters": opt.hyperparameters,
            "group": {k: v for k, v in opt.param_groups[0].items() if k not in opt._hyper and k not in
                      checkpoint.GROUP_KEYS}, "layout": opt.layout.signature(), "state": dict(opt._flat)}
    if opt.sharded:  # which slice this is: distributed.reshard puts the slices back in order by it
        flat["shard"] = _shard_tag(opt)
    out = checkpoint.torch_checkpoint(flat)
    if hasattr(opt.aggregate, "state_dict"):  # a DP mechanism: its noise stream must continue, never replay
        out["fastagg"]["aggregate"] = {"class": type(opt.aggregate).__name__, "state": opt.aggregate.state_dict()}
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        result = post_hook(opt, out)
        if result is not None:
            out = result
    return out


def load_state_dict(opt, state_dict: Any) -> None:
    """Restore a checkpoint of the same optimizer class and parameter layout (hyperparameters included), in torch's
    shape (:func:`state_dict`) or fastagg's earlier flat one (format 1).

    Everything is checked before anything changes: the optimizer class, format and parameter layout; every
    hyperparameter's range (as the constructor checks it); every buffer by name -- one this optimizer keeps, with
    each parameter's slice shaped like the parameter, one dtype, finite -- and the round counter (a whole number
    >= 0, the same for every parameter). Buffers may come from another device (they are moved to the params').
    Raises ValueError / TypeError naming the first problem; nothing is changed then.

    As in torch, a checkpoint saved from ``parameters()`` loads into an optimizer built on ``named_parameters()``
    (or a module, or a state_dict) and the other way round: entries are matched by position, shape and dtype, and
    names are compared only when both sides have them. A plain-number ``step`` is taken as torch takes it. Hooks
    registered with ``register_load_state_dict_pre_hook`` (given a shallow copy; a returned dict replaces it) and
    ``register_load_state_dict_post_hook`` run as torch runs them.
    """
    if isinstance(state_dict, Mapping):
        state_dict = dict(state_dict)  # a shallow copy, as torch's: a pre hook may edit it in place
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    with opt._serial:  # (not mixed with a step in another thread)
        _load(opt, state_dict)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def _load(opt, state_dict: Any) -> None:
    opt._follow()
    ck = checkpoint.flat_checkpoint(state_dict)
    if ck["optimizer"] != type(opt).__name__:
        raise ValueError(f"state_dict is from {ck['optimizer']}; this optimizer is {type(opt).__name__}")
    checkpoint.check_shard(ck.get("shard"), sharded=opt.sharded, mine=lambda: _shard_tag(opt))
    checkpoint.check_layout(opt.layout.signature(), ck["layout"])
    hyper, extras = ck["hyperparameters"], {}
    if ck["format"] == 1 and isinstance(hyper, dict) and "lr" in opt._hyper and "lr" not in hyper:
        hyper = {**hyper, "lr": 1.0}  # format 1 of FedExP, FedExP-M, SCAFFOLD-ExP, FedACG: no lr (it was 1)
    if ck["format"] != 1 and isinstance(hyper, dict):  # a torch group: the settings and what schedulers keep
        extras = {**ck["group"], **{k: v for k, v in hyper.items() if k not in opt._hyper}}
        hyper = {k: v for k, v in hyper.items() if k in opt._hyper}
    if not isinstance(hyper, dict) or set(hyper) != set(opt._hyper):
        raise ValueError(f"state_dict's hyperparameters {sorted(hyper) if isinstance(hyper, dict) else hyper!r} "
                         f"do not match {sorted(opt._hyper)}")
    try:  # the constructor checks every range; a probe on the same params changes nothing here
        probe = opt._probe(hyper)
    except (TypeError, ValueError) as e:
        raise type(e)(f"state_dict's hyperparameters are invalid: {e}") from e
    kinds = checkpoint.state_kinds(opt._p.segments.numel, opt._p.dtype, opt._cdt, opt._vector_state,
                                   opt._scalar_state)
    state = checkpoint.checked_state(ck["state"], kinds, nonnegative=opt._nonnegative_state,
                                     owner=type(opt).__name__, device=opt.device)
    applied = float(state["step"]) > 0  # a rule's 0-d buffers exist from its construction, its vectors from round 1
    missing = [n for n in probe._used_state() if n not in state and (applied or n in opt._scalar_state)]
    if missing:
        raise ValueError(f"state_dict has no {missing[0]!r} buffer, which {type(opt).__name__} keeps from its first "
                         f"round on (round counter {float(state['step']):g}): loaded without it the rule would restart "
                         "it from zero")
    agg = checkpoint.checked_aggregate_state(state_dict, opt.aggregate)
    for k in opt._hyper:
        setattr(opt, k, getattr(probe, k))
    if agg is not None:
        opt.aggregate.load_state_dict(agg)
    opt.param_groups[0].update(extras)  # what schedulers keep in the group (initial_lr, ...)
    opt._flat = state
    opt._extra = None
    opt._forget_views()
