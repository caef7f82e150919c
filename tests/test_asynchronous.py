"""fastagg.asynchronous: FedBuff and FedAsync against float64 oracles written from the papers' algorithms, the
staleness rules, threads submitting at once (no update lost or counted twice, one step per K), a restart from
state_dict, and hostile submissions."""
from __future__ import annotations

import threading

import pytest
import torch

from fastagg import server
from fastagg.asynchronous import AsyncServer, Constant, Hinge, Polynomial, StaleUpdate, StepError, Threshold
from fastagg.testing import cpu_backends


def test_staleness_rules_are_their_formulas():
    assert [Constant()(s) for s in (0, 5)] == [1.0, 1.0]
    assert Polynomial(0.5)(3) == pytest.approx(0.5) and Polynomial(1.0)(0) == 1.0
    assert [Hinge(10, 4)(s) for s in (0, 4, 5, 7)] == pytest.approx([1.0, 1.0, 1 / 11, 1 / 31])
    assert [Threshold(2, 0.25)(s) for s in (2, 3)] == [1.0, 0.25]
    for bad in (lambda: Polynomial(-1), lambda: Hinge(b=-1), lambda: Threshold(-1), lambda: Threshold(1, float("nan"))):
        with pytest.raises(ValueError):
            bad()


def _fedbuff_oracle(w0, events, k, rule, lr, momentum):
    """FedBuff (Nguyen et al., Algorithm 1) with server momentum, in float64: events are (update, version)."""
    w, buf, acc, total, version = w0.double().clone(), None, torch.zeros_like(w0, dtype=torch.float64), 0.0, 0
    for d, v in events:
        acc += rule(version - v) * d.double()
        total += 1.0
        if total == k:
            mean = acc / total
            buf = mean if buf is None else momentum * buf + mean
            w += lr * buf
            acc.zero_()
            total, version = 0.0, version + 1
    return w, version


@pytest.mark.parametrize("backend", cpu_backends())
def test_fedbuff_equals_the_papers_algorithm(backend):
    g = torch.Generator().manual_seed(0)
    d = 257
    w = torch.randn(d, generator=g)
    w0 = w.clone()
    srv = AsyncServer(server.FedAvgM(w, lr=0.7, momentum=0.9, backend=backend), buffer_size=3,
                      staleness=Polynomial(0.5))
    events = []
    for i in range(14):  # versions lag behind by a varying amount
        _, now = srv.fetch()
        v = max(0, now - i % 3)
        u = 0.1 * torch.randn(d, generator=g)
        events.append((u, v))
        r = srv.submit(u, v)
        assert r.folded and r.staleness == now - v
    want, version = _fedbuff_oracle(w0, events, 3, lambda s: (1 + s) ** -0.5, 0.7, 0.9)
    assert srv.version == version == 4 and srv.pending == 2
    torch.testing.assert_close(w.double(), want, rtol=1e-5, atol=1e-6)


def test_fedasync_is_a_mixing_step_per_update():
    w = torch.zeros(50, dtype=torch.float64)
    srv = AsyncServer(server.FedAvg(w, lr=0.6), buffer_size=1, staleness=Hinge(10, 0))
    model0, _ = srv.fetch()
    local = torch.ones(50, dtype=torch.float64)
    srv.submit(local, 0, base=model0)  # a full model and what it started from: w <- w + 0.6 (w_i - w_0)
    assert torch.allclose(w, torch.full_like(w, 0.6))
    srv.submit(2 * local, 0, base=model0)  # staleness 1: s = 1 / (10 * 1 + 1)
    assert torch.allclose(w, torch.full_like(w, 0.6 + 0.6 * 2 / 11))


def test_each_submit_reports_the_version_its_own_step_produced():
    """Another step can happen between a step releasing its lock and its submit returning: the version reported is
    the one that step produced, read under the lock (deterministic here: the lock's release runs the other step)."""
    w = torch.zeros(10, dtype=torch.float64)
    srv = AsyncServer(server.FedAvg(w), buffer_size=1, staleness=Constant())
    inner = []

    class StepsAnotherBufferOnRelease:
        lock, armed = threading.Lock(), True

        def __enter__(self):
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()
            if self.armed:
                self.armed = False
                inner.extend(srv.submit(torch.ones(10, dtype=torch.float64), srv.version).stepped)

    srv._step_lock = StepsAnotherBufferOnRelease()
    outer = srv.submit(torch.ones(10, dtype=torch.float64), 0).stepped
    assert srv.version == 2 and inner == [2] and outer == [1]


def test_threads_lose_nothing_and_step_once_per_k():
    """FedAvg with lr 1 and constant staleness: whatever buffers the updates land in, after all n * K updates the
    model moved by (1/K) times their sum, the version advanced n times and each step's version was reported once
    (by the submit that took it, even when another thread steps right after)."""
    k, threads, per = 5, 4, 25
    d = 1000
    w = torch.zeros(d, dtype=torch.float64)
    srv = AsyncServer(server.FedAvg(w), buffer_size=k, staleness=Constant())
    g = torch.Generator().manual_seed(1)
    updates = [torch.randn(threads * per, d, generator=g, dtype=torch.float64)]
    total = updates[0].sum(0)
    stepped, errors = [], []

    def worker(t):
        try:
            for j in range(per):
                _, v = srv.fetch()
                stepped.extend(srv.submit(updates[0][t * per + j], v, client_id=f"c{t}-{j}").stepped)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert srv.version == threads * per // k and sorted(stepped) == list(range(1, srv.version + 1))
    assert srv.pending == 0
    torch.testing.assert_close(w, total / k, rtol=1e-10, atol=1e-10)


def test_state_dict_restart_continues_as_if_uninterrupted():
    g = torch.Generator().manual_seed(2)
    ups = [(torch.randn(64, generator=g), v) for v in (0, 0, 0, 1, 0, 1, 2, 1)]

    def run(stop=None):
        w = torch.zeros(64)
        srv = AsyncServer(server.FedAdam(w, lr=0.05), buffer_size=3)
        for i, (u, v) in enumerate(ups):
            if i == stop:
                state = srv.state_dict()
                w2 = w.clone()
                srv = AsyncServer(server.FedAdam(w2, lr=0.05), buffer_size=3)
                srv.load_state_dict(state)
                w = w2
            srv.submit(u, v, client_id=i)
        return w, srv.version

    a, va = run()
    b, vb = run(stop=4)  # one update waiting in a buffer when the server restarts
    assert va == vb == 2
    torch.testing.assert_close(a, b)


def test_hostile_submissions_are_refused_and_change_nothing():
    w = torch.zeros(8)
    srv = AsyncServer(server.FedAvg(w), buffer_size=2, max_staleness=1)
    srv.submit(torch.ones(8), 0, client_id="a")
    for bad, err in ((1, "future"), (-1, ">= 0"), (0.5, "whole"), ("0", "whole"), (True, "whole")):
        with pytest.raises(StaleUpdate, match=err):
            srv.submit(torch.ones(8), bad)
    with pytest.raises(ValueError, match="already folded"):
        srv.submit(torch.ones(8), 0, client_id="a")
    nan = torch.ones(8)
    nan[3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        srv.submit(nan, 0, client_id="b")
    assert srv.pending == 1 and srv.version == 0 and w.abs().sum() == 0
    srv.submit(torch.ones(8), 0, client_id="b")  # the NaN attempt freed both its slot and its id
    assert srv.version == 1
    srv.submit(torch.ones(8), 1)
    srv.submit(torch.ones(8), 1)
    assert srv.version == 2
    with pytest.raises(StaleUpdate, match="max_staleness=1"):
        srv.submit(torch.ones(8), 0)
    skip = AsyncServer(server.FedAvg(torch.zeros(8)), buffer_size=2, on_nonfinite="skip")
    assert not skip.submit(nan, 0).folded and skip.pending == 0
    for kw, err in ((dict(buffer_size=0), ValueError), (dict(max_staleness=-1), ValueError),
                    (dict(staleness="poly"), TypeError), (dict(on_nonfinite="drop"), ValueError)):
        with pytest.raises(err):
            AsyncServer(server.FedAvg(torch.zeros(2)), **kw)
    with pytest.raises(TypeError, match="optimizer"):
        AsyncServer(torch.zeros(2))


def test_flush_steps_a_partial_buffer_and_fetch_is_a_copy():
    w = torch.zeros(4)
    srv = AsyncServer(server.FedAvg(w), buffer_size=10, staleness=Constant())
    model, v = srv.fetch()
    srv.submit(torch.ones(4), v)
    assert srv.flush() and srv.version == 1 and torch.equal(w, torch.ones(4))
    assert not srv.flush()
    assert torch.equal(model, torch.zeros(4))  # the copy fetched before the step is untouched


def test_a_signal_anywhere_in_a_submit_leaves_a_consistent_server():
    """A timer whose handler raises (Ctrl-C's KeyboardInterrupt), at many points of a stream of submits: afterwards
    every buffer's count equals its accumulator's and no slot stays reserved, the model moved exactly once per
    version (FedAvg of all-ones updates: w == version), no update was lost (version * K + pending == updates
    folded), and the server takes the next submits."""
    import signal

    from fastagg.asynchronous import Constant

    w = torch.zeros(2000, dtype=torch.float64)
    srv = AsyncServer(server.FedAvg(w), buffer_size=3, staleness=Constant())

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    interrupted = 0
    try:
        for k in range(40):
            signal.setitimer(signal.ITIMER_REAL, 1e-4 * (1 + k % 20))
            try:
                for i in range(50):
                    srv.submit(torch.ones(2000, dtype=torch.float64), srv.version, client_id=(k, i))
            except KeyboardInterrupt:
                interrupted += 1
            signal.setitimer(signal.ITIMER_REAL, 0)
            state = srv.state_dict()  # a call after the interrupted one: it sees everything that one did
            assert all(b.folded == b.acc.num_clients and b.reserved == 0 for b in srv._buffers)
            assert torch.equal(w, torch.full_like(w, float(state["version"])))
            assert 3 * state["version"] + srv.pending == sum(len(ids) for ids in state["ids"].values())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupted > 20  # the timer did cut submit streams (not a test that cannot fail)
    v = srv.version
    for _ in range(3 - srv.pending % 3):
        srv.submit(torch.ones(2000, dtype=torch.float64), srv.version)
    assert srv.version == v + 1 and torch.equal(w, torch.full_like(w, float(v + 1)))


_EXIT_SCRIPT = r'''
import atexit, faulthandler, os, signal, sys, threading
import torch
faulthandler.dump_traceback_later(90, exit=True)  # a hang fails the test with every thread's stack, not a timeout
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a parent that ignores SIGINT passes that on through exec)
from fastagg import server
from fastagg.asynchronous import AsyncServer, Constant

if sys.argv[1] == "term":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
d = 2_000_000
w = torch.zeros(d)
srv = AsyncServer(server.FedAvg(w), buffer_size=3, staleness=Constant())
done = [0]


def check():  # runs after the interpreter joined its threads: the interrupted submit has finished by then
    ok = all(b.folded == b.acc.num_clients and b.reserved == 0 for b in srv._buffers)
    ok = ok and srv.version * 3 + srv.pending in (done[0], done[0] + 1)  # + the submit the signal interrupted
    ok = ok and bool(torch.equal(w, torch.full_like(w, float(srv.version))))
    print("CONSISTENT" if ok else f"INCONSISTENT {srv.version} {srv.pending} {done[0]}", flush=True)


atexit.register(check)
u = torch.ones(d)
srv.submit(u, 0)
done[0] += 1
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT if sys.argv[1] == "int" else signal.SIGTERM)).start()
while True:
    srv.submit(u, srv.version)
    done[0] += 1
'''


@pytest.mark.parametrize("how", ["int", "term"])
def test_ctrl_c_or_sigterm_during_submits_ends_in_the_python_exception(tmp_path, how):
    """A Ctrl-C (SIGINT) or a SIGTERM handler calling sys.exit while the main thread submits: the process ends with
    the Python exception (KeyboardInterrupt: killed by SIGINT, as CPython does; SystemExit(3): status 3), not
    "terminate called without an active exception" and SIGABRT (a daemon helper thread was still inside a C++
    kernel when the interpreter finalized), and the server's state is consistent at exit."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    p = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=120)
    assert "terminate called" not in p.stderr, p.stderr[-2000:]
    if how == "int":
        assert p.returncode in (-2, 130) and "KeyboardInterrupt" in p.stderr, (p.returncode, p.stderr[-2000:])
    else:
        assert p.returncode == 3, (p.returncode, p.stderr[-2000:])
    assert p.stdout.strip().splitlines()[-1] == "CONSISTENT", (p.stdout, p.stderr[-2000:])


def test_a_failed_step_keeps_the_buffer_its_ids_and_the_version():
    """The optimizer refuses a step (a hyperparameter set to an invalid value by hand): the buffer, its updates and
    their clients' ids stay, the version and the model do not move, a retry of a folded client is refused as already
    folded (not counted twice), and once the value is fixed the next submit steps on every update, each once."""
    w = torch.zeros(6, dtype=torch.float64)
    opt = server.FedAvg(w, lr=1.0)
    srv = AsyncServer(opt, buffer_size=2, staleness=Constant())
    srv.submit(torch.full((6,), 1.0, dtype=torch.float64), 0, client_id="a")
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(StepError, match="folded") as failed:
        srv.submit(torch.full((6,), 3.0, dtype=torch.float64), 0, client_id="b")  # completes the buffer: steps
    assert isinstance(failed.value.__cause__, ValueError) and "lr" in str(failed.value.__cause__)
    assert failed.value.result.folded and failed.value.result.stepped == []
    assert srv.version == 0 and srv.pending == 2 and torch.equal(w, torch.zeros_like(w))
    assert srv.state_dict()["ids"] == {0: ["a", "b"]}
    with pytest.raises(ValueError, match="already folded"):
        srv.submit(torch.full((6,), 3.0, dtype=torch.float64), 0, client_id="b")
    with pytest.raises(ValueError, match="lr"):
        srv.flush()
    assert srv.version == 0 and srv.pending == 2
    opt.param_groups[0]["lr"] = 1.0
    r = srv.submit(torch.full((6,), 5.0, dtype=torch.float64), 0, client_id="c")  # goes to the next buffer
    assert r.stepped == [1] and srv.version == 1 and srv.pending == 1
    torch.testing.assert_close(w, torch.full_like(w, 2.0), rtol=0, atol=1e-12)  # mean of a and b, once
    assert srv.flush() and srv.version == 2
    torch.testing.assert_close(w, torch.full_like(w, 7.0), rtol=0, atol=1e-12)  # + c


def test_state_dict_while_threads_submit_is_a_consistent_copy():
    """Three threads submit all-ones updates (FedAvg, lr 1, constant staleness: the model is the version) while the
    main thread takes state_dicts: every copy loads into a fresh server, its buffers' counts are their sums, the
    ids it lists are exactly its updates (version * K + pending)."""
    d, k = 200_000, 4
    w = torch.zeros(d, dtype=torch.float64)
    srv = AsyncServer(server.FedAvg(w), buffer_size=k, staleness=Constant())
    stop, errors = threading.Event(), []

    def worker(t):
        try:
            j = 0
            while not stop.is_set():
                srv.submit(torch.ones(d, dtype=torch.float64), srv.version, client_id=(t, j))
                j += 1
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for t in ts:
        t.start()
    states = []
    try:
        for _ in range(15):
            states.append(srv.state_dict())
    finally:
        stop.set()
        for t in ts:
            t.join()
    assert not errors
    assert len({s["version"] for s in states} | {sum(b["folded"] for b in s["buffers"]) for s in states}) > 1
    for state in states:
        w2 = torch.zeros(d, dtype=torch.float64)
        copy = AsyncServer(server.FedAvg(w2), buffer_size=k, staleness=Constant())
        copy.load_state_dict(state)
        assert copy.version == state["version"]
        for b in copy._buffers:
            assert b.folded == b.acc.num_clients
            assert float(b.acc.total_weight) == b.folded
        assert sum(len(ids) for ids in state["ids"].values()) == k * copy.version + copy.pending


def test_load_state_dict_is_all_or_nothing():
    """A state that is bad anywhere (its ids, a buffer, its optimizer part) is refused with an error naming the
    part, and the server (optimizer state, version, buffers, ids, model) is exactly as it was."""
    import copy as copymod

    def server_at(n):
        w = torch.zeros(16)
        srv = AsyncServer(server.FedAdam(w, lr=0.1), buffer_size=2, staleness=Constant())
        for i in range(n):
            srv.submit(torch.full((16,), float(i + 1)), srv.version, client_id=f"c{i}")
        return srv, w

    good = server_at(5)[0].state_dict()  # version 2, one update pending
    srv, w = server_at(3)
    before, w_before = srv.state_dict(), w.clone()
    bad_ids = copymod.deepcopy(good)
    bad_ids["ids"] = {"x": ["c0"]}
    bad_buffer = copymod.deepcopy(good)
    bad_buffer["buffers"][0]["folded"] = 2
    bad_optimizer = copymod.deepcopy(good)
    bad_optimizer["optimizer"] = {"nonsense": 1}
    other_kind = copymod.deepcopy(good)
    other_kind["normalize"] = "flsim"  # its buffers' sums would be of FLSim's kind
    for bad, err in ((bad_ids, "ids"), (bad_buffer, "buffer 0"), (bad_optimizer, "state_dict"),
                     (other_kind, "normalize")):
        with pytest.raises(ValueError) as refused:
            srv.load_state_dict(bad)
        after = srv.state_dict()
        assert after["version"] == before["version"] and after["ids"] == before["ids"]
        assert [b["folded"] for b in after["buffers"]] == [b["folded"] for b in before["buffers"]]
        mine, theirs = before["optimizer"]["state"][0], after["optimizer"]["state"][0]
        assert set(mine) == set(theirs) and len(mine) >= 2  # the step counter and Adam's moments
        assert all(torch.equal(mine[key], theirs[key]) for key in mine)
        assert torch.equal(w, w_before)
        assert err in str(refused.value), (err, refused.value)
    srv.load_state_dict(good)
    assert srv.version == 2 and srv.pending == 1


def test_flsim_normalisation_and_staleness_weight_are_flsims_fedbuff():
    """normalize="flsim" with Polynomial(avg_staleness=1) against FLSim's FedBuff written from its code
    (FedAvgWithLRFedBuffAggregator: a WEIGHTED_SUM reducer of weight * (before - after) per client, weight =
    example weight * PolynomialStalenessWeight ((1 + s)^-a / (1 + avg_staleness)^-a); a torch.optim.SGD step with
    that sum as the gradient after buffer_size clients; on_training_epoch_end steps on a partial buffer's sum as
    it is). The peer is torch.optim.SGD itself, in float64; the default normalisation is checked to differ."""
    g = torch.Generator().manual_seed(5)
    d, k, lr, momentum, a = 33, 3, 0.4, 0.9, 0.5
    w0 = torch.randn(d, dtype=torch.float64, generator=g)
    events = [(0.1 * torch.randn(d, dtype=torch.float64, generator=g), float(1 + i % 4), lag) for i, lag in
              enumerate((0, 0, 1, 0, 2, 1, 0, 3))]  # (update, example weight, versions behind)

    def flsim():
        model = torch.nn.Parameter(w0.clone())
        sgd = torch.optim.SGD([model], lr=lr, momentum=momentum)
        reduced, reported, version = torch.zeros(d, dtype=torch.float64), 0, 0
        for delta, n, lag in events:
            staleness = min(lag, version)
            weight = n * ((1 + staleness) ** -a / (1 + 1) ** -a)
            reduced += weight * -delta  # FLSim's client delta is before - after
            reported += 1
            if reported >= k:
                model.grad = reduced.clone()
                sgd.step()
                reduced.zero_()
                reported, version = 0, version + 1
        model.grad = reduced.clone()  # on_training_epoch_end: the partial buffer as it is
        sgd.step()
        return model.detach()

    def ours(normalize):
        w = w0.clone()
        srv = AsyncServer(server.FedAvgM(w, lr=lr, momentum=momentum), buffer_size=k, normalize=normalize,
                          staleness=Polynomial(a, avg_staleness=1))
        for delta, n, lag in events:
            srv.submit(delta, max(0, srv.version - lag), weight=n)
        assert srv.version == 2 and srv.pending == 2 and srv.flush()
        return w

    want = flsim()
    torch.testing.assert_close(ours("flsim"), want, rtol=1e-10, atol=1e-12)
    assert (ours("weights") - want).abs().max() > 1e-2  # the default is another normalisation
    assert Polynomial(0.5, avg_staleness=1)(0) == pytest.approx(2 ** 0.5)
    assert Threshold(2, 0.5, avg_staleness=3)(0) == 2.0 and Threshold(2, 0.5, avg_staleness=3)(4) == 1.0
    with pytest.raises(ValueError, match="normalize"):
        AsyncServer(server.FedAvg(torch.zeros(2)), normalize="sum")
    with pytest.raises(ValueError, match="avg_staleness"):
        Polynomial(0.5, avg_staleness=-1)
    with pytest.raises(ValueError, match="avg_staleness"):
        Threshold(1, 0.0, avg_staleness=2)


@pytest.mark.parametrize("k", [1, 2])
def test_clients_sending_weight_0_cannot_stop_the_server(k):
    """K clients send weight 0 (FedAsync: one): their buffer, due, has total weight 0 -- a mean of nothing. It is
    discarded without a step (reported; the version and the model stay; its clients stay folded), and the honest
    updates after it step as if it had never come: the model is the sum of the means of each K honest updates
    (FedAvg, lr 1, constant staleness, float64). Before, every later submit raised StepError and nothing stepped."""
    w = torch.zeros(5, dtype=torch.float64)
    srv = AsyncServer(server.FedAvg(w, lr=1.0), buffer_size=k, staleness=Constant())
    for i in range(k):
        r = srv.submit(torch.full((5,), 100.0, dtype=torch.float64), 0, weight=0.0, client_id=f"evil{i}")
    assert r.folded and r.stepped == [] and [n for n, _ in r.discarded] == [k] and "weight is 0" in r.discarded[0][1]
    assert srv.version == 0 and srv.pending == 0 and torch.equal(w, torch.zeros_like(w))
    assert [(v, n) for v, n, _ in srv.discarded] == [(0, k)]
    with pytest.raises(ValueError, match="already folded"):
        srv.submit(torch.ones(5, dtype=torch.float64), 0, client_id="evil0")
    restarted = AsyncServer(server.FedAvg(torch.zeros(5, dtype=torch.float64)), buffer_size=k, staleness=Constant())
    restarted.load_state_dict(srv.state_dict())  # its ids, folded from version 0 in no buffer: discarded, not lost
    with pytest.raises(ValueError, match="already folded"):
        restarted.submit(torch.ones(5, dtype=torch.float64), 0, client_id="evil0")
    values = [float(i + 1) for i in range(3 * k)]
    for i, x in enumerate(values):
        srv.submit(torch.full((5,), x, dtype=torch.float64), srv.version, client_id=f"honest{i}")
    expected = sum(sum(values[j:j + k]) / k for j in range(0, len(values), k))
    assert srv.version == 3 and srv.pending == 0 and len(srv.discarded) == 1
    torch.testing.assert_close(w, torch.full_like(w, expected), rtol=0, atol=1e-12)


def test_a_weight_0_update_beside_others_counts_for_nothing_and_a_flushed_weight_0_buffer_is_discarded():
    """Weight 0 next to a weight-3 update: the step is that update alone (sum n_i d_i / sum n_i). A partial buffer
    of weight 0 at flush: discarded, flush() False, nothing moved; the next buffer is stepped by the next flush."""
    w = torch.zeros(3, dtype=torch.float64)
    srv = AsyncServer(server.FedAvg(w, lr=1.0), buffer_size=3, staleness=Constant())
    srv.submit(torch.full((3,), 9.0, dtype=torch.float64), 0, weight=0.0)
    srv.submit(torch.full((3,), 2.0, dtype=torch.float64), 0, weight=3.0)
    assert srv.flush() and srv.version == 1
    torch.testing.assert_close(w, torch.full_like(w, 2.0), rtol=0, atol=1e-12)
    srv.submit(torch.full((3,), 9.0, dtype=torch.float64), 1, weight=0.0)
    assert not srv.flush() and srv.version == 1 and srv.pending == 0 and len(srv.discarded) == 1
    torch.testing.assert_close(w, torch.full_like(w, 2.0), rtol=0, atol=1e-12)


def test_a_weight_too_small_to_normalise_by_is_refused_at_submit():
    """weight=1e-45: the buffer's total weight has no finite float32 reciprocal (its step was NaN and jammed the
    server). Refused at submit naming the weight, nothing folded (the client may send again); min_weight itself is
    taken and its update is the step (the weighted mean of one update is the update)."""
    w = torch.zeros(4)
    srv = AsyncServer(server.FedAvg(w, lr=1.0), buffer_size=1, staleness=Constant())
    assert 1e-20 < srv.min_weight < 1e-18
    with pytest.raises(ValueError, match="weight=1e-45"):
        srv.submit(torch.full((4,), 0.5), 0, weight=1e-45, client_id="a")
    assert srv.version == 0 and srv.pending == 0 and srv.state_dict()["ids"] == {}
    assert torch.equal(w, torch.zeros_like(w))
    assert srv.submit(torch.full((4,), 0.5), 0, weight=srv.min_weight, client_id="a").stepped == [1]
    torch.testing.assert_close(w, torch.full_like(w, 0.5), rtol=1e-6, atol=0)
    flsim = AsyncServer(server.FedAvg(torch.zeros(4), lr=1.0), buffer_size=1, normalize="flsim")
    assert flsim.min_weight == 0.0 and flsim.submit(torch.ones(4), 0, weight=1e-45).stepped == [1]


def test_a_buffer_whose_step_overflows_is_discarded_not_retried_forever():
    """An update of 1e38s with lr 10: the step would write Inf (the optimizer refuses it; its hyperparameters are
    valid), and the same numbers would fail every retry: the buffer is discarded with the optimizer's reason, and
    the next update steps. (An invalid hyperparameter keeps its buffer: test_a_failed_step_keeps_the_buffer...)"""
    w = torch.zeros(4)
    srv = AsyncServer(server.FedAvg(w, lr=10.0), buffer_size=1, staleness=Constant())
    r = srv.submit(torch.full((4,), 1e38), 0, client_id="evil")
    assert r.stepped == [] and len(r.discarded) == 1 and "overflows" in r.discarded[0][1]
    assert srv.version == 0 and torch.equal(w, torch.zeros_like(w))
    assert srv.submit(torch.full((4,), 0.25), 0, client_id="honest").stepped == [1]
    torch.testing.assert_close(w, torch.full_like(w, 2.5), rtol=1e-6, atol=0)


def test_load_state_dict_checks_the_ids_against_the_buffers():
    """A state whose buffers and ids disagree is refused, naming the disagreement, with the server unchanged: no
    buffers while the ids list an update folded at the state's own version (it would be lost and its client refused
    as already folded), its one buffer repeated (the same updates would step 4 times), a buffer holding a client the
    ids do not list, more ids than updates in a buffer. The consistent state loads and continues."""
    import copy as copymod

    def make():
        w = torch.zeros(3, dtype=torch.float64)
        srv = AsyncServer(server.FedAvgM(w, lr=1.0, momentum=0.9), buffer_size=3, staleness=Constant())
        return srv, w

    src, _ = make()
    for i in range(4):
        src.submit(torch.full((3,), 0.1, dtype=torch.float64), 0, client_id=f"c{i}")
    src.submit(torch.full((3,), 0.1, dtype=torch.float64), 1, client_id="x")
    good = src.state_dict()  # version 1; c3 (stale) and x pending
    assert good["version"] == 1 and [b["folded"] for b in good["buffers"]] == [2]

    def edited(fn):
        s = copymod.deepcopy(good)
        fn(s)
        return s

    def drop_ids(s):
        s["ids"][1] = []

    bad = {"no buffers": (edited(lambda s: s.__setitem__("buffers", [])), "no buffer holds"),
           "buffer x4": (edited(lambda s: s.__setitem__("buffers", s["buffers"] * 4)), "buffers 0 and 1"),
           "unlisted": (edited(drop_ids), "do not list"),
           "more ids": (edited(lambda s: s["buffers"][0]["ids"].append((0, "c0"))), "3 client ids for 2")}
    srv, w = make()
    srv.submit(torch.ones(3, dtype=torch.float64), 0, client_id="mine")
    before = srv.state_dict()
    for name, (state, match) in bad.items():
        with pytest.raises(ValueError, match=match):
            srv.load_state_dict(state)
        after = srv.state_dict()
        assert (after["version"], after["ids"], after["buffers"][0]["folded"], after["buffers"][0]["ids"]) == \
            (before["version"], before["ids"], 1, [(0, "mine")]), name
        assert torch.equal(w, torch.zeros_like(w)), name
    srv.load_state_dict(good)
    assert srv.version == 1 and srv.pending == 2
    assert srv.submit(torch.full((3,), 0.1, dtype=torch.float64), 1, client_id="y").stepped == [2]
    # the restored momentum 0.1 (the first step's mean) * 0.9 + this buffer's mean 0.1; w (not in the state) was 0
    torch.testing.assert_close(w, torch.full_like(w, 0.9 * 0.1 + 0.1), rtol=0, atol=1e-12)
