"""fastagg._uninterruptible: a call from the main thread finishes even when a signal interrupts its caller."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from fastagg._uninterruptible import run_to_completion


def test_an_interrupted_call_finishes_and_the_next_call_sees_it():
    log = []

    def slow():
        time.sleep(0.2)
        log.append("done")

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.02)
        with pytest.raises(KeyboardInterrupt):
            run_to_completion(slow)  # the caller is interrupted at once ...
        assert log == []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert run_to_completion(lambda: list(log)) == ["done"]  # ... the call finished before the next one ran


def test_results_and_exceptions_come_back_and_other_threads_run_directly():
    assert run_to_completion(lambda a, b=1: a + b, 2, b=3) == 5
    with pytest.raises(ValueError, match="bad"):
        run_to_completion(lambda: (_ for _ in ()).throw(ValueError("bad")))
    main = threading.main_thread()
    assert run_to_completion(threading.current_thread) is not main  # the helper
    seen = []
    t = threading.Thread(target=lambda: seen.append(run_to_completion(threading.current_thread)))
    t.start()
    t.join()
    assert seen == [t]  # from another thread: run right there


def test_the_call_runs_under_the_callers_grad_mode():
    import torch

    with torch.no_grad():
        assert run_to_completion(torch.is_grad_enabled) is False
    assert run_to_completion(torch.is_grad_enabled) is True


def _interrupted_while_running(signum: int, send) -> list:
    """Runs a call that blocks until the caller has been interrupted; ``send(helper_thread_id)`` delivers
    ``signum`` (its handler raises KeyboardInterrupt) once the call runs. The KeyboardInterrupt must reach the main
    thread while the call is still blocked -- no clock involved: a wait that noticed it only after the call would
    reach the call's 60 s bound and then see ``log`` filled. Returns what the call logged once it was released."""
    log, helper, running, release = [], [], threading.Event(), threading.Event()

    def blocked():
        helper.append(threading.get_ident())
        running.set()
        release.wait(60)
        log.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signum, interrupt)
    try:
        sender = threading.Thread(target=lambda: (running.wait(60), send(helper[0])))
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            run_to_completion(blocked)
        assert log == []  # interrupted while the call was still running
        release.set()
        sender.join()
    finally:
        signal.signal(signum, previous)
    assert run_to_completion(lambda: len(log)) == 1  # the call finished before the next one ran
    return log


def test_a_signal_the_kernel_hands_to_the_helper_still_interrupts_the_wait():
    """A process-directed signal may be delivered to any thread: here to the helper itself (pthread_kill) while it
    runs a call. Its handler must still run in the main thread while the call runs (not after it), the call
    finishes, and the helper's own signal mask stays empty (a process it started could otherwise not be stopped by
    SIGINT / SIGTERM)."""
    log = _interrupted_while_running(signal.SIGUSR1, lambda helper: signal.pthread_kill(helper, signal.SIGUSR1))
    assert not log[0] & {signal.SIGINT, signal.SIGTERM}


def test_ctrl_c_sent_to_the_process_interrupts_the_wait():
    """``kill -INT <pid>`` (what Ctrl-C and a supervisor send) while the main thread waits on a call: the
    KeyboardInterrupt comes while the call runs, and the call still finishes."""
    import os

    _interrupted_while_running(signal.SIGINT, lambda helper: os.kill(os.getpid(), signal.SIGINT))


def test_a_signal_handler_calling_while_the_helper_starts_runs_its_call_directly():
    """A SIGTERM handler that takes a checkpoint (an uninterruptible call) can run while the main thread is inside
    the helper's start (Thread.start waits on an Event: signals run there), holding the start lock: its call runs
    directly instead of waiting on that lock forever (a reviewer saw 10 of 12 forked children hang). Held by hand
    here, in a fresh interpreter so that no helper exists yet."""
    import subprocess
    import sys

    script = ("import fastagg._uninterruptible as u\n"
              "u._start_lock.acquire()  # where the main thread is while it starts the helper\n"
              "print(u.run_to_completion(lambda: 41 + 1))\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "42", (p.returncode, p.stdout, p.stderr[-2000:])


def test_the_callers_inference_mode_goes_with_the_call():
    """An AsyncServer whose model was built under ``torch.inference_mode()`` and used there from the main thread:
    its writes happen on the helper, which must be in inference mode too (else torch refuses "Inplace update to
    inference tensor outside InferenceMode" on every step: a reviewer's find); grad mode goes along as before."""
    import torch

    from fastagg import server
    from fastagg.asynchronous import AsyncServer, Constant

    assert run_to_completion(torch.is_inference_mode_enabled) is False
    with torch.inference_mode():
        assert run_to_completion(torch.is_inference_mode_enabled) is True
        w = torch.zeros(4)
        srv = AsyncServer(server.FedAvg(w), buffer_size=1, staleness=Constant())
        srv.submit(torch.ones(4), 0)
        assert srv.version == 1 and torch.equal(w, torch.ones(4))
    with torch.no_grad():
        assert run_to_completion(torch.is_grad_enabled) is False
