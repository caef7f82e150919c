"""The Accumulator's saved round (``state_dict`` / ``load_state_dict``), format 3: ``numel``, ``dtype``,
``buffers`` (names), ``layout`` ((name, shape, dtype) per entry), ``sum``, ``sq_norms`` (one per client),
``weighted_sq``, ``total_weight``, ``client_ids``, ``buffer_sums``, ``client_norms`` (only when False) and
``crc32``, the CRC-32 of all of it (:func:`state_crc`). Formats 1 and 2 (before the checksum, and before the
entries' keys) still load, with the checks they allow."""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import torch

from .._checks import check_number
from .layout import buffer_order, entry_slices, reordered
from .rounds import Round, check_id


def state_dict(acc) -> dict:
    """``acc``'s round in the format above (tensors copied to the CPU), its CRC-32 last."""
    with acc._lock:
        acc._written_sum()
        r = acc._round
        state = {"format": 3, "numel": acc._numel, "dtype": str(acc._dtype), "buffers": list(acc._buffer_names),
                 "layout": [list(e) for e in acc._form.signature()],
                 "sum": r.sum.detach().cpu().clone(),
                 # (client_norms=False: zeros, and the flag, so that an accumulator keeping norms refuses them)
                 "sq_norms": r.norm_tensor(acc.device).cpu().clone() if acc._client_norms else
                 torch.zeros(r.n, dtype=torch.float64),
                 "weighted_sq": float(r.weighted_sq) if acc._client_norms else 0.0,
                 "total_weight": float(r.total_weight), "client_ids": r.ids(),
                 "buffer_sums": [None if b is None else b.cpu().clone() for b in r.buffer_sums]}
        if not acc._client_norms:
            state["client_norms"] = False
    state["crc32"] = state_crc(state)
    return state


def load_state_dict(acc, state: dict) -> None:
    """Check ``state`` against ``acc`` (everything, before anything changes), then make it ``acc``'s round."""
    if not isinstance(state, dict) or state.get("format") not in (1, 2, 3):
        raise ValueError("not an Accumulator state_dict (format 1, 2 or 3)")
    fmt = state["format"]
    for key in ("numel", "dtype", "buffers", "sum", "sq_norms", "weighted_sq", "total_weight", "client_ids",
                "buffer_sums") + (("crc32",) if fmt >= 2 else ()) + (("layout",) if fmt >= 3 else ()):
        if key not in state:
            raise ValueError(f"the state_dict has no {key!r}")
    if state.get("client_norms", True) is not True and state.get("client_norms") is not False:
        raise ValueError(f"the state_dict's client_norms must be True or False, got {state['client_norms']!r}")
    if acc._client_norms and state.get("client_norms", True) is False:
        raise ValueError("the state_dict keeps no client norms (saved with client_norms=False); this accumulator "
                         "keeps them: load it into an Accumulator(like=..., client_norms=False)")
    if state["numel"] != acc._numel or state["dtype"] != str(acc._dtype):
        raise ValueError(f"the state_dict is of {state['numel']} {state['dtype']} elements; this accumulator "
                         f"holds {acc._numel} {acc._dtype}")
    total = state_tensor(state["sum"], "sum", dtype=acc._sum.dtype, shape=tuple(acc._sum.shape))
    sq = state_tensor(state["sq_norms"], "sq_norms")
    for key in ("buffers", "client_ids", "buffer_sums") + (("layout",) if fmt >= 3 else ()):
        if not isinstance(state[key], (list, tuple)):
            raise ValueError(f"the state_dict's {key} must be a list, got {type(state[key]).__name__}")
    ids = list(state["client_ids"])
    if sq.dim() != 1 or len(sq) != len(ids):
        raise ValueError("the state_dict's sq_norms must be one per client id")
    try:
        ws = check_number(state["weighted_sq"], "weighted_sq", minimum=0.0)
        tw = check_number(state["total_weight"], "total_weight", minimum=0.0)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the state_dict holds a non-finite or negative sum, norm or weight ({e})") from None
    if not (bool(torch.isfinite(total).all()) and bool(torch.isfinite(sq).all() & (sq >= 0).all())):
        raise ValueError("the state_dict holds a non-finite or negative sum, norm or weight")
    for i in ids:
        check_id(i)
    named = [i for i in ids if i is not None]
    if len(set(named)) != len(named):
        raise ValueError("the state_dict's client ids repeat")
    bufs = list(state["buffer_sums"])
    if len(bufs) != len(state["buffers"]):
        raise ValueError("the state_dict's buffer sums do not match its buffers")
    if fmt >= 2 and state_crc(state) != state["crc32"]:
        raise ValueError("the state_dict's checksum does not match its contents (a corrupted file?)")
    if fmt >= 3:  # entries and buffers matched by key
        try:
            layout = tuple((n, tuple(int(v) for v in shape), str(dt)) for n, shape, dt in state["layout"])
        except (TypeError, ValueError):
            raise ValueError("the state_dict's layout must list (name, shape, dtype) per entry") from None
        slices = entry_slices(acc._form, layout, "the state_dict")
        order = buffer_order(acc._buffer_names, list(state["buffers"]), "the state_dict")
    else:
        slices, order = None, list(range(len(bufs)))
        if list(state["buffers"]) != list(acc._buffer_names):
            raise ValueError(f"the state_dict's buffers are {state['buffers']}; this accumulator's "
                             f"{list(acc._buffer_names)}")
    buffer_sums = []
    for name, k in zip(acc._buffer_names, order):
        b = bufs[k]
        if b is not None:
            b = state_tensor(b, f"buffer sum {name!r}", shape=tuple(acc._buffer_like[name].shape))
            if not bool(torch.isfinite(b).all()):
                raise ValueError(f"the state_dict's buffer sum {name!r} is not finite")
            b = b.to(device=acc.device, dtype=torch.float64)
        buffer_sums.append(b)
    with acc._lock:
        r = acc._round
        target = r.scratch if r.scratch is not None else torch.empty_like(r.sum)
        target.copy_(reordered(total, slices).to(acc.device))
        norms = [v.to(torch.float64).to(acc.device) for v in sq.unbind()]
        fresh = dataclasses.replace(Round.empty(target, r.sum, len(acc._buffer_names)), zero=False)
        acc._round = fresh.extended([(norm, i, None) for norm, i in zip(norms, ids)],
                                    weighted_sq=torch.tensor(ws, dtype=torch.float64, device=acc.device),
                                    buffer_sums=tuple(buffer_sums), total_weight=tw)


def state_tensor(t: Any, name: str, *, dtype: torch.dtype | None = None, shape: tuple | None = None) -> torch.Tensor:
    """A tensor of a saved round, checked: real floating point, readable (not on the meta device), of ``dtype`` and
    ``shape`` where given."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"the state_dict's {name} must be a tensor, got {type(t).__name__}")
    if t.device.type == "meta":
        raise ValueError(f"the state_dict's {name} is on the meta device (it holds no values)")
    if not t.is_floating_point():
        raise ValueError(f"the state_dict's {name} has dtype {t.dtype}; expected a real floating point tensor")
    if dtype is not None and t.dtype != dtype or shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"the state_dict's {name} must be a {dtype or 'floating point'} tensor of shape "
                         f"{shape if shape is not None else 'any'}, got {t.dtype} of shape {tuple(t.shape)}")
    return t


def state_crc(state: dict) -> int:
    """CRC-32 of a round state's tensors (their bytes, in place) and of everything else in it (its repr)."""
    keys = ("format", "numel", "dtype", "buffers", "weighted_sq", "total_weight", "client_ids") + \
        (("layout",) if state.get("format", 0) >= 3 else ()) + (("client_norms",) if "client_norms" in state else ())
    crc = zlib.crc32(repr([state[k] for k in keys]).encode())
    for t in [state["sum"], state["sq_norms"], *state["buffer_sums"]]:
        if t is None:
            crc = zlib.crc32(b"None", crc)
        elif isinstance(t, torch.Tensor):
            crc = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
        else:
            raise ValueError(f"the state_dict holds a {type(t).__name__} where a tensor belongs")
    return crc
