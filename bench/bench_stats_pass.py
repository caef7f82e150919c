"""The C++ stats pass alone (csrc/round_stats.cpp through ``fastagg.backends.cpu.round_stats``) against a plain read.

Cases, each timed against ``torch.sum`` of a contiguous buffer of the same bytes (the clients' rows, and the base
when there is one):

- ``16 x 1e7 matrix``: a [16, 10^7] float32 matrix of deltas (one segment), the mean written;
- ``16 x 1e7 matrix, base``: the same rows as full client models (``base=`` a 10^7 vector, deltas formed in the pass);
- ``resnet18 1/w entries, base``: the entry rows of ResNet-18-shaped state_dicts (bench/bench_model_shapes.py's
  122 entries at full and 1/8 width, of which the 62 parameters are rows) as full client models, the way
  ``FedAvg.step(clients, base=model)`` hands them to the pass (no Python around it: the rows are built once);
- the streaming folds, ``mean_init`` given (a running sum) and the mean written to another buffer:
  ``resnet18 1/1 fold, M = 1`` / ``M = 5`` (the first 1 or 5 clients' entry rows with the base:
  ``Accumulator.add(state_dict, w, base=model)`` at M = 1, fastagg.nvflare's held results at M = 5) and
  ``1 x 1e8 flat fold`` (one 10^8 float32 row, no base).

GB/s counts the bytes read (rows, base, mean_init); ``moved`` adds the mean written (a plain store also reads each
line it fills: that traffic is in neither).

One thread (``torch.set_num_threads(1)``: the pass's team size comes from the same OpenMP setting); every call of a
case is timed interleaved with the others, one call each in turn, and the medians printed: ms, GB/s of the bytes
read, and the ratio to the read. ``--module NAME=PATH`` adds another build of the compiled module (a .so built with
``-DFASTAGG_MODULE=NAME``) timed in the same rounds, so two builds compare in one run on a shared machine.

    python bench/bench_stats_pass.py                         # every case, 1 thread
    python bench/bench_stats_pass.py --cases r18w8 --calls 400
    python bench/bench_stats_pass.py --module _old=/tmp/old/_old.cpython-311-x86_64-linux-gnu.so

Print only; nothing asserted.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_model_shapes import MODELS, state_dicts  # noqa: E402  (the same ResNet-18 state_dicts)

from fastagg.backends import cpu  # noqa: E402
from fastagg.rows import client_rows, with_base, param_rows  # noqa: E402


def matrix_rows(m: int, d: int, base: bool):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, d, generator=g)
    rows = client_rows(x, name="deltas")
    if base:
        p = torch.randn(d, generator=g)
        rows = with_base(rows, param_rows(p))
    return rows


def entry_rows(m: int, w: int):
    """ResNet-18's state_dicts at 1/w width (bench_model_shapes.state_dicts: M client models, global + noise) as
    ``FedAvg.step(clients, base=model)`` hands them to the pass: the parameter entries' rows (62 segments; the
    BatchNorm buffers never enter the rows), the global model as the base."""
    glob, clients = state_dicts(MODELS["resnet18"](w), m)
    p = param_rows(glob)
    return with_base(client_rows(clients, name="models", params=p), p)


def fold_rows(m: int, w: int):
    """The first ``m`` clients of ``entry_rows``' round at 1/w width (the same rows and base)."""
    glob, clients = state_dicts(MODELS["resnet18"](w), m)
    p = param_rows(glob)
    return with_base(client_rows(clients, name="models", params=p), p)


def flat_rows(d: int):
    return client_rows(torch.randn(1, d, generator=torch.Generator().manual_seed(0)), name="deltas")


def stats_call(mod, rows, init: bool = False):
    """One stats pass of ``rows`` through ``mod`` (the installed module: cpu.round_stats's own call); ``init``: a
    running sum given as mean_init (the mean written to another buffer, as Accumulator.add does)."""
    m, d = rows.num_clients, rows.numel
    weights = torch.full((m,), 1.0 / m, dtype=torch.float64)
    mean_init = torch.randn(d, generator=torch.Generator().manual_seed(1)) if init else None
    mean = torch.empty(d)
    sq = torch.empty(m, dtype=torch.float64)
    bad = torch.empty(m, dtype=torch.bool)
    msq = torch.empty((), dtype=torch.float64)
    if mod is None:
        return lambda: cpu.round_stats(rows=rows, weights=weights, mean_init=mean_init, aux=None, aux_coef=0.0,
                                       mean_out=mean, sq_norms_out=sq, nonfinite_out=bad, mean_sq_out=msq)
    base = None if rows.base is None else cpu._segments(rows.base)
    lens = list(rows.segments.lens)
    dl = cpu._dl
    return lambda: mod.round_stats(cpu._rows(rows), base, lens, dl(weights), dl(mean_init), None, 0.0, dl(mean), dl(sq),
                                   dl(bad), dl(msq), 0.0, 0, 0)


def load_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def interleaved(fns: dict, calls: int) -> dict:
    for f in fns.values():  # warm up (first touch, page faults)
        f()
        f()
    times = {k: [] for k in fns}
    for _ in range(calls):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


CASES = {  # key: (title, rows of m clients, calls, mean_init given)
    "mat": ("16 x 1e7 matrix", lambda m: matrix_rows(m, 10_000_000, False), 15, False),
    "matbase": ("16 x 1e7 matrix, base", lambda m: matrix_rows(m, 10_000_000, True), 15, False),
    "r18w1": ("resnet18 1/1 entries, base", lambda m: entry_rows(m, 1), 31, False),
    "r18w8": ("resnet18 1/8 entries, base", lambda m: entry_rows(m, 8), 301, False),
    "fold1": ("resnet18 1/1 fold, M = 1, base, mean_init", lambda m: fold_rows(1, 1), 61, True),
    "fold5": ("resnet18 1/1 fold, M = 5, base, mean_init", lambda m: fold_rows(5, 1), 41, True),
    "flat": ("1 x 1e8 flat fold, mean_init", lambda m: flat_rows(100_000_000), 21, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=0, help="interleaved calls per variant (default: per case)")
    ap.add_argument("--module", action="append", default=[], metavar="NAME=PATH",
                    help="another build of the compiled module to time beside the installed one")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    mods = {"fastagg": None}
    for spec in a.module:
        name, path = spec.split("=", 1)
        mods[name] = load_module(name, path)
    print(f"torch {torch.__version__}, module {cpu.MODULE_NAME}, {os.cpu_count()} cores, {a.threads} thread(s), "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {a.clients} clients")
    for key in a.cases.split(","):
        title, make, calls, init = CASES[key]
        rows = make(a.clients)
        nbytes = (rows.num_clients + (rows.base is not None) + init) * rows.numel * 4
        flat = torch.randn(nbytes // 4)
        fns = {"read (torch.sum)": lambda: flat.sum()}
        for name, mod in mods.items():
            fns[f"round_stats [{name}]"] = stats_call(mod, rows, init)
        med = interleaved(fns, a.calls or calls)
        read = med["read (torch.sum)"]
        print(f"\n{title}: {len(rows.segments)} segments, {rows.numel / 1e6:.3f}M columns, {nbytes / 1e6:.1f} MB read; "
              f"medians of {a.calls or calls} interleaved calls")
        moved = nbytes + rows.numel * 4
        for k, v in med.items():
            print(f"  {k:28s} {v * 1e3:9.3f} ms  {nbytes / v / 1e9:6.1f} GB/s  {v / read:5.2f}x read"
                  + ("" if k.startswith("read") else f"  ({moved / v / 1e9:.1f} GB/s moved)"))


if __name__ == "__main__":
    main()
