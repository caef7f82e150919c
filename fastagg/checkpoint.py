"""The optimizer checkpoint format: torch.optim's ``{state, param_groups}`` shape plus a ``"fastagg"`` entry.

Versions: 2 (current) keeps each vector buffer cut into one slice per parameter, shaped like it, and each 0-d buffer
(the round counter ``step``, FedExP-M's ``numerator``) repeated per parameter, as torch keeps ``step``;
``state_dict["fastagg"]`` holds ``{"format": 2, "optimizer": class name, "layout": [[name, shape, dtype], ...],
["shard": {"rank", "world"}], ["aggregate": {"class", "state"}]}``. 1 (read only): the flat form below, by name.

Every check reads the flat form (:func:`flat_checkpoint`): ``{"optimizer", "format", "hyperparameters", "group",
"layout", "state": name -> flat buffer or 0-d tensor, ["shard"]}``. The functions at the end check a checkpoint
against the optimizer loading it (its buffers, ranges, shard and aggregate state), as
:meth:`fastagg.server.ServerOptimizer.load_state_dict` calls them before it changes anything.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["FORMAT_VERSION", "flat_checkpoint", "torch_checkpoint", "check_layout", "state_kinds", "checked_state",
           "check_shard", "checked_aggregate_state"]

FORMAT_VERSION = 2  # torch's {state, param_groups} shape with a "fastagg" entry; 1: flat buffers by name
GROUP_KEYS = ("params", "param_names")  # param_groups entries that are not settings
SCALAR_STATE = ("step", "numerator")  # 0-d buffers of fastagg's own rules; a rule's others are named in the file


def torch_checkpoint(flat: dict) -> dict:
    """A checkpoint in the flat form (:func:`flat_checkpoint`) in torch's shape: each vector buffer cut into one
    slice per layout entry, shaped like it; each 0-d buffer repeated per parameter, as torch keeps ``step`` (the
    0-d buffers beyond SCALAR_STATE -- a new rule's ``_scalar_state`` -- named in ``"fastagg"["scalar_state"]``, so
    a load reads them as 0-d again)."""
    layout = [(n, tuple(int(x) for x in shape), str(dt)) for n, shape, dt in flat["layout"]]
    per_param: dict = {k: {} for k in range(len(layout))}
    for name, t in flat["state"].items():
        t = t.detach()
        if t.dim() == 0:
            for k in per_param:
                per_param[k][name] = t.clone()
            continue
        off = 0
        for k, (_, shape, _) in enumerate(layout):
            n = math.prod(shape)
            per_param[k][name] = t[off:off + n].reshape(shape).clone()
            off += n
    meta = {"format": FORMAT_VERSION, "optimizer": flat["optimizer"], "layout": [list(e) for e in layout]}
    if flat.get("shard") is not None:
        meta["shard"] = dict(flat["shard"])
    extra_scalars = sorted(n for n, t in flat["state"].items() if t.dim() == 0 and n not in SCALAR_STATE)
    if extra_scalars:
        meta["scalar_state"] = extra_scalars
    group = {**flat["hyperparameters"], **flat.get("group", {}), "params": list(range(len(layout)))}
    return {"state": per_param, "param_groups": [group], "fastagg": meta}


def flat_checkpoint(state_dict: Any) -> dict:
    """A fastagg optimizer checkpoint in the flat form every check reads: ``{"optimizer", "format",
    "hyperparameters", "group", "layout", "state": name -> flat buffer or 0-d tensor, ["shard"]}``, from torch's
    shape (:meth:`ServerOptimizer.state_dict`) or fastagg's format 1 (already flat). The structure is checked here
    (one parameter group, one state entry per layout entry, each slice shaped like its entry, one dtype per buffer,
    0-d buffers equal across parameters); ranges and names are checked by ``load_state_dict``."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"not a fastagg optimizer state_dict (a {type(state_dict).__name__})")
    if "fastagg" not in state_dict:
        if "optimizer" in state_dict and state_dict.get("format") in (1, FORMAT_VERSION):  # already flat
            for key in ("layout", "hyperparameters", "state"):
                if key not in state_dict:
                    raise ValueError(f"state_dict has no {key!r} entry")
            group = state_dict.get("group", {}) if state_dict.get("format") == FORMAT_VERSION else {}
            if not isinstance(group, Mapping):
                raise ValueError(f"state_dict's 'group' is a {type(group).__name__}; expected a dict")
            return {**state_dict, "group": dict(group)}
        if "optimizer" in state_dict:
            raise ValueError(f"state_dict has format {state_dict.get('format')!r}; expected {FORMAT_VERSION} or 1")
        what = ("a torch optimizer's state_dict (no 'fastagg' entry)" if "param_groups" in state_dict
                else "not a fastagg optimizer state_dict (no 'fastagg' entry)")
        raise ValueError(what)
    meta = state_dict["fastagg"]
    if not isinstance(meta, Mapping) or meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"state_dict has format {meta.get('format') if isinstance(meta, Mapping) else meta!r}; "
                         f"expected {FORMAT_VERSION}")
    for key in ("optimizer", "layout"):
        if key not in meta:
            raise ValueError(f"state_dict['fastagg'] has no {key!r} entry")
    groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], Mapping):
        raise ValueError("state_dict['param_groups'] must be a list of one group (a fastagg optimizer holds one)")
    if not isinstance(state, Mapping):
        raise ValueError("state_dict['state'] must map parameter indices to their state")
    layout = meta["layout"]
    try:
        shapes = [tuple(int(x) for x in e[1]) for e in layout]
    except (TypeError, ValueError, IndexError):
        raise ValueError(f"state_dict['fastagg']['layout'] is malformed: {layout!r}") from None
    scalars = meta.get("scalar_state", [])
    if not isinstance(scalars, list) or not all(isinstance(n, str) for n in scalars):
        raise ValueError(f"state_dict['fastagg']['scalar_state'] must list buffer names, got {scalars!r:.200}")
    scalars = SCALAR_STATE + tuple(scalars)
    ids = groups[0].get("params")
    if not isinstance(ids, list) or len(ids) != len(shapes):
        raise ValueError(f"state_dict's parameter group lists {ids!r}; its layout has {len(shapes)} entries")
    slices = [state.get(i, {}) for i in ids]
    names = sorted({n for sl in slices if isinstance(sl, Mapping) for n in sl})
    flat = {}
    for k, sl in enumerate(slices):
        if not isinstance(sl, Mapping):
            raise ValueError(f"state_dict['state'][{ids[k]!r}] is a {type(sl).__name__}; expected a dict")
        for name in names:
            if name not in sl:
                raise ValueError(f"state_dict['state'][{ids[k]!r}] has no {name!r} (parameter 0 has it)")
            if name in scalars and plain_number(sl[name]):  # torch takes a plain-number step, as older
                continue  # checkpoints kept it
            if not isinstance(sl[name], torch.Tensor):
                raise TypeError(f"state_dict buffer {name!r} of parameter {ids[k]!r} is a {type(sl[name]).__name__}; "
                                "expected a tensor")
            if sl[name].layout != torch.strided or sl[name].device.type == "meta":
                raise TypeError(f"state_dict buffer {name!r} of parameter {ids[k]!r} is a {sl[name].layout} tensor "
                                f"on {sl[name].device}; expected a dense tensor holding values")
    for name in names:
        parts = [sl[name] for sl in slices]
        if name in scalars:
            parts = [scalar_tensor(t) for t in parts]
            for k, t in enumerate(parts):
                if t.dim() != 0:
                    raise ValueError(f"state_dict's {name!r} of parameter {ids[k]!r} has shape {tuple(t.shape)}; "
                                     "expected a number or a 0-d tensor")
                if not bool(torch.isfinite(t)):
                    raise ValueError(f"state_dict's {name!r} of parameter {ids[k]!r} is {float(t)!r}; expected a "
                                     "finite number")
                if not torch.equal(t.to(parts[0].device), parts[0]):
                    raise ValueError(f"state_dict's {name!r} differs between parameters 0 and {ids[k]!r} "
                                     "(one round counter for the whole model)")
            flat[name] = parts[0]
            continue
        for k, (t, shape) in enumerate(zip(parts, shapes)):
            if tuple(t.shape) != shape:
                raise ValueError(f"state_dict buffer {name!r} of parameter {ids[k]!r} has shape {tuple(t.shape)}; "
                                 f"the parameter has shape {shape}")
            if t.dtype != parts[0].dtype:
                raise TypeError(f"state_dict buffer {name!r} of parameter {ids[k]!r} has dtype {t.dtype}; "
                                f"parameter 0's has {parts[0].dtype}")
        flat[name] = torch.cat([t.reshape(-1).to(parts[0].device) for t in parts]) if parts else parts
    hyper = {k: v for k, v in groups[0].items() if k not in GROUP_KEYS}
    return {"optimizer": meta["optimizer"], "format": FORMAT_VERSION, "hyperparameters": hyper, "group": {},
            "layout": layout, "state": flat, **({"shard": meta["shard"]} if "shard" in meta else {})}


def check_layout(mine: tuple, given: Any) -> None:
    """A checkpoint's layout against the params': entry by entry the same shape and dtype, and the same name where
    both have one (a checkpoint from ``parameters()`` has none); the error names what differs."""
    try:
        theirs = [(e[0], tuple(int(x) for x in e[1]), str(e[2])) for e in given]
    except (TypeError, ValueError, IndexError):
        raise ValueError(f"state_dict's parameter layout is malformed: {given!r:.200}") from None
    for k, ((name, shape, dtype), (t_name, t_shape, t_dtype)) in enumerate(zip(mine, theirs)):
        label = f"entry {k} ({name or t_name})" if name or t_name else f"entry {k}"
        if name and t_name and name != t_name:
            raise ValueError(f"state_dict's parameter layout differs at entry {k}: it is named {t_name!r}; "
                             f"this parameter is {name!r}")
        if t_shape != tuple(shape):
            raise ValueError(f"state_dict's parameter layout differs at {label}: its shape is {t_shape}; this "
                             f"parameter's is {tuple(shape)}")
        if t_dtype != dtype:
            raise ValueError(f"state_dict's parameter layout differs at {label}: its dtype is {t_dtype}; this "
                             f"parameter's is {dtype}")
    if len(mine) != len(theirs):
        raise ValueError(f"state_dict's parameter layout has {len(theirs)} entries; these params have {len(mine)}")


def plain_number(v: Any) -> bool:
    """An int or float (not a bool): how torch's older checkpoints, and hand-made ones, keep ``step``."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def scalar_tensor(v: Any) -> Any:
    """A plain-number or real 0-d tensor state entry as the float64 0-d tensor fastagg keeps: torch's optimizers
    take a plain-number ``step`` on load, and keep it as a float32 tensor (Adam) or an int64 one; float32 and ints
    within 2^53 convert exactly. Anything else as it is, for the checks to judge."""
    if plain_number(v):
        return torch.tensor(float(v), dtype=torch.float64)
    if (isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype != torch.bool and not v.is_complex()
            and v.dtype != torch.float64):
        return v.detach().to(torch.float64)
    return v




# -- an optimizer's checks on load (fastagg.server.ServerOptimizer.load_state_dict) ---------------------------------
def state_kinds(numel: int, param_dtype: torch.dtype, compute_dtype: torch.dtype, vector_state: tuple,
                scalar_state: tuple) -> dict:
    """Name -> (shape, dtype) of every buffer an optimizer keeps: the round counter ``step``, the evaluation /
    broadcast copy ``extra`` (the params' dtype), its d-vector buffers (the compute dtype), its 0-d ones."""
    kinds = {"step": ((), torch.float64), "extra": ((numel,), param_dtype)}
    for name in vector_state:
        kinds[name] = ((numel,), compute_dtype)
    for name in scalar_state:
        kinds[name] = ((), torch.float64)
    return kinds


def checked_state(given: Any, kinds: dict, *, nonnegative: tuple, owner: str, device: torch.device) -> dict:
    """A checkpoint's flat state checked against ``kinds`` (:func:`state_kinds`) and copied to ``device``: every
    buffer one ``owner`` keeps, shaped and typed as it keeps it, finite, those in ``nonnegative`` >= 0, and a round
    counter that is a whole number in [0, 2^53]. Raises naming the first problem."""
    if not isinstance(given, dict) or "step" not in given:
        raise ValueError("state_dict['state'] must be a dict with at least the round counter 'step'")
    out = {}
    for name, t in given.items():
        if name not in kinds:
            raise ValueError(f"state_dict buffer {name!r} is not one {owner} keeps ({', '.join(sorted(kinds))})")
        if kinds[name][0] == ():
            t = scalar_tensor(t)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict buffer {name!r} is a {type(t).__name__}; expected a tensor")
        if t.layout != torch.strided or t.device.type == "meta":
            raise TypeError(f"state_dict buffer {name!r} is a {t.layout} tensor on {t.device}; expected a dense "
                            "tensor holding values")
        shape, dtype = kinds[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"state_dict buffer {name!r} has shape {tuple(t.shape)}; expected {shape}")
        if t.dtype != dtype:
            raise TypeError(f"state_dict buffer {name!r} has dtype {t.dtype}; expected {dtype}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"state_dict buffer {name!r} holds NaN or Inf")
        if name in nonnegative and bool((t < 0).any()):
            raise ValueError(f"state_dict buffer {name!r} holds negative values; {owner}'s {name} is a sum of "
                             "squares (a step would divide by the square root of it)")
        out[name] = t.detach().to(device=device, copy=True)
    step = float(out["step"])
    if step < 0 or step != int(step) or step > 2.0**53:  # beyond 2^53 the float64 counter stops counting
        raise ValueError(f"state_dict's round counter 'step' is {step!r}; expected a whole number in [0, 2^53]")
    return out


def check_shard(tag: Any, *, sharded: bool, mine: Callable[[], dict]) -> None:
    """A sharded checkpoint is one rank's slice: only that rank (``mine()``: ``{"rank", "world"}``) of a group of
    that size may load it."""
    if tag is None:
        return
    if not sharded:
        raise ValueError(f"state_dict is one slice of a sharded optimizer ({tag!r}); this one is not sharded "
                         "(fastagg.distributed.reshard(..., 1) joins the slices)")
    here = mine()
    if not isinstance(tag, dict) or {k: tag.get(k) for k in here} != here:
        raise ValueError(f"state_dict is the slice of {tag!r}; this optimizer is rank {here['rank']} of "
                         f"{here['world']} (fastagg.distributed.reshard re-cuts the slices)")


def checked_aggregate_state(state_dict: Any, aggregate: Any) -> Any:
    """The aggregate's (a DP mechanism's) state in a checkpoint, checked on a copy of the mechanism; None when the
    checkpoint has none or ``aggregate`` keeps none."""
    meta = state_dict.get("fastagg") if isinstance(state_dict, Mapping) else None
    saved = meta.get("aggregate") if isinstance(meta, Mapping) else None
    if saved is None or not hasattr(aggregate, "load_state_dict"):
        return None
    if not isinstance(saved, Mapping) or saved.get("class") != type(aggregate).__name__:
        got = saved.get("class") if isinstance(saved, Mapping) else type(saved).__name__
        raise ValueError(f"state_dict's aggregate state is of {got!r}; this optimizer aggregates with "
                         f"{type(aggregate).__name__}")
    try:
        copy.copy(aggregate).load_state_dict(saved["state"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"state_dict's aggregate state is invalid: {e!r}") from None
    return saved["state"]
