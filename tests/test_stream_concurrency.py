"""Accumulator.add from several threads at once: adds that queue while another is folded are folded together in
one sweep (flat combining), and each call still answers for its own client only: folded, refused with its own
error, never lost or counted twice.

The grouping is made deterministic by holding the accumulator's lock while the adds queue up (a step in progress
does the same): when it is released, the one thread that folds takes them all."""
from __future__ import annotations

import contextlib
import signal
import threading
import time

import pytest
import torch

import fastagg
from fastagg.testing import SweepCounter, add_all_queued, assert_close, batchnorm_models, cpu_backends

QUEUE_LIMIT_S = 30.0  # bounds every wait for a thread to queue or end (each needs only to start and queue)


def _randn(d, seed, dtype=torch.float32):
    return torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float32, 1e-6, 1e-6), (torch.float64, 1e-13, 1e-15)])
def test_adds_that_queue_are_folded_in_one_sweep(backend, dtype, rtol, atol):
    d = 10_007
    acc = fastagg.Accumulator(like=torch.zeros(d, dtype=dtype), backend=backend)
    counter = SweepCounter(acc)
    xs = [_randn(d, i, dtype) for i in range(4)]
    ws = [1.0, 2.5, 0.0, 4.0]
    out = add_all_queued(acc, [dict(delta=x, weight=w, client_id=f"c{i}") for i, (x, w) in enumerate(zip(xs, ws))])
    assert out == [True] * 4
    assert counter.sweeps == 1  # the four clients went through the kernel together
    assert sorted(acc.client_ids) == ["c0", "c1", "c2", "c3"] and acc.total_weight == sum(ws)
    ref = sum(w * x.double() for x, w in zip(xs, ws))
    assert_close(acc.weighted_sum, ref, rtol=rtol, atol=atol, name="weighted sum")
    norms = dict(zip(acc.client_ids, acc.sq_norms.tolist()))
    for i, x in enumerate(xs):
        assert norms[f"c{i}"] == pytest.approx(float(x.double().square().sum()), rel=rtol)
    # afterwards a lone add is folded alone, as before
    assert acc.add(xs[0], 1.0) and counter.sweeps == 2 and acc.num_clients == 5


def test_a_bad_client_in_a_group_is_refused_alone():
    d = 5_000
    acc = fastagg.Accumulator(like=torch.zeros(d))
    good = [_randn(d, i) for i in range(2)]
    nan, inf = _randn(d, 7), _randn(d, 8)
    nan[17], inf[4000] = float("nan"), float("inf")
    out = add_all_queued(acc, [dict(delta=good[0], weight=1.0, client_id="a"),
                              dict(delta=nan, weight=1.0, client_id="nan"),
                              dict(delta=inf, weight=1.0, client_id="inf", on_nonfinite="skip"),
                              dict(delta=good[1], weight=3.0, client_id="b")])
    assert out[0] is True and out[3] is True and out[2] is False
    assert isinstance(out[1], ValueError) and "contains NaN or Inf; the accumulator is unchanged by it" in str(out[1])
    assert sorted(acc.client_ids) == ["a", "b"] and acc.total_weight == 4.0
    assert_close(acc.weighted_sum, good[0].double() + 3 * good[1].double(), rtol=1e-6, atol=1e-6, name="sum")
    assert torch.isfinite(acc.weighted_sq_norm_sum)


def test_a_client_id_sent_twice_at_once_is_folded_once():
    d = 1_000
    acc = fastagg.Accumulator(like=torch.zeros(d))
    x = _randn(d, 0)
    acc.add(x, 1.0, client_id="early")
    out = add_all_queued(acc, [dict(delta=x, weight=1.0, client_id="dup"), dict(delta=x, weight=1.0, client_id="dup"),
                              dict(delta=x, weight=1.0, client_id="early"), dict(delta=x, weight=1.0, client_id=7)])
    assert sum(r is True for r in out[:2]) == 1 and out[3] is True
    for r in [r for r in out[:2] if r is not True] + [out[2]]:
        assert isinstance(r, ValueError) and "was already folded into this round" in str(r)
    assert sorted(map(str, acc.client_ids)) == ["7", "dup", "early"] and acc.total_weight == 3.0
    assert_close(acc.weighted_sum, 3 * x.double(), rtol=1e-6, atol=1e-6, name="sum")


def test_clients_that_overflow_only_together_are_sorted_out_one_by_one():
    acc = fastagg.Accumulator(like=torch.zeros(8))
    big = torch.zeros(8)
    big[0] = 2.0e38  # alone it can be stepped (its norm is within float32's range); two of them overflow the sum
    out = add_all_queued(acc, [dict(delta=big, weight=1.0, client_id="x"), dict(delta=big, weight=1.0, client_id="y"),
                              dict(delta=torch.ones(8), weight=1.0, client_id="z")])
    assert out[2] is True and sum(r is True for r in out[:2]) == 1
    refused = next(r for r in out[:2] if r is not True)
    assert isinstance(refused, ValueError) and "would overflow the running sums" in str(refused)
    assert acc.num_clients == 2 and torch.equal(torch.as_tensor(acc.weighted_sum), big + 1)


def test_batchnorm_state_dicts_added_at_once_average_their_buffers():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    sds = []
    for i in range(3):
        sd = {k: v.clone() for k, v in net.state_dict().items()}
        sd["0.weight"] += 0.1 * i
        sd["1.running_mean"] += i
        sd["1.num_batches_tracked"] += 10 * i
        sds.append(sd)
    acc = fastagg.Accumulator(like=net.state_dict())
    counter = SweepCounter(acc)
    assert add_all_queued(acc, [dict(delta=sd, weight=float(i + 1)) for i, sd in enumerate(sds)]) == [True] * 3
    assert counter.sweeps == 1
    w = {k: v.clone() for k, v in net.state_dict().items()}
    acc.fedavg_step(params=w)
    base = net.state_dict()
    expect_rm = base["1.running_mean"] + sum((i + 1) * sd["1.running_mean"] for i, sd in enumerate(sds)) / 6
    assert_close(w["1.running_mean"], expect_rm, rtol=1e-6, atol=1e-6, name="running mean")
    expect_w = base["0.weight"] + sum((i + 1) * sd["0.weight"] for i, sd in enumerate(sds)) / 6
    assert_close(w["0.weight"], expect_w, rtol=1e-6, atol=1e-6, name="weight")


def test_an_interrupted_folder_loses_no_other_client():
    """The thread folding the queue is interrupted (KeyboardInterrupt, a signal): the adds it had taken go back to
    the queue, the next thread folds them; only the interrupted call fails."""
    d = 2_000
    acc = fastagg.Accumulator(like=torch.zeros(d))
    xs = [_randn(d, i) for i in range(4)]
    fold_group, interrupted = acc._fold_group, []

    class Interrupt(BaseException):
        pass

    def first_call_interrupted(group):
        if not interrupted:
            interrupted.append(threading.current_thread())
            raise Interrupt
        return fold_group(group)

    acc._fold_group = first_call_interrupted
    out = []
    threads = []

    def run(i):
        try:
            out.append((i, acc.add(xs[i], 1.0, client_id=i)))
        except Interrupt:
            out.append((i, "interrupted"))

    with acc._lock:
        for i in range(4):
            threads.append(threading.Thread(target=run, args=(i,)))
            threads[-1].start()
        deadline = time.monotonic() + QUEUE_LIMIT_S
        while len(acc._pending) < 4 and time.monotonic() < deadline:
            time.sleep(0.001)
    for t in threads:
        t.join(QUEUE_LIMIT_S)
    assert not any(t.is_alive() for t in threads)
    results = dict(out)
    assert list(results.values()).count("interrupted") == 1 and list(results.values()).count(True) == 3
    lost = next(i for i, r in results.items() if r == "interrupted")
    assert sorted(acc.client_ids) == sorted(set(range(4)) - {lost})
    assert_close(acc.weighted_sum, sum(xs[i].double() for i in range(4) if i != lost), rtol=1e-6, atol=1e-6,
                 name="sum")


def test_full_models_from_the_same_base_are_folded_together():
    """Clients sending full models (FLARE's and Flower's default) against the model the server sent: one sweep
    forms each update ``model - base`` inside the kernel; their BatchNorm buffers advance by ``b - base_b``."""
    base, models = batchnorm_models(3, seed=1)
    other_base = {k: v.clone() for k, v in base.items()}  # equal values, another tensor: folded on its own
    acc = fastagg.Accumulator(like=base)
    counter = SweepCounter(acc)
    out = add_all_queued(acc, [dict(delta=m, weight=float(i + 1), base=base) for i, m in enumerate(models)]
                        + [dict(delta=models[0], weight=2.0, base=other_base)])
    assert out == [True] * 4
    assert counter.sweeps == 2  # the three with the same base together, the fourth alone
    ws = [1.0, 2.0, 3.0, 2.0]
    ms = models + [models[0]]
    expect = sum(w * (m["0.weight"] - base["0.weight"]) for w, m in zip(ws, ms))
    got = acc.weighted_sum["0.weight"]
    assert_close(got, expect, rtol=1e-12, atol=1e-15, name="0.weight sum")
    w = {k: v.clone() for k, v in base.items()}
    acc.fedavg_step(params=w)
    expect_var = base["1.running_var"] + sum(wi * (m["1.running_var"] - base["1.running_var"])
                                             for wi, m in zip(ws, ms)) / sum(ws)
    assert_close(w["1.running_var"], expect_var, rtol=1e-12, atol=1e-15, name="running var")


class Interrupt(Exception):
    """What the test's signal handler raises in the main thread (as Ctrl-C raises KeyboardInterrupt)."""


@contextlib.contextmanager
def _step_in_progress(acc):
    """A thread holds the accumulator's lock (as a step does) until the block ends. Yields ``arm(seconds)``: the
    main thread then receives a signal after that long, whose handler raises :class:`Interrupt`."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with acc._lock:
            held.set()
            release.wait(QUEUE_LIMIT_S)

    def on_alarm(signum, frame):
        raise Interrupt

    stepper = threading.Thread(target=hold)
    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        stepper.start()
        assert held.wait(QUEUE_LIMIT_S)
        yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        release.set()
        stepper.join(QUEUE_LIMIT_S)


def _add_once_folding(acc, x, client_id, out: list) -> threading.Thread:
    """A thread that calls ``acc.add`` once another thread has become the folder (so this add queues behind it)."""
    def run():
        deadline = time.monotonic() + QUEUE_LIMIT_S
        while not acc._folding and time.monotonic() < deadline:
            time.sleep(0.001)
        out.append(acc.add(x, 1.0, client_id=client_id))

    t = threading.Thread(target=run)
    t.start()
    return t


def test_an_add_interrupted_while_it_waits_is_withdrawn():
    """A signal (Ctrl-C) reaches the main thread while its add waits for another thread's fold: the call raises
    and its client is not folded later behind its back."""
    d = 1_000
    acc = fastagg.Accumulator(like=torch.zeros(d))
    x, y = _randn(d, 0), _randn(d, 1)
    folded = []
    with _step_in_progress(acc) as arm:
        folder = threading.Thread(target=lambda: folded.append(acc.add(y, 1.0, client_id="folder")))
        folder.start()  # becomes the folder and waits for the step's lock
        deadline = time.monotonic() + QUEUE_LIMIT_S
        while not acc._folding and time.monotonic() < deadline:
            time.sleep(0.001)
        arm(0.3)
        with pytest.raises(Interrupt):
            acc.add(x, 1.0, client_id="interrupted")  # waits behind the folder until the signal
        assert all(f.client_id != "interrupted" for f in acc._pending)
    folder.join(QUEUE_LIMIT_S)
    assert folded == [True] and acc.client_ids == ["folder"]
    assert acc.add(x, 1.0, client_id="interrupted")  # sent again, it is folded once
    assert acc.client_ids == ["folder", "interrupted"]


def test_a_folder_interrupted_while_it_waits_for_the_lock_folds_nothing_and_hands_on():
    """The main thread became the folder and waits for the lock (a step holds it); a signal interrupts it: its own
    client is withdrawn, and the add queued behind it is folded by its own thread once the step is done."""
    d = 1_000
    acc = fastagg.Accumulator(like=torch.zeros(d))
    x, y = _randn(d, 0), _randn(d, 1)
    later = []
    with _step_in_progress(acc) as arm:
        behind = _add_once_folding(acc, y, "behind", later)
        arm(0.3)
        with pytest.raises(Interrupt):
            acc.add(x, 1.0, client_id="interrupted")  # becomes the folder, waits for the step's lock
        assert all(f.client_id != "interrupted" for f in acc._pending)
    behind.join(QUEUE_LIMIT_S)
    assert later == [True] and acc.client_ids == ["behind"]


def test_an_add_by_the_thread_holding_the_lock_does_not_wait_for_a_folder_that_waits_for_it():
    """A thread that holds the accumulator's lock (re-entered, e.g. from a callback inside a step) adds a client
    while another thread's add already waits for that lock as the folder: the add folds at once instead of waiting
    for the folder, which would wait for it in turn (a deadlock)."""
    d = 1_000
    acc = fastagg.Accumulator(like=torch.zeros(d))
    x, y = _randn(d, 0), _randn(d, 1)
    results = []
    folder = threading.Thread(target=lambda: results.append(("folder", acc.add(y, 1.0, client_id="folder"))),
                              daemon=True)

    def holder():
        with acc._lock:
            folder.start()
            deadline = time.monotonic() + QUEUE_LIMIT_S
            while not acc._folding and time.monotonic() < deadline:
                time.sleep(0.001)
            results.append(("holder", acc.add(x, 1.0, client_id="holder")))

    h = threading.Thread(target=holder, daemon=True)
    h.start()
    h.join(QUEUE_LIMIT_S)
    folder.join(QUEUE_LIMIT_S)
    assert not h.is_alive() and not folder.is_alive(), "deadlock: the lock holder waited for the folder"
    assert sorted(results) == [("folder", True), ("holder", True)]
    assert acc.client_ids == ["holder", "folder"]


def test_the_readme_threaded_server_round():
    """The README's streaming example: full state_dicts (Conv + BatchNorm) from a pool of threads against the model
    sent, one NaN reply skipped, FedAdam on the accumulator; the same model as adding the replies one by one."""
    import concurrent.futures
    import copy

    from fastagg import server

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                              torch.nn.Linear(144, 3)).double()
    sent = {k: v.clone() for k, v in net.state_dict().items()}
    replies = []
    for i in range(12):
        m = copy.deepcopy(net)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.01 * torch.randn_like(p))
        m.train()
        m(torch.randn(4, 1, 8, 8, dtype=torch.float64))
        sd = {k: v.clone() for k, v in m.state_dict().items()}
        if i == 5:
            sd["3.bias"][0] = float("nan")
        replies.append((sd, 10 + i, f"node{i}"))

    models = {}
    for threaded in (True, False):
        model = copy.deepcopy(net)
        opt = server.FedAdam(model, lr=0.01)
        acc = fastagg.Accumulator(like=model.state_dict())
        if threaded:
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(acc.add, r, n, base=sent, client_id=node, on_nonfinite="skip")
                           for r, n, node in replies]
                folded = [f.result(QUEUE_LIMIT_S) for f in futures]
        else:
            folded = [acc.add(r, n, base=sent, client_id=node, on_nonfinite="skip") for r, n, node in replies]
        assert folded == [i != 5 for i in range(12)]
        opt.step(acc)
        models[threaded] = model.state_dict()
    for k, v in models[False].items():
        assert_close(models[True][k], v, rtol=1e-12, atol=1e-14, name=k)
