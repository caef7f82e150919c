"""The Triton kernels compile for Hopper (sm_90) GPUs, the lent machines' kind, with the launchers' real arguments,
checked ahead of time without a GPU (tests/triton_aot.py). The interpreter tests check the numbers; this checks
what only the GPU compiler sees (types, layouts, int64 pointer casts)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path



def test_kernels_compile_for_sm90():
    """One process per core, each compiling its share of the variants (about 5 minutes in one on a fresh cache)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_aot.py")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n = max(1, min(4, cores))
    procs = [subprocess.Popen([sys.executable, str(script), "90", f"--shard={i}/{n}"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(n)]
    try:
        outs = [p.communicate(timeout=1200) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr[-3000:]
        print(stdout)
    done = [line.split() for stdout, _ in outs for line in stdout.splitlines() if "kernel variants for sm_90 " in line]
    assert len(done) == n and sum(int(w[1]) for w in done) == int(done[0][3]), done  # every variant, once
