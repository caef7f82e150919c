"""The test vocabulary, shared by tests/ and bench/: dtypes, backends, ragged shapes, the tolerance table and a
verbose close-assert. Nobody redefines these elsewhere.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .backends import available

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# d: 1, odd, just under a power of two, and a large ragged size (not a multiple of any block).
SIZES = (1, 7, 1023, 278011)


def cpu_backends() -> list[str]:
    """Explicit backends that run on CPU tensors here (triton only under TRITON_INTERPRET=1)."""
    return available("cpu")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Tolerances of a backend's output against the float64 reference run on float64 copies of the same inputs.
# Inputs are generated in the tested dtype first, so both sides see identical (quantized) values; what remains
# is accumulation error. float32 accumulation of a mean over M <= 16 rows: a few ulps of max|x|; squared norms
# sum blocks of <= 65536 float32 products (relative error ~ sqrt(block) * 2^-24 ~ 1.5e-5 worst, ~1e-6 typical)
# before the float64 cross-block sum; eta is a ratio of two such sums. Parameters are compared after rounding
# to their own dtype: one ulp of that dtype (2^-8 bf16, 2^-11 fp16) relative.
TOLERANCES = {
    torch.float64: {"mean": (1e-12, 1e-12), "norm": (1e-12, 0.0), "params": (1e-12, 1e-12)},
    torch.float32: {"mean": (1e-5, 1e-6), "norm": (5e-5, 0.0), "params": (1e-5, 1e-5)},
    torch.float16: {"mean": (1e-5, 1e-6), "norm": (5e-5, 0.0), "params": (2e-3, 2e-3)},
    torch.bfloat16: {"mean": (1e-5, 1e-6), "norm": (5e-5, 0.0), "params": (1.6e-2, 1.6e-2)},
}


def tolerance(dtype: torch.dtype, what: str) -> tuple[float, float]:
    """(rtol, atol) for comparing ``what`` ("mean", "norm", "params") computed from ``dtype`` data."""
    return TOLERANCES[dtype][what]


def _as_f64(x) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.asarray(x))
    if not isinstance(x, torch.Tensor):  # python numbers: as float64, never through float32
        return torch.as_tensor(x, dtype=torch.float64)
    return x.detach().cpu().to(torch.float64)


def assert_close(actual, expected, *, rtol: float, atol: float, name: str = "value") -> None:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise, with NaN/Inf required to match.

    The error says how many elements differ, the first few indices with both values, and the NaN/Inf counts.
    """
    a, e = _as_f64(actual), _as_f64(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    a, e = a.reshape(-1), e.reshape(-1)
    both_nan = torch.isnan(a) & torch.isnan(e)
    same_inf = torch.isinf(a) & torch.isinf(e) & (a == e)
    ok = both_nan | same_inf | ((a - e).abs() <= atol + rtol * e.abs())
    if bool(ok.all()):
        return
    bad = (~ok).nonzero().flatten()
    shown = ", ".join(f"[{i}] {a[i].item()!r} vs {e[i].item()!r}" for i in bad[:5].tolist())
    err = ((a - e).abs() / e.abs().clamp_min(1e-300))[~ok]
    raise AssertionError(
        f"{name}: {bad.numel()} of {a.numel()} elements differ (rtol={rtol}, atol={atol}); first: {shown}; "
        f"max rel err {err.max().item():.3g}; NaN actual/expected {int(torch.isnan(a).sum())}/"
        f"{int(torch.isnan(e).sum())}, Inf {int(torch.isinf(a).sum())}/{int(torch.isinf(e).sum())}"
    )


def snapshot(obj):
    """Deep copies of every tensor/array in ``obj`` (nested lists/dicts), for bit-identity checks."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [snapshot(v) for v in obj]
    return obj


def assert_unchanged(before, after, name: str = "input") -> None:
    """Bit-identical (NaNs compared by bits), else an error naming the first changed element."""
    if isinstance(before, torch.Tensor):
        b, a = before.reshape(-1).view(torch.uint8), after.detach().reshape(-1).contiguous().view(torch.uint8)
        if not torch.equal(b, a):
            raise AssertionError(f"{name} was modified")
    elif isinstance(before, np.ndarray):
        if before.tobytes() != np.asarray(after).tobytes():
            raise AssertionError(f"{name} was modified")
    elif isinstance(before, dict):
        for k in before:
            assert_unchanged(before[k], after[k], f"{name}[{k!r}]")
    elif isinstance(before, list):
        for i, (b, a) in enumerate(zip(before, after)):
            assert_unchanged(b, a, f"{name}[{i}]")


def assert_round_close(actual, expected, dtype: torch.dtype, *, per_client: bool = True) -> None:
    """Two RoundResults agree at ``dtype``'s tolerances: mean, norms, eta and the update."""
    rt, at = tolerance(dtype, "mean")
    assert_close(actual.mean_flat, expected.mean_flat, rtol=rt, atol=at, name="mean")
    nrt, nat = tolerance(dtype, "norm")
    fields = ("sq_norms", "mean_sq_norm", "avg_sq_norm", "eta") if per_client else ("mean_sq_norm", "avg_sq_norm", "eta")
    for f in fields:
        assert_close(getattr(actual, f), getattr(expected, f), rtol=nrt, atol=nat, name=f)
    assert_close(actual.update_flat, expected.update_flat, rtol=rt + nrt, atol=at, name="update")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (multi-process tests and benchmarks bind only
    there)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_with_env(name: str, value: str) -> list[int]:
    """PIDs of this user's processes whose environment holds ``name=value`` (Linux /proc; elsewhere none): what a
    test started with a marker in the environment -- e.g. a private FLWR_HOME -- however it detached (a process that
    left its group with setsid is still found)."""
    from pathlib import Path

    marker = f"{name}={value}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in env and int(proc.name) != os.getpid():
            found.append(int(proc.name))
    return found


def stop_processes_with_env(name: str, value: str, *, wait_s: float = 10.0) -> list[int]:
    """SIGTERM, then SIGKILL after ``wait_s``, every process :func:`processes_with_env` finds; returns those that
    were still running when called."""
    import signal
    import time

    found = processes_with_env(name, value)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in processes_with_env(name, value):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.monotonic() + wait_s
        while processes_with_env(name, value) and time.monotonic() < end:
            time.sleep(0.1)
    return found


def import_without(package: str, module: str) -> str:
    """In a fresh interpreter: asserts ``import fastagg`` does not import ``package``, then imports ``module`` with
    ``package`` made unimportable; returns what that ImportError said (the test checks the install hint)."""
    import subprocess
    import sys

    code = (f"import sys, fastagg; assert {package!r} not in sys.modules, 'import fastagg imported {package}'\n"
            f"sys.modules[{package!r}] = None\n"
            f"try:\n    import {module}\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


class SweepCounter:
    """Wraps an accumulator's backend and counts the stats sweeps it runs (tests of what is folded together)."""

    def __init__(self, acc):
        self._inner, self.sweeps = acc._backend, 0
        acc._backend = self

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def round_stats(self, **kw):
        self.sweeps += 1
        return self._inner.round_stats(**kw)


def add_all_queued(acc, calls: list, *, limit_s: float = 30.0) -> list:
    """Run ``acc.add(**call)`` for every call in its own thread, all queued before any is folded (the accumulator's
    lock is held meanwhile, as a step in progress holds it); returns each call's result, or the exception it raised.
    Waits at most ``limit_s`` for the threads to queue and to end."""
    import threading
    import time

    out: list = [None] * len(calls)

    def run(i):
        try:
            out[i] = acc.add(**calls[i])
        except Exception as e:  # noqa: BLE001 (the test inspects it)
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    with acc._lock:
        for t in threads:
            t.start()
        deadline = time.monotonic() + limit_s
        while len(acc._pending) < len(calls) and time.monotonic() < deadline:
            time.sleep(0.001)
        queued = len(acc._pending)
    for t in threads:
        t.join(limit_s)
    assert queued == len(calls), f"only {queued} of {len(calls)} adds queued"
    assert not any(t.is_alive() for t in threads), "an add never returned"
    return out


def batchnorm_models(n: int, *, seed: int) -> tuple[dict, list]:
    """A float64 Linear + BatchNorm1d model's state_dict (the model a server sent) and ``n`` clients' full models
    trained away from it: weights moved by noise, running statistics and the batch counter advanced per client."""
    g = torch.Generator().manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
    base = {k: v.clone() for k, v in net.state_dict().items()}
    models = []
    for i in range(n):
        sd = {k: v.clone() for k, v in base.items()}
        sd["0.weight"] += 0.1 * torch.randn(sd["0.weight"].shape, generator=g, dtype=torch.float64)
        sd["1.running_mean"] += i
        sd["1.running_var"] += 0.5 * i
        sd["1.num_batches_tracked"] += 5
        models.append(sd)
    return base, models


def threads_env(threads: int) -> dict:
    """The environment of a subprocess whose compiled kernels use a team of ``threads`` on test-sized inputs."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "FASTAGG_CPU_BYTES_PER_THREAD": "65536"}


def outputs_with_threads(script: str, threads: int, path) -> Any:
    """``torch.load`` of what ``script`` saved to ``sys.argv[1]`` when run in a fresh interpreter with
    ``OMP_NUM_THREADS=threads`` (the thread count of the compiled kernels is fixed at their first call). The team
    unit is lowered to 64 KB (``FASTAGG_CPU_BYTES_PER_THREAD``) so that test-sized inputs form a team of that size:
    the default (16 MB a thread) would run them on one thread whatever ``threads`` says."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", script, str(path)], check=True, env=threads_env(threads))
    return torch.load(path)
