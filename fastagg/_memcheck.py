"""Peak-memory probe used by the tests and benchmarks: ``python -m fastagg._memcheck METHOD M D`` runs one
aggregation of M flat float32 clients of size D in a fresh process and prints the growth of the peak resident
set (ru_maxrss) caused by the call alone, in bytes."""
from __future__ import annotations

import resource
import sys

import torch


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main(method: str, m: int, d: int) -> int:
    import fastagg

    clients = [torch.randn(d) for _ in range(m)]
    fastagg.fedexp_step([torch.randn(8) for _ in range(2)], eps=1e-3)  # load everything once
    (torch.stack([torch.randn(8)] * 2)).sum()
    before = _peak()
    if method == "fastagg-list":
        fastagg.fedexp_step(clients, eps=1e-3)
    elif method == "torch-stack":
        x = torch.stack(clients)
        torch.linalg.vector_norm(x, dim=1)
        x.mean(0)
    else:
        raise SystemExit(f"unknown method {method!r}")
    return _peak() - before


if __name__ == "__main__":
    print(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
