"""fastagg.distributed's step on R ranks against the bare collective that moves the same bytes, in one run.

    python bench/bench_distributed.py [--world 2] [--clients 16] [--dim 10000000]

R processes (gloo on 127.0.0.1), each holding clients/R of the round's client updates (float32). Per rank, medians
of 9 rounds after 2 warm-ups, the three timed in turn within each round, all ranks in step (a barrier before each
timed call):
- ``fastagg FedExP step, group=``: the whole distributed server step (stats pass on the rank's clients, the
  collectives, the apply pass);
- ``all_reduce of a d-vector``: the bare collective of the same bytes on the same group;
- ``local fused step``: the same FedExP step on the rank's clients alone, no group.
Target: step <= 1.2 x (all_reduce + local step). Prints one line per rank, then a parameter-sharded FedAdam
(each rank owns 1/R of the params and state and gets that slice of every client): its step time and its
optimizer state per rank against the unsharded optimizer's.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time


def _rank_main(world: int, clients: int, dim: int) -> None:
    import torch
    import torch.distributed as dist

    from fastagg import server

    rank = int(os.environ["RANK"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    m = clients // world
    x = torch.randn(m, dim, generator=torch.Generator().manual_seed(rank)) * 0.01
    w = torch.zeros(dim)
    vec = torch.zeros(dim)

    def interleaved(fns, reps=9, warm=2):
        """Median ms of each fn, timed in turn within every repetition (a load spike hits all of them alike)."""
        times = [[] for _ in fns]
        for k in range(reps + warm):
            for fn, seen in zip(fns, times):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                if k >= warm:
                    seen.append(time.perf_counter() - t0)
        return [statistics.median(t) * 1e3 for t in times]

    def timed(fn):
        return interleaved([fn])[0]

    opt = server.FedExP(w, eps=1e-3, group=dist.group.WORLD)
    local = server.FedExP(torch.zeros(dim), eps=1e-3)
    step, coll, alone = interleaved([lambda: opt.step(x), lambda: dist.all_reduce(vec), lambda: local.step(x)])
    line = (f"rank {rank}: {m} clients x {dim:.0e} fp32; distributed step {step:.1f} ms, all_reduce {coll:.1f} ms, "
            f"local step {alone:.1f} ms; step / (all_reduce + local) = {step / (coll + alone):.2f}")
    lines = [None] * world
    dist.all_gather_object(lines, line)
    if rank == 0:
        print("\n".join(lines), flush=True)
    # parameter-sharded FedAdam: this rank's slice of the params, the state and all clients' updates
    from fastagg import distributed

    full = torch.zeros(dim)
    mine = distributed.shard(full, dist.group.WORLD).clone()
    xs = torch.randn(clients, mine.numel(), generator=torch.Generator().manual_seed(rank)) * 0.01
    sharded = server.FedAdam(mine, group=dist.group.WORLD, sharded=True)
    whole = server.FedAdam(torch.zeros(dim)) if rank == 0 else None
    t_sharded = timed(lambda: sharded.step(xs))
    state = sum(v.numel() * v.element_size() for v in sharded.flat_state.values()) / 1e6
    if whole is not None:
        whole.step(torch.zeros(1, dim))
        full_state = sum(v.numel() * v.element_size() for v in whole.flat_state.values()) / 1e6
        print(f"sharded FedAdam, {clients} clients' slices per rank: step {t_sharded:.1f} ms on rank 0; optimizer "
              f"state {state:.1f} MB per rank against {full_state:.1f} MB unsharded ({full_state / state:.2f}x less)",
              flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--dim", type=int, default=10_000_000)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_main:
        _rank_main(a.world, a.clients, a.dim)
        return
    from fastagg.testing import free_port

    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(a.world),
           "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-main", "--world", str(a.world), "--clients",
                               str(a.clients), "--dim", str(a.dim)], env={**env, "RANK": str(r)})
             for r in range(a.world)]
    try:
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


if __name__ == "__main__":
    main()
