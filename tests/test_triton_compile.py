"""The Triton kernels compile for Hopper (sm_90) GPUs, the lent machines' kind, with the launchers' real arguments,
checked ahead of time without a GPU (tests/triton_aot.py). The interpreter tests check the numbers; this checks
what only the GPU compiler sees (types, layouts, int64 pointer casts)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path



def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_aot.py")
    out = subprocess.run([sys.executable, str(script), "90"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout)
    assert "kernel variants for sm_90 " in out.stdout
