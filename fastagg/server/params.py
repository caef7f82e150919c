"""Following the parameters, as torch's optimizers do: the tensors ``param_groups`` keeps, what the flat views were
made from (so a ``model.to(...)`` / ``.double()`` / ``p.data = ...`` is seen at the next step), the params' own form
for what the optimizer hands back (``broadcast``, ``eval_params``), and the pseudo-gradients in ``.grad``."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..backends import resolve
from ..flat import as_tensor, split_entries
from ..passes import like_params
from ..rows import ParamRows, compute_dtype, param_rows

__all__ = ["one_group", "named_pairs", "torch_params", "binding", "moved", "follow", "user_form", "gradients",
           "extra_out"]


def named_pairs(params: list) -> bool:
    """``model.named_parameters()`` materialized: (name, tensor) pairs."""
    return bool(params) and all(isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str)
                                and isinstance(e[1], torch.Tensor) for e in params)


def one_group(params: Any, owner: str) -> Any:
    """The params as one group: ``model.parameters()`` listed, ``model.named_parameters()`` as the state_dict form
    keyed by name; torch's list of parameter-group dicts refused (one fused rule updates the whole model)."""
    if isinstance(params, Iterator):  # model.parameters(), model.named_parameters()
        params = list(params)
    if isinstance(params, list) and params and all(isinstance(e, dict) and "params" in e for e in params):
        raise TypeError(f"{owner} takes one parameter group (the whole model, updated by one fused "
                        "rule): pass the parameters or the module, and the hyperparameters as arguments")
    if isinstance(params, list) and named_pairs(params):
        params = dict(params)  # named_parameters(): the state_dict form, keyed by name
    return params


def torch_params(p: ParamRows, buffers_count: bool = False) -> list:
    """The tensors torch.optim keeps in ``param_groups``: the module's Parameters (and floating buffers, when they
    count), or the user's own tensors (numpy arrays as tensors sharing their memory, a non-leaf view detached), in
    the order of the flat buffer."""
    orig = p.original
    if isinstance(orig, torch.nn.Module):
        extra = [b for _, b in orig.named_buffers() if b.is_floating_point()] if buffers_count else []
        return list(orig.parameters()) + extra
    named, _ = ([(None, orig)], None) if isinstance(orig, (torch.Tensor, np.ndarray)) else split_entries(
        orig, where="params", buffers_count=buffers_count)
    tied = {a for a, _ in p.form.aliases}  # (a tied entry is one parameter: its alias names no tensor of its own)
    return [v if isinstance(v, torch.Tensor) and (v.is_leaf or v.retains_grad) else as_tensor(v).detach()
            for k, v in named if k not in tied]


def binding(tensors: list, original: Any) -> tuple:
    """What the flat views were made from: each parameter's storage (a dtype or device change gives a new one)
    and, for a module, every entry of its modules', parameters' and buffers' tables (a replaced layer or a buffer
    moved by ``model.to``). Cheap: no module traversal per step."""
    ptrs = tuple(t.data_ptr() for t in tensors)
    if not isinstance(original, torch.nn.Module):
        return ptrs, ()
    tables = [d for m in original.modules() for d in (m._modules, m._parameters, m._buffers) if d]
    return ptrs, tuple((d, len(d), tuple(d.items())) for d in tables)


def moved(bound: tuple, tensors: list) -> bool:
    """Whether the parameters moved since :func:`binding` gave ``bound``."""
    ptrs, tables = bound
    if ptrs != tuple(t.data_ptr() for t in tensors):
        return True
    for d, n, items in tables:
        if len(d) != n or any(d.get(k) is not v for k, v in items):
            return True
    return False



def follow(opt) -> None:
    """Re-bind ``opt`` to its parameters when they moved (``model.to``/``.double()``/``.half()``): new views, the
    state moved to their device and cast to their compute dtype, the backend chosen for that device."""
    if not moved(opt._bound, opt.param_groups[0]["params"]):
        return
    orig = opt._p.original
    group = opt.param_groups[0]["params"]
    mine = list(orig.parameters()) if isinstance(orig, torch.nn.Module) else []
    if [id(t) for t in mine] != [id(t) for t in group[:len(mine)]]:
        raise RuntimeError(f"the module's parameters were replaced since {type(opt).__name__} was built (a "
                           "layer assigned anew?): build the optimizer again on the module")
    new = param_rows(orig, buffers_count=opt.buffers == "optimizer")
    if new.segments.lens != opt._p.segments.lens:
        raise RuntimeError(f"the parameters changed size since {type(opt).__name__} was built "
                           f"({list(opt._p.segments.lens)} -> {list(new.segments.lens)} elements)")
    cdt = compute_dtype(new.dtype)
    kinds = {"extra": new.dtype, **{k: cdt for k in opt._vector_state}}
    opt._flat = {k: v.to(device=new.device, dtype=kinds.get(k, v.dtype)) for k, v in opt._flat.items()}
    opt._p, opt.layout, opt.device, opt._cdt = new, new.form, new.device, cdt
    opt._backend = resolve(opt._backend_name, opt.device)
    opt._means, opt._extra = {}, None
    opt._forget_views()
    if opt.buffers == "optimizer":  # the module's buffers are new tensors after model.to()
        opt.param_groups[0]["params"] = torch_params(new, True)
    opt._bound = binding(opt.param_groups[0]["params"], opt._p.original)


def user_form(p: ParamRows, tensors: list, flat: torch.Tensor | None) -> Any:
    """The params' form with the parameter entries taken from ``flat`` (None: the params themselves): a flat
    tensor or array, a list, or -- for a module or a state_dict -- a full state_dict (buffers included, the
    params' own), so ``model.load_state_dict(...)`` takes it. Views, never copies. ``tensors``: param_groups'."""
    orig, layout = p.original, p.form
    if flat is None:
        views = [v.reshape(s) for v, s in zip(p.parts, layout.shapes)]
    else:
        views = [flat[o:o + n].reshape(sh) for o, n, sh in zip(layout.offsets, layout.numels, layout.shapes)]
    if layout.numpy:
        views = [v.numpy() for v in views]
    if layout.kind == "flat":
        return orig if flat is None else views[0]
    if isinstance(orig, torch.nn.Module):
        by_id = {id(t): v for t, v in zip(tensors, views)}
        return {k: by_id[id(t)] if id(t) in by_id else t.detach() for k, t in orig.state_dict(keep_vars=True).items()}
    if layout.kind == "dict":
        mine = dict(zip(layout.names, views))
        mine.update((a, mine[e]) for a, e in layout.aliases if e in mine)  # a tied name: its entry's new value
        return {k: mine.get(k, v) for k, v in orig.items()}
    return views


def gradients(tensors: list, layout) -> Any:
    """The pseudo-gradients torch's outer optimizers take (``p.grad = global - local``), as one client in the
    params' form; the step negates them into fastagg's ``delta = local - global``. A frozen parameter
    (``requires_grad=False``) without ``.grad`` -- a fine-tuned model's fixed layers, which torch's optimizers skip
    -- takes a zero pseudo-gradient: with no state of its own yet it does not move, as under torch. A trainable
    one without ``.grad`` is refused, naming it (a missing pseudo-gradient is a bug of the caller's loop)."""
    grads = []
    for k, t in enumerate(tensors):
        if t.grad is None and not t.requires_grad:
            grads.append(torch.zeros_like(t))
            continue
        if t.grad is None:
            name = layout.names[k] if layout.names[k] is not None else k
            raise ValueError(f"step() without deltas reads each parameter's .grad (the pseudo-gradient global - "
                             f"local, as torch's outer optimizers take it); parameter {name!r} has none")
        grads.append(t.grad)
    if layout.kind == "flat":
        return grads[0]
    return dict(zip(layout.names, grads)) if layout.kind == "dict" else grads


def extra_out(p: ParamRows, flat_state: dict, views: ParamRows | None, start: list | None) -> ParamRows:
    """Views of the optimizer's ``extra`` buffer (the evaluation model or the broadcast point, in the params' dtype)
    like the params: created as a copy of the params (or of the start model, ``start``) on first use, the views
    ``views`` reused while they still point at it."""
    if "extra" not in flat_state:
        flat = torch.empty(p.segments.numel, dtype=p.dtype, device=p.device)
        for dst, src in zip(p.segments.slice(flat), start or p.parts):
            dst.copy_(src)
        flat_state["extra"] = flat
    if views is None or views.parts[0].data_ptr() != flat_state["extra"].data_ptr():
        views = like_params(p, flat_state["extra"])
    return views
