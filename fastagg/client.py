"""Batched client local steps: M clients' parameters as rows of one ``[M, d]`` buffer, their mini-batch gradients
``[M, d]`` and losses ``[M]``, updated by one fused call (Triton on GPU, C++ on CPU, plain torch as the oracle).

Order inside one step (docs/ALGORITHMS.md section 8)::

    dir = grad + prox * (x - anchor) + (c - c_i)        # loss-side corrections: FedProx/FedACG, SCAFFOLD
    dir = dir * min(1, clip_norm / ||dir||)             # a global per-client norm, complete before any update
    dir = dir + weight_decay * x                        # after clipping, as torch optimizers do
    then momentum (heavy-ball / Nesterov as torch SGD, or FedMaSS), then the step

A client whose direction or loss is not finite, whose loss is at or below ``l_star`` (SPS rules), or whose squared
direction norm is at or below ``min_sq_norm`` (SPS rules) takes no step this time: nothing of it is written, its
returned step is 0, and its SPS state is not advanced. Other clients are unaffected. NaN never reaches ``params``.

``params`` is the only argument written (and the population ``state``); per-client scalars may be Python numbers
or ``[M]`` tensors; per-client vectors of the population (momentum buffers, SCAFFOLD ``c_i``, MaSS iterates) live
in :class:`ClientState` as ``[N, d]`` and are read and written in place through ``client_ids``. Nothing is synced
to the host. Math is float32 (float64 for float64 params); the returned steps are float64.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch

from ._aliasing import check_writes
from ._checks import canonical_device, check_int, check_number, check_prob, expect_like
from .backends import resolve
from .compress.spec import parse
from .passes import run_stats
from .flat import tied_aliases
from .rows import attach_base, client_rows
from .rowtable import RowTable, PerRow

__all__ = ["ClientState", "sps_step", "decsps_step", "local_step", "mass_step", "clip_updates", "update_norms",
           "compress_updates", "CAPS"]

CAPS = ("constant", "smooth", "smooth_prev_step")
MIN_SQ_NORM = 1e-30


class ClientState:
    """Population-level per-client state on one device, created lazily by the steps that need it.

    Vectors ``[N, d]`` (float32; float64 with ``dtype=torch.float64``): ``"momentum"`` (heavy-ball / Nesterov
    buffers), ``"control"`` (SCAFFOLD's c_i), ``"mass"`` (FedMaSS's / paper 004 Nesterov's second sequence),
    ``"residual"`` (error feedback: what compression left out of the client's last updates).
    Scalars ``[N]`` float64: FedDecSPS's previous step and step count, the smoothed SPS caps.
    A client that sits out a round keeps all of it.
    """

    def __init__(self, num_clients: int, dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        num_clients, dim = check_int(num_clients, "num_clients", minimum=1), check_int(dim, "dim", minimum=1)
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"ClientState dtype must be torch.float32 or torch.float64, got {dtype}")
        self.num_clients, self.dim, self.dtype = num_clients, dim, dtype
        self.device = canonical_device(device)  # "cuda" is cuda:0 here, as the params' tensors say
        self.vectors: dict[str, torch.Tensor] = {}
        self.scalars: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (f"ClientState(num_clients={self.num_clients}, dim={self.dim}, dtype={self.dtype}, "
                f"device={self.device}, vectors={sorted(self.vectors)}, scalars={sorted(self.scalars)})")

    def vector(self, name: str) -> torch.Tensor:
        if name not in self.vectors:
            self.vectors[name] = torch.zeros(self.num_clients, self.dim, dtype=self.dtype, device=self.device)
        return self.vectors[name]

    def scalar(self, name: str, init: float = 0.0) -> torch.Tensor:
        if name not in self.scalars:
            self.scalars[name] = torch.full((self.num_clients,), float(init), dtype=torch.float64, device=self.device)
        return self.scalars[name]

    def state_dict(self) -> dict:
        return {"num_clients": self.num_clients, "dim": self.dim,
                "vectors": {k: v.clone() for k, v in self.vectors.items()},
                "scalars": {k: v.clone() for k, v in self.scalars.items()}}

    VECTORS = ("momentum", "control", "mass", "residual")
    # per-client scalars; NaN marks "not seen yet" in the ones that start from gamma_b
    SCALARS = {"decsps_steps": False, "decsps_gamma": True, "sps_cap": True, "sps_prev_gamma": True,
               "mass_started": False}

    def load_state_dict(self, sd: dict) -> None:
        """Restore a :meth:`state_dict`. Every entry is checked by name (one this state keeps), shape, dtype and
        value (finite; NaN only where it means "not seen yet"; counters whole and >= 0) before anything changes;
        a refusal raises naming the entry and changes nothing."""
        if not isinstance(sd, dict) or not {"num_clients", "dim", "vectors", "scalars"} <= set(sd):
            raise ValueError("not a ClientState state_dict (needs num_clients, dim, vectors, scalars)")
        if (sd["num_clients"], sd["dim"]) != (self.num_clients, self.dim):
            raise ValueError(f"state is for {sd['num_clients']} clients x {sd['dim']}; this one is "
                             f"{self.num_clients} x {self.dim}")
        vectors, scalars = {}, {}
        for k, v in sd["vectors"].items():
            if k not in self.VECTORS:
                raise ValueError(f"state vector {k!r} is not one ClientState keeps ({', '.join(self.VECTORS)})")
            _check_state_tensor(v, f"state vector {k!r}", (self.num_clients, self.dim), self.dtype, nan_ok=False)
            vectors[k] = v.detach().to(self.device, copy=True)
        for k, v in sd["scalars"].items():
            if k not in self.SCALARS:
                raise ValueError(f"state scalar {k!r} is not one ClientState keeps ({', '.join(self.SCALARS)})")
            _check_state_tensor(v, f"state scalar {k!r}", (self.num_clients,), torch.float64, nan_ok=self.SCALARS[k])
            if k in ("decsps_steps", "mass_started") and bool(((v < 0) | (v != v.round())).any()):
                raise ValueError(f"state scalar {k!r} must hold whole numbers >= 0")
            scalars[k] = v.detach().to(self.device, copy=True)
        self.vectors, self.scalars = vectors, scalars


def _check_state_tensor(t: Any, what: str, shape: tuple, dtype: torch.dtype, *, nan_ok: bool) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} is a {type(t).__name__}; expected a tensor")
    if tuple(t.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(t.shape)}; expected {shape}")
    if t.dtype != dtype:
        raise TypeError(f"{what} has dtype {t.dtype}; expected {dtype}")
    bad = torch.isinf(t) if nan_ok else ~torch.isfinite(t)
    if bool(bad.any()):
        raise ValueError(f"{what} holds {'Inf' if nan_ok else 'NaN or Inf'}")


# ---------------------------------------------------------------------------------------------------------------
# validation


def _matrix(t: Any, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.ndim != 2:
        raise ValueError(f"{name} must be a 2-D [num_clients, num_params] tensor, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.device.type == "meta":
        raise ValueError(f"{name} is on meta: the meta device holds no data")
    if not t.is_floating_point():
        raise TypeError(f"{name} has dtype {t.dtype}; expected a floating dtype")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along the parameter dimension, got strides {t.stride()}")
    return t


def _per_client(value: Any, name: str, m: int, device, *, minimum: float | None = 0.0, positive: bool = False,
                allow_nonfinite: bool = False) -> PerRow:
    """A Python number (returned as a float: the kernels take it for every row) or an [M] tensor (returned as
    contiguous float64 [M] on ``device``).

    Numbers and CPU tensors are validated here. CUDA tensors are not read back (no host sync): an invalid value
    there (negative, zero where a positive is needed, NaN) makes that client take no step, as the kernels
    treat any step that is not finite and positive."""
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            value = value.reshape(1).expand(m)
        if tuple(value.shape) != (m,):
            raise ValueError(f"{name} must be a number or have shape ({m},), got {tuple(value.shape)}")
        if value.device != torch.device(device):
            raise ValueError(f"{name} is on {value.device}; expected {device} like params")
        t = value.detach().to(torch.float64)
        if minimum is not None and not allow_nonfinite and t.device.type == "cpu":
            bad = ~torch.isfinite(t) | ((t <= minimum) if positive else (t < minimum))
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                op = ">" if positive else ">="
                raise ValueError(f"{name}[{i}] is {t[i].item()!r}; expected a finite number {op} {minimum:g}")
        return t.contiguous()
    return check_number(value, name, minimum=minimum if minimum is not None else -math.inf, allow_equal=not positive)


def _client_ids(ids: Any, m: int, state: ClientState | None, device) -> torch.Tensor:
    """Validated on the host (range, duplicates): pass them as a CPU tensor, a list or a numpy array and no device
    read is needed; they are copied to ``device`` for the kernels."""
    if isinstance(ids, (list, tuple)) or type(ids).__module__ == "numpy":
        integral = (getattr(getattr(ids, "dtype", None), "kind", "") in "iu" if not isinstance(ids, (list, tuple))
                    else all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids))
        if not integral:
            raise TypeError("client_ids must be integers (a list, a numpy array or a 1-D integer tensor)")
        try:
            ids = torch.as_tensor(ids, dtype=torch.int64) if len(ids) else torch.zeros(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise TypeError("client_ids must be integers (a list, a numpy array or a 1-D integer tensor)") from None
    if not isinstance(ids, torch.Tensor) or ids.ndim != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise TypeError("client_ids must be a 1-D integer tensor (or a list or numpy array of integers)")
    if ids.numel() != m:
        raise ValueError(f"client_ids has {ids.numel()} entries; params has {m} rows")
    if ids.device.type != "cpu" and ids.device != torch.device(device):
        raise ValueError(f"client_ids is on {ids.device}; expected the CPU or {device} like params")
    if state is not None:
        host = ids.cpu()
        if m and (int(host.min()) < 0 or int(host.max()) >= state.num_clients):
            raise ValueError(f"client_ids must be in [0, {state.num_clients}); got values in "
                             f"[{int(host.min())}, {int(host.max())}]")
        if torch.unique(host).numel() != m:
            raise ValueError("client_ids has duplicates; each client may appear once per batch")
    return ids.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()  # the kernels index by row


class _Batch:
    """Validated arguments of one batched local step, as the backend primitive takes them."""

    def __init__(self, params, grads, *, state, client_ids, prox, control, clip_norm, weight_decay, backend):
        x = _matrix(params, "params")
        g = _matrix(grads, "grads")
        expect_like("grads", "params", shape=(tuple(g.shape), tuple(x.shape)), dtype=(g.dtype, x.dtype),
                    device=(g.device, x.device))
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise TypeError(f"params has dtype {x.dtype}; expected float32, bfloat16, float16 or float64")
        self.m, self.d, self.device = x.shape[0], x.shape[1], x.device
        self.cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        if state is not None:
            if not isinstance(state, ClientState):
                raise TypeError(f"state must be a fastagg.client.ClientState, got {type(state).__name__}")
            expect_like("state", "params' columns and compute dtype", dim=(state.dim, self.d),
                        device=(state.device, self.device), dtype=(state.dtype, self.cdt))
        self.state = state
        self.ids = None if client_ids is None else _client_ids(client_ids, self.m, state, self.device)
        self.x, self.g = RowTable.rows(x), RowTable.rows(g)
        self.anchor, self.prox = None, 0.0
        if prox is not None:
            anchor, mu = _pair(prox, "prox", "(anchor, mu)")
            self.prox = check_number(mu, "prox mu")
            self.anchor = self._vector_rows(anchor, "prox anchor", x.dtype)
        self.control = self.ci = None
        if control is not None:
            c, ci = _pair(control, "control", "(c, c_i)")
            if not isinstance(c, torch.Tensor) or tuple(c.shape) != (self.d,):
                raise ValueError(f"control c must be a [{self.d}] tensor")
            if c.dtype != self.cdt or c.device != self.device or not c.is_contiguous():
                raise TypeError(f"control c must be a contiguous {self.cdt} tensor on {self.device}")
            self.control = c
            self.ci = self._population_rows(ci, "control c_i")
        self.clip_norm = 0.0 if clip_norm is None else check_number(clip_norm, "clip_norm", allow_equal=False)
        self.weight_decay = check_number(weight_decay, "weight_decay")
        self.backend = resolve(backend, self.device)
        self.reads = [("grads", g)] + [(n, t.base) for n, t in (("prox anchor", self.anchor), ("control c_i", self.ci))
                                       if t is not None]
        if self.control is not None:
            self.reads.append(("control c", self.control))
        self.writes = [("params", x)]
        if state is not None:
            self.writes += [(f"client state {k!r}", v) for k, v in state.vectors.items()]
        check_writes(self.writes, self.reads)

    def _vector_rows(self, t, name, dtype) -> RowTable:
        """A [d] vector shared by every row, or [M, d] rows aligned with params."""
        if not isinstance(t, torch.Tensor) or t.device != self.device or t.dtype != dtype:
            raise TypeError(f"{name} must be a {dtype} tensor on {self.device}")
        if tuple(t.shape) == (self.d,) and t.is_contiguous():
            return RowTable.broadcast(t, self.m)
        return RowTable.rows(_matrix(t, name)) if tuple(t.shape) == (self.m, self.d) else _bad_shape(
            name, t, f"({self.d},) or ({self.m}, {self.d})")

    def _population_rows(self, t, name) -> RowTable:
        """[N, d] indexed by client_ids when client_ids is given, else [M, d] aligned with params."""
        if not isinstance(t, torch.Tensor) or t.device != self.device or t.dtype != self.cdt:
            raise TypeError(f"{name} must be a {self.cdt} tensor on {self.device}")
        _matrix(t, name)
        if self.ids is None:
            if tuple(t.shape) != (self.m, self.d):
                _bad_shape(name, t, f"({self.m}, {self.d}) (or [N, d] with client_ids)")
            return RowTable.rows(t)
        if t.shape[1] != self.d or (self.state is not None and t.shape[0] != self.state.num_clients):
            rows = f"{self.state.num_clients}" if self.state is not None else "N"
            whose = " (the state's clients)" if self.state is not None else ""
            _bad_shape(name, t, f"({rows}, {self.d}): a row per client{whose}, indexed by client_ids")
        lo, hi = int(self.ids.min()), int(self.ids.max())
        if lo < 0 or hi >= t.shape[0]:
            raise ValueError(f"client_ids must be in [0, {t.shape[0]}) ({name} has {t.shape[0]} rows); got values in "
                             f"[{lo}, {hi}]")
        return RowTable.select(t, self.ids)

    def state_rows(self, name: str) -> RowTable:
        if self.state is None or self.ids is None:
            raise TypeError(f"this step keeps per-client {name} vectors: pass state= and client_ids=")
        return RowTable.select(self.state.vector(name), self.ids)

    def run(self, *, rule: str, lr=None, loss=None, l_star=None, sps_c=None, cap=None, mode: str = "none",
            buf: RowTable | None = None, momentum: float = 0.0, eta2: float = 0.0, first=None,
            min_sq_norm: float = MIN_SQ_NORM) -> torch.Tensor:
        """Runs the backend's local step; returns the step each row took (float64 [M], 0: none)."""
        min_sq_norm = check_number(min_sq_norm, "min_sq_norm")  # NaN would make every client skip, silently
        step = torch.empty(self.m, dtype=torch.float64, device=self.device)
        unused = 0.0  # per-row scalars the rule does not read
        self.backend.local_step(
            x=self.x, g=self.g, anchor=self.anchor, control=self.control, ci=self.ci, buf=buf,
            lr=unused if lr is None else lr, loss=unused if loss is None else loss,
            l_star=unused if l_star is None else l_star, sps_c=unused if sps_c is None else sps_c,
            cap=unused if cap is None else cap, first=first, prox=self.prox,
            clip_norm=self.clip_norm, weight_decay=self.weight_decay, momentum=momentum, eta2=eta2,
            tiny=min_sq_norm, rule=rule, mode=mode, step_out=step)
        return step


def _pair(value, name, form):
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name} must be a pair {form}")
    return value


def _bad_shape(name, t, want):
    raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want}")


def _losses(losses, b: _Batch) -> torch.Tensor:
    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (b.m,):
        raise ValueError(f"losses must be a tensor of shape ({b.m},), one mini-batch mean loss per client")
    if losses.device != b.device:
        raise ValueError(f"losses is on {losses.device}; expected {b.device} like params")
    # non-finite losses are a per-client safeguard, not an error; the kernels read a contiguous float64 [M]
    if losses.dtype == torch.float64 and losses.is_contiguous() and not losses.requires_grad:
        return losses
    return losses.detach().to(torch.float64).contiguous()


def _sps_inputs(params, grads, losses, c, c_name, gamma_b, l_star, **batch):
    """The validated batch, losses and per-client (c, gamma_b, l_star) of the SPS family."""
    b = _Batch(params, grads, weight_decay=0.0, **batch)
    return (b, _losses(losses, b), _per_client(c, c_name, b.m, b.device, positive=True),
            _per_client(gamma_b, "gamma_b", b.m, b.device, positive=True),
            _per_client(l_star, "l_star", b.m, b.device, minimum=None))


# ---------------------------------------------------------------------------------------------------------------
# public steps


def sps_step(*, params, grads, losses, c: Any = 0.5, gamma_b: Any = 1.0, l_star: Any = 0.0, cap: str = "constant",
             smooth_factor: Any = None, state: ClientState | None = None, client_ids=None, prox=None,
             control=None, clip_norm=None, min_sq_norm: float = MIN_SQ_NORM, backend: str = "auto") -> torch.Tensor:
    """FedSPS local step for every row (Mukherjee, Loizou, Stich; paper 003)::

        gamma_i = min( (f_i - l_star) / (c ||dir_i||^2), cap_i );   x_i <- x_i - gamma_i dir_i

    ``dir`` is the gradient after the optional prox/control corrections and clipping; ``f`` the same mini-batch's
    mean loss. Caps: ``"constant"`` (``gamma_b``, default); ``"smooth"`` (paper 003's non-convex runs:
    ``cap_t = smooth_factor * cap_{t-1}``, ``cap_0 = gamma_b``); ``"smooth_prev_step"`` (the SPS reference code:
    ``cap_t = smooth_factor * gamma_{t-1}``, ``gamma_{-1} = gamma_b``). The smoothed caps keep per-client state
    (``state``, ``client_ids``) that advances only when the client steps; ``smooth_factor = 2^(|B| / m_i)``.

    With c = 0.5 and l_star = 0 on ``f(x) = (a/2) x^2``, one step lands exactly on 0 (when 1/a <= gamma_b).

    Returns the step each client took, float64 ``[M]`` (0: the client took none; see the module docstring).
    """
    b, f, cc, gb, ls = _sps_inputs(params, grads, losses, c, "c", gamma_b, l_star, state=state, client_ids=client_ids,
                                   prox=prox, control=control, clip_norm=clip_norm, backend=backend)
    if cap not in CAPS:
        raise ValueError(f"cap must be one of {CAPS}, got {cap!r}")
    if cap == "constant":
        gamma = b.run(rule="sps", loss=f, l_star=ls, sps_c=cc, cap=gb, min_sq_norm=min_sq_norm)
        return gamma
    if smooth_factor is None:
        raise TypeError(f"cap={cap!r} needs smooth_factor (2^(batch size / client samples))")
    factor = _per_client(smooth_factor, "smooth_factor", b.m, b.device, positive=True)
    if b.state is None or b.ids is None:
        raise TypeError(f"cap={cap!r} keeps per-client state: pass state= and client_ids=")
    key = "sps_cap" if cap == "smooth" else "sps_prev_gamma"
    # gamma_b seeds a client's state the first time it is seen (a NaN marks "never seen")
    mem = b.state.scalar(key, float("nan"))
    stored = mem[b.ids]
    prev = torch.where(torch.isnan(stored), gb, stored)
    cap_now = prev if cap == "smooth" else factor * prev
    gamma = b.run(rule="sps", loss=f, l_star=ls, sps_c=cc, cap=cap_now, min_sq_norm=min_sq_norm)
    took = gamma > 0
    new = factor * prev if cap == "smooth" else gamma
    mem[b.ids] = torch.where(took, new, stored)  # a client that took no step keeps its state exactly
    return gamma


def decsps_step(*, params, grads, losses, state: ClientState, client_ids, c0: Any = 0.5, gamma_b: Any = 1.0,
                l_star: Any = 0.0, prox=None, control=None, clip_norm=None, min_sq_norm: float = MIN_SQ_NORM,
                backend: str = "auto") -> torch.Tensor:
    """FedDecSPS local step (paper 003), per client over its own local iterations t::

        c_t = c0 sqrt(t + 1);   gamma_t = (1 / c_t) min( (f - l_star) / ||dir||^2, c_{t-1} gamma_{t-1} )
        with c_{-1} = c0, gamma_{-1} = gamma_b;   x <- x - gamma_t dir

    Steps are non-increasing per client. ``t`` and ``gamma_{t-1}`` live in ``state`` and advance only when the
    client steps (a zero step is never stored; a client that sits out keeps them). Returns the steps, float64 [M].
    """
    if state is None or client_ids is None:
        raise TypeError("decsps_step keeps per-client state: pass state= and client_ids=")
    b, f, c0v, gb, ls = _sps_inputs(params, grads, losses, c0, "c0", gamma_b, l_star, state=state,
                                     client_ids=client_ids, prox=prox, control=control, clip_norm=clip_norm,
                                     backend=backend)
    steps, prev_mem = state.scalar("decsps_steps"), state.scalar("decsps_gamma", float("nan"))
    t = steps[b.ids]
    stored = prev_mem[b.ids]
    prev = torch.where(torch.isnan(stored), gb, stored)
    c_t = c0v * torch.sqrt(t + 1)
    c_prev = torch.where(t == 0, c0v, c0v * torch.sqrt(t))
    gamma = b.run(rule="sps", loss=f, l_star=ls, sps_c=c_t, cap=c_prev * prev / c_t, min_sq_norm=min_sq_norm)
    took = gamma > 0
    prev_mem[b.ids] = torch.where(took, gamma, stored)  # a zero step is never stored
    steps[b.ids] = t + took.to(torch.float64)
    return gamma


def local_step(*, params, grads, lr: Any, prox=None, control=None, clip_norm=None, weight_decay: float = 0.0,
               momentum: float = 0.0, nesterov: bool = False, state: ClientState | None = None, client_ids=None,
               backend: str = "auto") -> torch.Tensor:
    """One plain local step for every row, in docs/ALGORITHMS.md section 8's order::

        d = clip(grad + prox (x - anchor) + (c - c_i)) + weight_decay x
        b = momentum b + d;  x <- x - lr (d + momentum b if nesterov else b)      (torch SGD, dampening 0)
        (momentum 0: x <- x - lr d)

    ``prox=(anchor, mu)``: FedProx's ``mu (x - w_global)`` or FedACG's ``beta (x - b)`` (anchor [d] or [M, d]);
    ``control=(c, c_i)``: SCAFFOLD's ``c - c_i`` (c [d]; c_i [N, d] indexed by ``client_ids``, or [M, d]).
    Momentum buffers are per client in ``state`` (``client_ids`` select them). Returns the steps (lr, or 0 for a
    client skipped as non-finite), float64 [M].
    """
    b = _Batch(params, grads, state=state, client_ids=client_ids, prox=prox, control=control, clip_norm=clip_norm,
               weight_decay=weight_decay, backend=backend)
    lr_t = _per_client(lr, "lr", b.m, b.device)
    mu = check_prob(momentum, "momentum")
    if nesterov and mu == 0:
        raise ValueError("nesterov=True needs momentum > 0")
    if mu == 0:
        step = b.run(rule="fixed", lr=lr_t)
        return step
    step = b.run(rule="fixed", lr=lr_t, mode="nesterov" if nesterov else "heavy", buf=b.state_rows("momentum"),
                    momentum=mu)
    return step


def mass_step(*, params, grads, state: ClientState, client_ids, eta1: Any, gam: float, eta2: float = 0.0,
              prox=None, control=None, clip_norm=None, backend: str = "auto") -> torch.Tensor:
    """FedMaSS local step (paper 004); with ``eta2 = 0`` it is paper 004's Nesterov FedAvg::

        w_{t+1} = u_t - eta1 g(u_t);   u_{t+1} = w_{t+1} + gam (w_{t+1} - w_t) + eta2 g(u_t)

    ``params`` holds u (the iterate that is averaged at synchronization); w_t is per-client state (neither
    averaged nor reset), initialized to a client's params the first time it steps. For constant eta1, gam and
    eta2 = 0 this equals torch's Nesterov SGD with lr = eta1, momentum = gam (tested).
    Returns the steps (eta1, or 0 for a skipped client), float64 [M].
    """
    if state is None or client_ids is None:
        raise TypeError("mass_step keeps per-client iterates: pass state= and client_ids=")
    b = _Batch(params, grads, state=state, client_ids=client_ids, prox=prox, control=control, clip_norm=clip_norm,
               weight_decay=0.0, backend=backend)
    lr_t = _per_client(eta1, "eta1", b.m, b.device)
    gam_v = check_number(gam, "gam")
    eta2_v = check_number(eta2, "eta2", minimum=-math.inf)
    started = state.scalar("mass_started")  # 1 once a client has stepped: its w_t is live
    first = 1.0 - started[b.ids]
    step = b.run(rule="fixed", lr=lr_t, mode="mass", buf=b.state_rows("mass"), momentum=gam_v, eta2=eta2_v,
                    first=first)
    started[b.ids] = torch.where(step > 0, torch.ones_like(first), 1.0 - first)
    return step


def clip_updates(models: Any, base: Any, max_norm: Any, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Clip each client's update to norm ``max_norm`` in place, as client-side differential privacy does before a
    reply leaves the client (Flower's ``fixedclipping_mod``; Andrew et al.'s clients)::

        u_i = x_i - base;   s_i = min(1, C / ||u_i||);   x_i <- base + s_i u_i

    ``models``: the clients' models after local training (an ``[M, d]`` matrix, or any client form
    :func:`fastagg.fedexp_step` takes, written in place); ``base``: what they started from (one model, [d] or the
    clients' form of one model). One read of the models for the norms (the stats pass, updates formed against
    ``base`` inside it), then ``torch.lerp(base, x_i, s_i)`` written over the clipped clients only (a client whose
    update is within ``C`` is not touched). A client whose update holds NaN or Inf is not touched either; its
    norm is reported NaN. Returns ``(norms, clipped)``: float64 [M] norms before clipping, bool [M] which clients
    were scaled (Flower's ``norm_bit``)."""
    c = check_number(max_norm, "max_norm", allow_equal=False)
    _check_in_place(models)
    norms, rows = _update_norms(models, base, backend)
    clipped = ~torch.isnan(norms) & (norms > c)
    for i in clipped.nonzero().flatten().tolist():
        s = c / float(norms[i])
        for seg, b in zip(rows.rows, rows.base):
            x = seg[i]
            torch.lerp(b.to(x.dtype), x, s, out=x)
    return norms, clipped


def update_norms(models: Any, base: Any, *, backend: str = "auto") -> torch.Tensor:
    """``||x_i - base||`` of each client (float64 [M]; NaN where the update holds NaN or Inf), in one read: the
    stats pass with the updates formed against ``base`` inside it. The models are not written."""
    return _update_norms(models, base, backend)[0]


def _update_norms(models: Any, base: Any, backend: str):
    models, base = _untied(models, base)
    rows = client_rows(models, name="models")
    rows, _ = attach_base(rows, base)
    m = rows.num_clients
    weights = torch.full((m,), 1.0 / m, dtype=torch.float64, device=rows.device)
    _, sq, bad, _ = run_stats(rows, weights, resolve(backend, rows.device))
    return torch.where(bad, torch.full_like(sq, float("nan")), sq.sqrt()), rows


def _untied(models: Any, base: Any) -> tuple:
    """State_dict clients whose tied entries (one tensor under two names in each client's model: GPT-2's lm_head
    is its embedding) are one entry: the alias names dropped from every client and from ``base``, so the update's
    norm counts the tensor once and clipping scales it once (it was scaled by s twice, s^2 in all). A name tied in
    some clients only stays an entry of all."""
    if not isinstance(models, (list, tuple)) or not models or not all(isinstance(m, dict) for m in models):
        return models, base
    tied = set.intersection(*({a for a, _ in tied_aliases(m)} for m in models))
    if not tied:
        return models, base
    models = [{k: v for k, v in m.items() if k not in tied} for m in models]
    if isinstance(base, dict):
        base = {k: v for k, v in base.items() if k not in tied}
    return models, base


def _check_in_place(models: Any) -> None:
    """Refuse client models that clipping could not write back to: a read-only numpy array, a tensor that is not
    contiguous (its flat row would be a copy), anything that is not a tensor or array."""
    def visit(x, where):
        if isinstance(x, torch.Tensor):
            if not x.is_contiguous():
                raise ValueError(f"{where} is not contiguous: clip_updates writes the clients' models in place")
        elif isinstance(x, np.ndarray):
            if not x.flags.writeable or not x.flags.c_contiguous:
                raise ValueError(f"{where} is read-only or not C-contiguous: clip_updates writes it in place")
        elif isinstance(x, dict):
            for k, v in x.items():
                visit(v, f"{where}[{k!r}]")
        elif isinstance(x, (list, tuple)):
            for k, v in enumerate(x):
                visit(v, f"{where}[{k}]")
        else:
            raise TypeError(f"{where} is a {type(x).__name__}; clip_updates takes tensors or numpy arrays")

    visit(models, "models")


def compress_updates(updates: torch.Tensor, compression: Any, *, state: ClientState | None = None,
                     client_ids: Any = None, seed: int = 0, round: int = 0):
    """The ``[M, d]`` updates of M clients compressed for sending (:mod:`fastagg.compress`; ``compression`` a
    :class:`fastagg.compress.spec.Compression` or its spec, e.g. ``"int8:block=256"``), in one vectorized pass;
    stochastic rounding and random-k keyed by ``(seed, round, client id)``. With error feedback (the sparse kinds'
    default) each client sends ``C(x_i + e_i)`` and keeps ``e_i <- x_i + e_i - C(x_i + e_i)`` (dequantized) in
    ``state.vector("residual")`` at its ``client_ids`` row (Karimireddy et al. 2019, EF-SGD). Returns a list of
    compressed updates (or, for fp32 / bf16 / fp16, an ``[M, d]`` tensor); the residuals are written only once every
    row was compressed."""
    comp = parse(compression)
    x = _matrix(updates, "updates")
    m = x.shape[0]
    ids = None if client_ids is None else _client_ids(client_ids, m, state, x.device)
    keys = list(range(m)) if ids is None else [int(i) for i in ids.tolist()]
    if not comp.error_feedback:
        return comp.compress_rows(x, seed=seed, round=round, clients=keys)
    if state is None or ids is None:
        raise ValueError(f"{comp} keeps error-feedback residuals: pass state= (a ClientState) and client_ids= "
                         "(or ef=0 in the spec)")
    expect_like("updates", "the ClientState", numel=(x.shape[1], state.dim), device=(x.device, state.device))
    residual = state.vector("residual")
    target = x.to(state.dtype) + residual[ids]
    sent = comp.compress_rows(target, seed=seed, round=round, clients=keys)
    kept = target - torch.stack([u.dequantize(torch.float64) for u in sent]).to(state.dtype)
    residual[ids] = kept
    return sent
