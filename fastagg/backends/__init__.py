"""Backend choice, made in one place.

Policy for ``backend="auto"``: CUDA tensors go to Triton, CPU tensors to the compiled C++ module, tensors on any
other device to the reference backend. An explicit choice never falls back: if it cannot run on the given
device, the error says why and lists what can. ``"triton"`` takes CPU tensors only under
``TRITON_INTERPRET=1`` (the interpreter the test suite uses).
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from . import reference
from .reference import column_blocks, gaussian, philox4x32_10, select_sorted

BACKENDS = ("auto", "reference", "cpu", "triton")

__all__ = ["BACKENDS", "available", "resolve", "sparse_scan", "scale_scan", "cpu_build", "column_blocks",
           "gaussian", "philox4x32_10", "select_sorted"]


def _cpu() -> ModuleType:
    """The CPU backend, loaded on first use like Triton's: it loads the compiled module and reads FASTAGG_CPU_ISA
    and FASTAGG_CPU_BYTES_PER_THREAD then, not when fastagg is imported."""
    return importlib.import_module(__name__ + ".cpu")


def _triton_module() -> ModuleType:
    try:
        return importlib.import_module("fastagg.backends.triton")
    except ImportError as e:
        raise RuntimeError(f"backend='triton' needs the triton package, which failed to import: {e}") from e


def available(device: torch.device | str) -> list[str]:
    """The explicit backends that can run on ``device`` here."""
    device = torch.device(device)
    out = ["reference"]
    if device.type == "cpu":
        if _cpu().IMPORT_ERROR is None:
            out.append("cpu")
        if os.environ.get("TRITON_INTERPRET", "0") == "1" and importlib.util.find_spec("triton") is not None:
            out.append("triton")
    elif device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        out.append("triton")
    return out


def resolve(backend: str, device: torch.device) -> ModuleType:
    """The backend module that runs a call on ``device``. This runs on every call of every step, so answers are
    remembered per backend name and device type, except Triton on CPU tensors (it depends on TRITON_INTERPRET)."""
    key = (backend, device.type)
    module = _RESOLVED.get(key)
    if module is None:
        module = _resolve(backend, device)
        if device.type != "cpu" or module.__name__ != _TRITON_MODULE:
            _RESOLVED[key] = module
    return module


_RESOLVED: dict[tuple[str, str], ModuleType] = {}
_TRITON_MODULE = __name__ + ".triton"


def _resolve(backend: str, device: torch.device) -> ModuleType:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = {"cuda": "triton", "cpu": "cpu"}.get(device.type, "reference")
    if backend == "reference":
        return reference
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend='cpu' runs on CPU tensors; these are on {device}. "
                             f"Available here: {available(device)}")
        cpu = _cpu()
        cpu.compiled()
        return cpu
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("backend='triton' runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1, set "
                         f"before fastagg is imported); these are on cpu. Available here: {available(device)}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"backend='triton' runs on CUDA tensors; these are on {device}. "
                         f"Available here: {available(device)}")
    return _triton_module()


# -- primitives that one backend alone provides ----------------------------------------------------------------------
# The rule families call these, never a backend module: a backend added or swapped touches this file, not them.
# column_blocks, gaussian, philox4x32_10 and select_sorted (imported above) are the reference backend's torch
# definitions, run on any device: the robust rules' order statistics, the adaptive clipping's count noise and the
# stochastic rounding's uniforms.
def sparse_scan(indices: list, values: list) -> list | None:
    """Per sparse update ``(first entry whose index does not exceed the one before or -1, every value finite)`` for
    contiguous CPU ``indices`` (one integer dtype for all) and ``values``, by the one backend that provides it: the
    compiled CPU module's parallel pass (csrc/bindings.cpp ``sparse_scan``). None when that module does not load:
    the caller then uses torch ops."""
    cpu = _cpu()
    if cpu.IMPORT_ERROR is not None:
        return None
    return cpu.sparse_scan(indices=indices, values=values)


def scale_scan(scales: list) -> list | None:
    """Per blockwise update ``(every scale finite, first block whose scale is <= 0 or -1)`` for contiguous CPU
    float32 ``scales``, by the compiled CPU module's parallel pass (csrc/bindings.cpp ``scale_scan``); None when that
    module does not load: the caller then uses torch ops."""
    cpu = _cpu()
    if cpu.IMPORT_ERROR is not None:
        return None
    return cpu.scale_scan(scales=scales)


def cpu_build() -> dict:
    """What ``fastagg.env_report`` says of the compiled CPU module: ``error`` (why it does not load, None when it
    does), ``isa_env`` / ``threads_env`` (the variables choosing the build and a thread's bytes) and, when it loads,
    ``file``, ``openmp``, ``threads`` and ``bytes_per_thread``."""
    cpu = _cpu()
    info = {"error": cpu.IMPORT_ERROR, "isa_env": cpu.ISA_ENV, "threads_env": cpu.THREADS_ENV}
    if cpu.IMPORT_ERROR is None:
        c = cpu.compiled()
        info.update(file=c.__file__, openmp=c.openmp, threads=c.num_threads(), bytes_per_thread=c.bytes_per_thread())
    return info
