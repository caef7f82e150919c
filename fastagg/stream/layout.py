"""How another accumulator's or a saved round's entries and buffers map onto an Accumulator's own (``merge``,
``load_state_dict``): state_dicts are matched by key, anything else entry by entry."""
from __future__ import annotations

import math

import torch

from ..flat import Layout


def entry_slices(form: Layout, signature: tuple, what: str) -> list | None:
    """How to read a flat vector laid out as ``signature`` (name, shape, dtype per entry) in the entry order of
    ``form`` (the accumulator's layout): None when it already is, else one (offset, numel) per entry of ``form``.
    State_dicts are matched by key (the same keys in another order are reordered); anything else must match entry
    by entry."""
    mine = form.signature()
    theirs = tuple((n, tuple(shape), str(dt)) for n, shape, dt in signature)
    if theirs == mine:
        return None
    if form.kind == "dict" and all(n is not None for n, _, _ in theirs):
        by_name = {}
        off = 0
        for n, shape, dt in theirs:
            numel = math.prod(shape)
            by_name[n] = (off, numel, shape, dt)
            off += numel
        missing = [n for n, _, _ in mine if n not in by_name]
        extra = [n for n in by_name if n not in {m for m, _, _ in mine}]
        if not missing and not extra:
            out = []
            for n, shape, dt in mine:
                o, numel, their_shape, their_dt = by_name[n]
                if (their_shape, their_dt) != (shape, dt):
                    raise ValueError(f"{what}'s entry {n!r} has shape {their_shape} dtype {their_dt}; this "
                                     f"accumulator's has shape {shape} dtype {dt}")
                out.append((o, numel))
            return out
        raise ValueError(f"{what} has entries {sorted(extra)[:4]} this accumulator does not, and lacks "
                         f"{sorted(missing)[:4]}" if extra and missing else
                         f"{what} has entries this accumulator does not: {sorted(extra)[:4]}" if extra else
                         f"{what} lacks this accumulator's entries {sorted(missing)[:4]}")
    for k, (a, b) in enumerate(zip(theirs, mine)):
        if a != b:
            raise ValueError(f"{what}'s entry {a[0] if a[0] is not None else k} has shape {a[1]} dtype {a[2]}; "
                             f"this accumulator's has shape {b[1]} dtype {b[2]}")
    raise ValueError(f"{what} has {len(theirs)} entries; this accumulator has {len(mine)}")


def buffer_order(buffer_names: tuple, names: list, what: str) -> list:
    """For each of the accumulator's buffers (``buffer_names``), its index among ``names`` (buffers matched by
    name)."""
    if sorted(map(str, names)) != sorted(map(str, buffer_names)) or len(set(names)) != len(names):
        raise ValueError(f"{what}'s buffers are {list(names)}; this accumulator's {list(buffer_names)}")
    return [list(names).index(n) for n in buffer_names]


def reordered(flat: torch.Tensor, slices: list | None) -> torch.Tensor:
    """``flat`` read in another entry order (:func:`entry_slices`)."""
    if slices is None:
        return flat
    return torch.cat([flat[o:o + n] for o, n in slices])
