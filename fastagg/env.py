"""``fastagg.env_report()``: what is installed, which backend each device gets, and why."""
from __future__ import annotations

import importlib.util
import os
import platform

import torch

from . import _facts
from .backends import available, cpu_build
from ._version import __version__


def openmp_runtime() -> str:
    """The OpenMP runtime libraries mapped into this process (the compiled kernels use the one torch loaded first:
    one libgomp.so.1 per process), or why it cannot be told."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line or "libomp" in line}
    except OSError:
        return "unknown (no /proc/self/maps)"
    return ", ".join(sorted(paths)) or "none mapped"


def env_report() -> str:
    """A few lines saying which backends are active here and why (paste it into bug reports)."""
    cpu = cpu_build()
    lines = [f"fastagg {__version__}  python {platform.python_version()}  torch {torch.__version__}"]
    if cpu["error"] is None:
        lines.append(f"cpu backend: compiled module {cpu['file']} (OpenMP {cpu['openmp']}, "
                     f"{cpu['threads']} threads; torch reports CPU capability "
                     f"{torch.backends.cpu.get_cpu_capability()}; {cpu['isa_env']}=default forces the portable _C)")
        unit = cpu["bytes_per_thread"]
        lines.append(f"cpu threads: a pass of n bytes gets max(1, min(n // {unit}, {cpu['threads']})) threads, "
                     f"so one below {2 * unit} ({cpu['threads_env']} sets the {unit}); "
                     f"OpenMP runtime {openmp_runtime()}, "
                     f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')} "
                     f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')} (unset: its threads spin)")
    else:
        lines.append(f"cpu backend: NOT available: {cpu['error']}")
    lines.append("per-entry checks: " + ("in C (fastagg._tensor_facts, built for this torch)" if _facts.available()
                                         else f"in Python: {_facts.WHY_NOT}"))
    if importlib.util.find_spec("triton") is not None:
        import triton

        interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
        lines.append(f"triton {triton.__version__}" + (" (TRITON_INTERPRET=1: kernels run on the CPU)" if interp else ""))
    else:
        lines.append("triton: not installed (GPU backend unavailable)")
    cuda = torch.cuda.is_available()
    lines.append(f"CUDA: {torch.cuda.get_device_name(0) if cuda else 'not available'}")
    lines.append("backend='auto': cpu tensors -> cpu" + (", cuda tensors -> triton" if cuda else ""))
    lines.append(f"explicit backends for cpu tensors: {available('cpu')}")
    return "\n".join(lines)
