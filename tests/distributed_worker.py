"""One rank of tests/test_distributed.py: ``python distributed_worker.py CASE OUT_DIR`` with RANK, WORLD_SIZE,
MASTER_ADDR (127.0.0.1) and MASTER_PORT set. Joins a gloo group, runs CASE on this rank's share of the clients and
writes what it saw to OUT_DIR/rank{RANK}.pt (or the error it raised)."""
from __future__ import annotations

import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distributed_cases import CASES  # noqa: E402


def main() -> None:
    case, out = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    timeout = float(os.environ.get("GROUP_TIMEOUT_S", "20"))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
    try:
        result = CASES[case](rank, world, dist.group.WORLD)
    except Exception as e:  # noqa: BLE001 - the test inspects what each rank raised
        result = {"error": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    if case not in ("dead_rank", "hung_rank"):
        dist.destroy_process_group()
    else:
        os._exit(0)  # a group with a missing peer must not wait in its teardown


if __name__ == "__main__":
    main()
