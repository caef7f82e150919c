"""What each rank of tests/test_distributed.py runs, and the same computations in one process for the reference
(``group=None``, rank 0 of 1 holding every client)."""
from __future__ import annotations

import os

import torch

import fastagg
from fastagg import server

TOTAL, DIM, ROUNDS = 8, 1003, 3
# clients of each rank (uneven on purpose): world size -> split points
BOUNDS = {1: [0, 8], 2: [0, 3, 8], 3: [0, 5, 5, 8], 4: [0, 1, 3, 6, 8]}  # 3: rank 1 has no client (a zero share)
OPTIMIZERS = {
    "FedAvg": dict(lr=0.7), "FedAvgM": dict(momentum=0.9), "FedExP": dict(eps=1e-3), "FedExPM": dict(eps=1e-3),
    "FedACG": dict(), "FedAdam": dict(), "FedYogi": dict(), "FedAdagrad": dict(), "FedAMS": dict(),
    "Scaffold": dict(num_clients=TOTAL), "ScaffoldExP": dict(num_clients=TOTAL, eps=1e-3),
}


def data(rnd: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + rnd)
    deltas = (torch.randn(TOTAL, DIM, generator=g, dtype=torch.float64) * 0.1).to(dtype)
    controls = (torch.randn(TOTAL, DIM, generator=g, dtype=torch.float64) * 0.1).to(dtype)
    weights = torch.rand(TOTAL, generator=g, dtype=torch.float64) * 50 + 1
    return deltas, controls, weights


def params0(dtype=torch.float32):
    return torch.randn(DIM, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)


def share(rank: int, world: int) -> slice:
    b = BOUNDS[world]
    return slice(b[rank], b[rank + 1])


def optimizers(rank: int, world: int, group, dtype=torch.float32) -> dict:
    """Every server optimizer over ROUNDS rounds on this rank's clients: params and eta after each round."""
    out = {}
    sl = share(rank, world)
    for name, hyper in OPTIMIZERS.items():
        w = params0(dtype)
        opt = getattr(server, name)(w, group=group, **hyper)
        seen = []
        for rnd in range(ROUNDS):
            deltas, controls, weights = data(rnd, dtype)
            if name.startswith("Scaffold"):
                st = opt.step(deltas[sl], controls[sl], weights=weights[sl])
            else:
                st = opt.step(deltas[sl], weights=weights[sl])
            seen.append((w.clone(), float(st.eta), st.sq_norms.clone(), int(st.num_clients)))
        out[name] = seen
    return out


def optimizers64(rank, world, group):
    return optimizers(rank, world, group, torch.float64)


def functional(rank: int, world: int, group) -> dict:
    sl = share(rank, world)
    deltas, _, weights = data(0)
    w = params0()
    res = fastagg.fedexp_step(deltas[sl], eps=1e-3, weights=weights[sl], params=w, group=group)
    w2 = params0()
    avg = fastagg.fedavg_step(deltas[sl], lr=1.0, params=w2, group=group)  # uniform weights over all clients
    return {"fedexp": (w, float(res.eta), res.eval_params.clone(), res.mean.clone()), "fedavg": (w2, float(avg.eta))}


def nonfinite(rank: int, world: int, group) -> dict:
    """Client 5 (on the last rank) is NaN: every rank raises (mode raise) or skips (mode skip) together."""
    sl = share(rank, world)
    deltas, _, weights = data(0)
    deltas[5, 17] = float("nan")
    out = {}
    w = params0()
    try:
        fastagg.server.FedAdam(w, group=group).step(deltas[sl], weights=weights[sl])
        out["raise"] = "no error"
    except ValueError as e:
        out["raise"] = str(e)
    out["raise_params_unchanged"] = bool(torch.equal(w, params0()))
    w = params0()
    opt = fastagg.server.FedExP(w, eps=1e-3, on_nonfinite="skip", group=group)
    st = opt.step(deltas[sl], weights=weights[sl])
    out["skip_finite"] = bool(st.finite)
    out["skip_params_unchanged"] = bool(torch.equal(w, params0()))
    out["skip_bad"] = st.nonfinite.nonzero().flatten().tolist()
    return out


def mismatch(rank: int, world: int, group) -> dict:
    """The last rank's updates have one element more: every rank refuses before any data moves."""
    dim = DIM + (1 if rank == world - 1 else 0)
    w = torch.zeros(dim)
    try:
        fastagg.fedexp_step(torch.ones(2, dim), eps=1e-3, params=w, group=group)
        return {"message": "no error"}
    except ValueError as e:
        return {"message": str(e), "unchanged": bool(torch.equal(w, torch.zeros(dim)))}


def buffer_mismatch(rank: int, world: int, group) -> dict:
    """Accumulators of the same parameter count, but the last rank's model has one more buffer element: every rank
    refuses (the buffers' all_reduce would otherwise mix entries), params unchanged."""
    extra = 1 if rank == world - 1 else 0
    like = {"w": torch.zeros(6, dtype=torch.float64), "bn.running_mean": torch.zeros(3 + extra, dtype=torch.float64)}
    acc = fastagg.Accumulator(like=like)
    acc.add({k: v + 1 for k, v in like.items()}, 1.0)
    state = {k: v.clone() for k, v in like.items()}
    try:
        server.FedAvg(state, group=group).step(acc)
        return {"message": "no error"}
    except ValueError as e:
        return {"message": str(e), "unchanged": all(torch.equal(state[k], like[k]) for k in like)}


def _step_beside_a_lost_rank(rank: int, world: int, group) -> dict:
    """A FedAvg step on a rank whose group lost a peer: the error it raised, and whether params stayed as they were."""
    w = params0()
    try:
        fastagg.server.FedAvg(w, group=group).step(data(0)[0][share(rank, world)])
        return {"message": "no error"}
    except RuntimeError as e:
        return {"message": str(e), "unchanged": bool(torch.equal(w, params0()))}


def dead_rank(rank: int, world: int, group) -> dict:
    """The last rank dies before the step: the others get a clear error instead of hanging, params unchanged."""
    if rank == world - 1:
        os._exit(3)
    return _step_beside_a_lost_rank(rank, world, group)


def sharded(rank: int, world: int, group, dtype=torch.float64) -> dict:
    """ZeRO-1 style: this rank owns a slice of the params and state and gets that slice of every client's update;
    the full params are gathered after each round. group=None: one process, the whole model."""
    from fastagg import distributed

    out = {}
    for name, hyper in OPTIMIZERS.items():
        full = params0(dtype)
        mine = distributed.shard(full, group).clone() if group is not None else full
        opt = getattr(server, name)(mine, group=group, sharded=group is not None, **hyper)
        seen = []
        for rnd in range(ROUNDS):
            deltas, controls, weights = data(rnd, dtype)
            cut = (lambda t: torch.stack([distributed.shard(row, group) for row in t])) if group is not None \
                else (lambda t: t)
            if name.startswith("Scaffold"):
                st = opt.step(cut(deltas), cut(controls), weights=weights)
            else:
                st = opt.step(cut(deltas), weights=weights)
            whole = distributed.gather(mine, group) if group is not None else mine.clone()
            seen.append((whole, float(st.eta), st.sq_norms.clone(), int(st.num_clients)))
        state = {k: v.numel() for k, v in opt.flat_state.items() if v.dim() > 0}
        out[name] = seen
        out[name + " state"] = state
    return out


def sharded32(rank, world, group):
    return sharded(rank, world, group, torch.float32)


def hung_rank(rank: int, world: int, group) -> dict:
    """The last rank hangs (sleeps past the group's timeout): the others get a clear error, params unchanged."""
    import time

    if rank == world - 1:
        time.sleep(60)
        return {"message": "slept"}
    return _step_beside_a_lost_rank(rank, world, group)


def accumulated(rank: int, world: int, group) -> dict:
    """Each rank folds its clients into an Accumulator; FedExP and FedAdam step on every rank's accumulators."""
    out = {}
    sl = share(rank, world)
    for name in ("FedExP", "FedAdam", "FedAvgM"):
        w = params0(torch.float64)
        opt = getattr(server, name)(w, group=group, **OPTIMIZERS[name])
        seen = []
        for rnd in range(ROUNDS):
            deltas, _, weights = data(rnd, torch.float64)
            acc = fastagg.Accumulator(like=w)
            for x, n in zip(deltas[sl], weights[sl]):
                acc.add(x, float(n))
            st = opt.step(acc)
            seen.append((w.clone(), float(st.eta), st.sq_norms.clone()))
        out[name] = seen
    # the accumulator's own functional step
    w = params0(torch.float64)
    deltas, _, weights = data(0, torch.float64)
    acc = fastagg.Accumulator(like=w)
    for x, n in zip(deltas[sl], weights[sl]):
        acc.add(x, float(n))
    res = acc.fedexp_step(eps=1e-3, params=w, group=group)
    out["acc.fedexp_step"] = [(w.clone(), float(res.eta), torch.as_tensor(res.sq_norms).clone())]
    return out


def _bn_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)).double()


def batchnorm_models(rank: int, world: int, group, stream: bool = False) -> dict:
    """Clients send full state_dicts of a model with BatchNorm (running statistics and a counter): the server's
    buffers become the average over every rank's clients, its params FedAdam-stepped. ``stream``: each rank folds
    its clients into an Accumulator first."""
    net = _bn_model()
    sent = {k: v.clone() for k, v in net.state_dict().items()}
    g = torch.Generator().manual_seed(11)
    models = []
    for i in range(TOTAL):
        sd = {}
        for k, v in sent.items():
            if v.is_floating_point():
                sd[k] = v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype)
            else:
                sd[k] = v + (i + 1)
        models.append(sd)
    weights = torch.arange(1, TOTAL + 1, dtype=torch.float64)
    opt = server.FedAdam(net.state_dict(), group=group)
    sl = share(rank, world)
    if stream:
        acc = fastagg.Accumulator(like=sent)
        for sd, n in zip(models[sl], weights[sl]):
            acc.add(sd, float(n), base=sent)
        opt.step(acc)
    else:
        opt.step(models[sl], weights=weights[sl], base=sent)
    return {k: v.clone() for k, v in net.state_dict().items()}


def batchnorm_accumulated(rank: int, world: int, group) -> dict:
    return batchnorm_models(rank, world, group, stream=True)


def sharded_batchnorm(rank: int, world: int, group) -> dict:
    """Sharded by layer: each rank owns some of a BatchNorm model's state_dict entries (its running statistics and
    counter included) and gets those entries of every client's model. FedExP (eta needs norms over every rank's
    entries) and FedAdam; group=None: one process with the whole state_dict."""
    net = _bn_model()
    sent = {k: v.clone() for k, v in net.state_dict().items()}
    g = torch.Generator().manual_seed(12)
    models = [{k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v + i + 1
               for k, v in sent.items()} for i in range(TOTAL)]
    weights = torch.arange(1, TOTAL + 1, dtype=torch.float64)
    keys = list(sent)
    mine = keys if group is None else [k for k in keys if (0 if k.startswith(("0.", "1.")) else 1)
                                       % world == rank]
    out = {}
    for name in ("FedExP", "FedAdam"):
        state = {k: sent[k].clone() for k in mine}
        opt = getattr(server, name)(state, group=group, sharded=group is not None, **OPTIMIZERS[name])
        st = opt.step([{k: m[k] for k in mine} for m in models], weights=weights, base={k: sent[k] for k in mine})
        out[name] = ({k: v.clone() for k, v in state.items()}, float(st.eta))
    return out


def many_clients(rank: int, world: int, group) -> dict:
    """More clients on a rank than the header carries weights for (70 on rank 0, 3 on rank 1)."""
    g = torch.Generator().manual_seed(21)
    deltas = torch.randn(73, 301, generator=g, dtype=torch.float64)
    weights = torch.rand(73, generator=g, dtype=torch.float64) + 0.5
    sl = slice(0, 73) if group is None else (slice(0, 70) if rank == 0 else slice(70, 73))
    w = torch.zeros(301, dtype=torch.float64)
    res = fastagg.fedexp_step(deltas[sl], eps=1e-3, weights=weights[sl], params=w, group=group)
    return {"w": w, "eta": float(res.eta)}


CHECKPOINTED = ("FedAdam", "FedExP", "Scaffold")


def sharded_checkpoint(rank: int, world: int, group) -> dict:
    """Two sharded rounds in float64; each rank's optimizer state_dict and param slice, for resharding."""
    from fastagg import distributed

    out = {}
    for name in CHECKPOINTED:
        mine = distributed.shard(params0(torch.float64), group).clone()
        opt = getattr(server, name)(mine, group=group, sharded=True, **OPTIMIZERS[name])
        for rnd in range(2):
            deltas, controls, weights = data(rnd, torch.float64)
            cut = lambda t: torch.stack([distributed.shard(row, group) for row in t])  # noqa: E731
            if name.startswith("Scaffold"):
                opt.step(cut(deltas), cut(controls), weights=weights)
            else:
                opt.step(cut(deltas), weights=weights)
        out[name] = (opt.state_dict(), mine.clone())
    return out


def _attempt(fn) -> dict:
    """fn()'s outcome on this rank: the error it raised (type and message), or None."""
    try:
        fn()
        return {"raised": None}
    except Exception as e:  # noqa: BLE001 - the test inspects what each rank raised
        return {"raised": type(e).__name__, "message": str(e)}


def local_failure(rank: int, world: int, group) -> dict:
    """The last rank's input is bad (one element too many per client, which its own params do not have): it raises
    its own error, every other rank a ValueError naming it, at once (not after the group's timeout); params stay;
    the next step works on every rank."""
    sl = share(rank, world)
    deltas, _, weights = data(0)
    w = params0()
    opt = server.FedAdam(w, group=group)
    bad = torch.ones(sl.stop - sl.start, DIM + 1) if rank == world - 1 else deltas[sl]
    out = {"first": _attempt(lambda: opt.step(bad, weights=weights[sl]))}
    out["unchanged"] = bool(torch.equal(w, params0()))
    out["second"] = _attempt(lambda: opt.step(deltas[sl], weights=weights[sl]))
    out["w"] = w.clone()
    return out


def _compressed(rnd: int) -> list:
    """Round rnd's clients compressed three ways (int8 block 64, top-30% sparse, fp8 block 128)."""
    from fastagg.compress import quantize_fp8, quantize_int8, sparsify_topk

    deltas, _, _ = data(rnd)
    kinds = (lambda x: quantize_int8(x, 64), lambda x: sparsify_topk(x, 0.3), lambda x: quantize_fp8(x, 128))
    return [kinds[j % 3](deltas[j]) for j in range(TOTAL)]


COMPRESSED_OPTIMIZERS = ("FedAvg", "FedAvgM", "FedExP", "FedExPM", "FedACG", "FedAdam")


def compressed(rank: int, world: int, group) -> dict:
    """Compressed clients with group=: every rank folds its own where they lie, one all_reduce; the server
    optimizers over ROUNDS rounds and the functional FedExP round, against one process holding every client. With
    ``mixed``: rank 0 sends its clients as float32 (the dequantized updates), the others compressed; ``"list"``: rank
    0's first client float32 beside its compressed ones in one list. A rank with no client passes an empty list."""
    from fastagg.compress import dequantize

    sl = share(rank, world)
    out = {}
    for mixed in (False, True, "list"):
        for name in COMPRESSED_OPTIMIZERS:
            w = params0()
            opt = getattr(server, name)(w, group=group, **OPTIMIZERS[name])
            seen = []
            for rnd in range(ROUNDS):
                _, _, weights = data(rnd)
                mine = _compressed(rnd)[sl]
                if mixed is True and rank == 0:
                    mine = torch.stack([dequantize(u).float() for u in mine]) if mine else mine
                elif mixed == "list" and rank == 0 and mine:
                    mine = [dequantize(mine[0]).float()] + mine[1:]
                st = opt.step(mine, weights=weights[sl])
                seen.append((w.clone(), float(st.eta), st.sq_norms.clone(), int(st.num_clients)))
            out[name, mixed] = seen
        w = params0()
        _, _, weights = data(0)
        mine = _compressed(0)[sl]
        if mixed == "list" and rank == 0 and mine:
            mine = [dequantize(mine[0]).float()] + mine[1:]
        res = fastagg.fedexp_step(mine, eps=1e-3, weights=weights[sl], params=w, group=group)
        out["functional", mixed] = (w.clone(), float(res.eta))
    return out


def compressed_failures(rank: int, world: int, group) -> dict:
    """The last rank's first client holds an invalid int8 code (-128): it raises naming that client, every other
    rank learns at once (no wait for the group's timeout); params stay; the next step works. Then a NaN scale on
    the last rank: raised on every rank by default, left out with on_nonfinite="skip" (the others' clients step)."""
    from fastagg.compress import Int8Blockwise

    sl = share(rank, world)
    _, _, weights = data(0)
    clients = _compressed(0)
    mine = clients[sl]
    w = params0()
    opt = server.FedAdam(w, group=group)
    out = {}
    if rank == world - 1:
        u = mine[0]
        codes = u.codes.clone()
        codes[5] = -128
        bad = [Int8Blockwise(codes, u.scales, u.block)] + mine[1:]
    else:
        bad = mine
    out["first"] = _attempt(lambda: opt.step(bad, weights=weights[sl]))
    out["unchanged"] = bool(torch.equal(w, params0()))
    out["second"] = _attempt(lambda: opt.step(mine, weights=weights[sl]))
    nan = list(mine)
    if rank == world - 1:
        u = nan[0]
        scales = u.scales.clone()
        scales[0] = float("nan")
        nan[0] = Int8Blockwise(u.codes, scales, u.block)
    before = w.clone()
    out["nan_raise"] = _attempt(lambda: opt.step(nan, weights=weights[sl]))
    out["nan_raise_unchanged"] = bool(torch.equal(w, before))
    w2 = params0()
    skip = server.FedAvg(w2, group=group, on_nonfinite="skip")
    st = skip.step(nan, weights=weights[sl])
    out["skip"] = (w2.clone(), int(st.num_clients))
    from fastagg import distributed

    part = distributed.shard(params0(), group).clone()  # sharded: every rank holds a slice of every client
    out["sharded"] = _attempt(lambda: server.FedAvg(part, group=group, sharded=True).step(
        [u for u in _compressed(0)], weights=weights))
    return out


def failure_in_pass(rank: int, world: int, group) -> dict:
    """The last rank fails inside its own stats pass, after the header exchange: every rank learns it before the
    d-vector collective (none waits for the group's timeout); the next step works."""
    from fastagg import distributed

    sl = share(rank, world)
    deltas, _, weights = data(0)
    w = params0()
    opt = server.FedAvg(w, group=group)
    real = distributed.run_stats
    if rank == world - 1:
        def broken(*a, **k):
            distributed.run_stats = real
            raise RuntimeError("out of memory (simulated)")
        distributed.run_stats = broken
    out = {"first": _attempt(lambda: opt.step(deltas[sl], weights=weights[sl]))}
    out["unchanged"] = bool(torch.equal(w, params0()))
    out["second"] = _attempt(lambda: opt.step(deltas[sl], weights=weights[sl]))
    return out


def out_of_step(rank: int, world: int, group) -> dict:
    """The last rank calls distributed.gather while the others step: every rank raises that the group is out of
    step, nothing combined, params unchanged."""
    from fastagg import distributed

    sl = share(rank, world)
    deltas, _, weights = data(0)
    w = params0()
    if rank == world - 1:
        res = _attempt(lambda: distributed.gather(torch.ones(5), group))
    else:
        res = _attempt(lambda: server.FedAvg(w, group=group).step(deltas[sl], weights=weights[sl]))
    return {**res, "unchanged": bool(torch.equal(w, params0()))}


def _state_dict_of(rank: int, world: int, reverse: bool) -> dict:
    base = {"a.weight": torch.arange(6.0).view(2, 3) / 10, "b.bias": torch.arange(4.0) / 7, "c.w": torch.ones(5)}
    return dict(reversed(list(base.items()))) if reverse else base


def keys_in_another_order(rank: int, world: int, group) -> dict:
    """The last rank's model and clients list the same state_dict keys in another order: entries are matched by
    key (summed with their own keys, not crosswise), and every rank ends with the one process's params."""
    reverse = group is not None and rank == world - 1
    w = _state_dict_of(rank, world, reverse)
    opt = server.FedAvgM(w, momentum=0.5, group=group)
    deltas, _, weights = data(0)
    sl = share(rank, world) if group is not None else slice(0, TOTAL)
    for rnd in range(2):
        clients = []
        for i in range(sl.start, sl.stop):
            row = deltas[i] + rnd
            sd = {"a.weight": row[:6].view(2, 3), "b.bias": row[6:10], "c.w": row[10:15]}
            clients.append(dict(reversed(list(sd.items()))) if reverse else sd)
        opt.step(clients, weights=weights[sl])
    return {k: v.clone() for k, v in w.items()}


def sharded_permuted_weights(rank: int, world: int, group) -> dict:
    """Sharded ranks whose weights are the same numbers in another order (a permutation the old sum-based check
    passed: [1, 2, 2, 1] and [2, 1, 1, 2] have equal sums and equal sum_i i w_i): refused on every rank."""
    from fastagg import distributed

    w = distributed.shard(params0(torch.float64), group).clone()
    before = w.clone()
    weights = [1.0, 2.0, 2.0, 1.0] if rank == 0 else [2.0, 1.0, 1.0, 2.0]
    deltas = torch.ones(4, w.numel(), dtype=torch.float64)
    res = _attempt(lambda: server.FedAvg(w, group=group, sharded=True).step(deltas, weights=weights))
    return {**res, "unchanged": bool(torch.equal(w, before))}


def gather_dtypes(rank: int, world: int, group) -> dict:
    """Slices of different dtypes: gather refuses on every rank (gloo would otherwise abort one process)."""
    from fastagg import distributed

    t = torch.ones(5, dtype=torch.float32 if rank == 0 else torch.float64)
    return _attempt(lambda: distributed.gather(t, group))


CASES = {"buffer_mismatch": buffer_mismatch, "batchnorm_accumulated": batchnorm_accumulated, "sharded_batchnorm": sharded_batchnorm, "many_clients": many_clients, "batchnorm_models": batchnorm_models, "accumulated": accumulated, "sharded": sharded, "sharded_checkpoint": sharded_checkpoint, "hung_rank": hung_rank, "sharded32": sharded32, "optimizers": optimizers, "optimizers64": optimizers64, "functional": functional, "nonfinite": nonfinite,
         "mismatch": mismatch, "dead_rank": dead_rank, "local_failure": local_failure,
         "compressed": compressed, "compressed_failures": compressed_failures,
         "failure_in_pass": failure_in_pass, "out_of_step": out_of_step, "keys_in_another_order": keys_in_another_order,
         "sharded_permuted_weights": sharded_permuted_weights, "gather_dtypes": gather_dtypes}
