"""Peak-memory probe used by the tests and benchmarks: ``python -m fastagg._memcheck METHOD M D`` runs one
aggregation of M flat float32 clients of size D in a fresh process and prints how far the resident set peaked
above its level just before the call, in bytes. The kernel's peak counter (VmHWM) is reset right before the call
through /proc/self/clear_refs, so an earlier, higher peak (imports, set-up) cannot hide the call's own."""
from __future__ import annotations

import sys

import torch

import fastagg


def status(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Reset the kernel's peak resident set (VmHWM) to the current resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


class PeakAbove:
    """``with PeakAbove() as p: work()`` -> ``p.bytes``: how far the resident set peaked above its level at entry
    (glibc may keep freed blocks mapped: run work in a fresh process, or set MALLOC_MMAP_THRESHOLD_)."""

    def __enter__(self):
        reset_peak()
        self.before = status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.bytes = status("VmHWM") - self.before


def main(method: str, m: int, d: int) -> int:
    clients = [torch.randn(d) for _ in range(m)]
    fastagg.fedexp_step([torch.randn(8) for _ in range(2)], eps=1e-3)  # load everything once
    (torch.stack([torch.randn(8)] * 2)).sum()
    reset_peak()
    before = status("VmRSS")
    if method == "fastagg-list":
        fastagg.fedexp_step(clients, eps=1e-3)
    elif method == "torch-stack":
        x = torch.stack(clients)
        torch.linalg.vector_norm(x, dim=1)
        x.mean(0)
    else:
        raise SystemExit(f"unknown method {method!r}")
    return status("VmHWM") - before


if __name__ == "__main__":
    print(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
