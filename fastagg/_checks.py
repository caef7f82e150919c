"""Argument validation shared by the functional ops, the accumulator and the server optimizers."""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch

from .flat import as_tensor

ON_NONFINITE = ("raise", "skip")


def canonical_device(device) -> torch.device:
    """The device as tensors on it report it: ``"cuda"`` -> ``cuda:<current>``, ``"cpu:0"`` -> ``cpu``."""
    d = torch.device(device)
    if d.type == "cpu":
        return torch.device("cpu")
    if d.index is None:
        return torch.empty(0, device=d).device
    return d


def check_on_nonfinite(on_nonfinite: str) -> None:
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")


def _as_float(value: Any, name: str) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond float64's range (10**400)
        raise ValueError(f"{name} must be a finite number, got an integer too large for a float") from None


def check_number(value: Any, name: str, *, minimum: float = 0.0, allow_equal: bool = True) -> float:
    if type(value) is float or type(value) is int:  # the common case, without the ABC checks below
        value = _as_float(value, name)
        if math.isfinite(value) and (value >= minimum if allow_equal else value > minimum):
            return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        if value.device.type == "meta":
            raise ValueError(f"{name} is on the meta device (it holds no value)")
        if value.is_complex():
            raise TypeError(f"{name} must be a real number, got a {value.dtype} tensor")
        value = value.item()
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = _as_float(value, name)
    ok = math.isfinite(value) and (value >= minimum if allow_equal else value > minimum)
    if not ok:
        op = ">=" if allow_equal else ">"
        raise ValueError(f"{name} must be a finite number {op} {minimum:g}, got {value!r}")
    return value


def check_int(value: Any, name: str, *, minimum: int = 0, maximum: int | None = None, what: str | None = None) -> int:
    """An integer in ``[minimum, maximum]`` (no upper bound when ``maximum`` is None) as a Python int: Python and
    numpy integers are taken, bools, floats (even ``3.0``) and strings refused with a ValueError
    ``"{name} must be {what}, got {value!r}"``, ``what`` being ``an integer >= {minimum}`` or
    ``an integer in [{minimum}, {maximum}]`` unless given (for a range stated otherwise, e.g. ``[0, 2^63)``)."""
    if (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum
            and (maximum is None or value <= maximum)):
        return int(value)
    if what is None:
        what = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"
    raise ValueError(f"{name} must be {what}, got {value!r}")


def normalized_weights(weights: Any, num_clients: int, device: torch.device, *, sync: bool = True) -> torch.Tensor:
    """``p_i = n_i / sum_j n_j`` as float64 on ``device`` (``1/M`` each when ``weights`` is None), computed as
    ``(n_i / max n) / sum_j (n_j / max n)`` so weights near float64's largest value cannot overflow the sum.

    Weights are checked on the host (finite, >= 0, not all zero; a ValueError names the first bad one). With
    ``sync=False`` a tensor already on a GPU is checked on the device instead, without a host read (so the step
    can be captured in a CUDA graph): invalid weights make every coefficient NaN, so the round is not finite and
    is skipped like a round with a NaN client.
    """
    if weights is None:
        return torch.full((num_clients,), 1.0 / num_clients, dtype=torch.float64, device=device)
    if isinstance(weights, torch.Tensor):
        if weights.device.type == "meta":
            raise ValueError("weights are on the meta device (they hold no values)")
        if weights.is_complex() or weights.dtype == torch.bool:
            raise TypeError(f"weights must be real numbers, got a {weights.dtype} tensor")
        w = weights.detach().to(torch.float64)
    else:
        w = torch.as_tensor(_weights_array(weights))
    if tuple(w.shape) != (num_clients,):
        raise ValueError(f"weights must have shape ({num_clients},), got {tuple(w.shape)}")
    if not sync and w.device.type != "cpu":
        if w.device != torch.device(device):
            raise ValueError(f"weights are on {w.device}; expected {device} like the client updates")
        scaled = w / w.max()
        ok = torch.isfinite(w).all() & (w >= 0).all() & (w.max() > 0)
        return torch.where(ok, scaled / scaled.sum(), torch.full_like(w, float("nan")))
    host = w.cpu().numpy()  # checked and normalized with numpy: a few microseconds for M scalars, not ~30
    bad = ~np.isfinite(host) | (host < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"weights[{i}] is {float(host[i])!r}; weights must be finite and >= 0")
    top = host.max()
    if not top > 0:
        raise ValueError("weights are all zero; at least one participant needs a positive weight")
    scaled = host / top  # a sum of huge finite weights may overflow; the largest scaled weight is 1
    return torch.from_numpy(scaled / scaled.sum()).to(device)


def _weights_array(weights: Any) -> np.ndarray:
    """Weights given as numbers (a sequence or an array) as float64; strings, bools, complex numbers and integers too
    large for a float are refused, naming the first (``np.asarray(..., float64)`` would parse "3" and raise
    OverflowError on 10**400)."""
    try:
        raw = np.asarray(weights)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"weights must be numbers, got {weights!r}") from e
    if raw.dtype.kind in "iuf" and not (isinstance(weights, (list, tuple)) and
                                        any(isinstance(v, (bool, np.bool_)) for v in weights)):
        return raw.astype(np.float64)
    out = []
    items = list(weights) if isinstance(weights, (list, tuple)) and raw.ndim == 1 else raw.reshape(-1).tolist()
    for i, v in enumerate(items):
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"weights[{i}] is {v!r}; weights must be real numbers")
        out.append(_as_float(v, f"weights[{i}]"))
    return np.asarray(out, dtype=np.float64).reshape(raw.shape)


def check_prob(value: Any, name: str) -> float:
    """A coefficient in [0, 1) (momentum, betas)."""
    v = check_number(value, name)
    if not v < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {v!r}")
    return v


def out_buffer(out: Any, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A caller's preallocated output: a contiguous 1-D tensor (or numpy array) of the expected size and dtype."""
    if out is None:
        return None
    t = as_tensor(out)
    if t.ndim != 1 or t.numel() != numel or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D {dtype} buffer of {numel} elements on {device}; got "
                         f"shape {tuple(t.shape)}, {t.dtype} on {t.device}")
    return t


def expect_like(name: str, like: str, **pairs) -> None:
    """Raise naming the first property of ``name`` that differs from ``like``'s.

    Each keyword is a property -- ``numel``, ``shape``, ``dim`` (ValueError), ``dtype`` (TypeError) or ``device``
    (ValueError) -- given as a ``(got, expected)`` pair, checked in the order given.
    """
    for prop, (got, want) in pairs.items():
        if got == want:
            continue
        err = TypeError if prop == "dtype" else ValueError
        if prop == "device":
            raise err(f"{name} is on {got}; expected {want} like {like}")
        if prop == "numel":
            raise err(f"{name} has {got} elements; expected {want} like {like}")
        raise err(f"{name} has {prop} {got}; expected {want} like {like}")


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean a or b?)`` for the names in ``choices`` closest to a misspelled ``word``; ``""`` if none."""
    import difflib

    near = difflib.get_close_matches(word, list(choices), n=2)
    return f" (did you mean {' or '.join(near)}?)" if near else ""
