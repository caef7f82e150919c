"""Run a call to completion even when a signal interrupts its caller.

CPython runs signal handlers (Ctrl-C's ``KeyboardInterrupt``, a timer whose handler raises) in the main thread only,
between bytecodes, so a state change spread over several statements can be cut in the middle. A call made from the
main thread through :func:`run_to_completion` runs on one helper thread instead: the caller waits, a signal
interrupts only the wait (the exception reaches the caller at once), and the call itself finishes and commits.
Calls from the main thread run on the helper one after another in the order made, so a call made after an
interrupted one sees everything the interrupted one did. Calls from other threads (where no handler runs) run
directly. The helper never waits on anything the caller holds: the caller waits on a lock the helper releases.
The call runs under the caller's torch grad mode and, once CUDA is initialized, its current device and stream
(thread-local in torch, so a helper thread would otherwise launch on device 0's default stream).

Exit: when the interrupted main thread ends the program (an uncaught ``KeyboardInterrupt``, SIGTERM's handler
calling ``sys.exit``), the helper finishes the call it is running and then stops, and the interpreter waits for it
(the helper is not a daemon thread; a ``threading`` exit hook, run before non-daemon threads are joined, tells it to
stop). A daemon helper would still be inside a kernel that released the GIL when the interpreter finalizes; taking
the GIL back then ends the thread with ``pthread_exit``, whose forced unwinding through pybind11's
``gil_scoped_release`` destructor (noexcept) calls ``std::terminate``: "terminate called without an active
exception" and SIGABRT instead of the Python exception.
"""
from __future__ import annotations

import contextlib
import functools
import os
import queue
import sys
import threading

_tasks: queue.SimpleQueue | None = None
_start_lock = threading.Lock()
_STOP = None  # put on the queue at exit: the helper returns after the calls before it


# The caller waits in slices of _WAIT_SLICE_S. A signal sent to the process is usually delivered to the main thread
# and interrupts its wait at once; but the kernel may deliver it to the helper (or any thread), whose C handler only
# sets a flag that a main thread blocked in its wait notices only after the call. Waking every slice, the main
# thread runs the pending handler within one. (Blocking the signals on the helper instead would be inherited by every process a hook or
# staleness function started from it: a child that SIGINT and SIGTERM could not stop.)
_WAIT_SLICE_S = 0.05


def _serve(tasks: queue.SimpleQueue) -> None:
    while (task := tasks.get()) is not _STOP:
        fn, args, kwargs, context, box, done = task
        try:
            with context():
                box.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # handed to the caller, who raises it
            box.append((False, e))
        finally:
            del fn, args, kwargs, context, task  # hold nothing of the call while waiting for the next
            done.release()


def _stop_at_exit(tasks: queue.SimpleQueue) -> None:
    """The exit hook: the helper stops after the calls already queued; later calls run directly (``_helper``)."""
    global _tasks
    with _start_lock:
        if _tasks is tasks:
            _tasks = None
    tasks.put(_STOP)


def _helper() -> queue.SimpleQueue | None:
    """The helper's queue, the helper started on first use; None once the interpreter is exiting."""
    global _tasks
    # Only the main thread takes _start_lock (here and in the exit hook). Held when it tries: a signal handler
    # interrupted the main thread while it started or stopped the helper (Thread.start waits on an Event, where
    # signals run), and the handler itself makes a call (a SIGTERM handler taking a checkpoint). Waiting would wait on
    # itself forever; the handler's call runs directly instead.
    if not _start_lock.acquire(blocking=False):
        return None
    try:
        if _tasks is None:
            tasks = queue.SimpleQueue()
            # Not a daemon: at exit the interpreter joins it after the exit hook below has queued _STOP, so no call
            # is still in a kernel when the interpreter finalizes (module docstring, "Exit").
            try:
                threading._register_atexit(_stop_at_exit, tasks)
            except RuntimeError:  # called while the interpreter exits (an atexit handler): no helper any more
                return None
            threading.Thread(target=_serve, args=(tasks,), name="fastagg-uninterruptible", daemon=False).start()
            _tasks = tasks
        return _tasks
    finally:
        _start_lock.release()


def _forget_helper_after_fork() -> None:
    global _tasks, _start_lock
    _tasks, _start_lock = None, threading.Lock()  # the child has no helper thread: start its own when needed


os.register_at_fork(after_in_child=_forget_helper_after_fork)


def _callers_context():
    """A context manager factory re-creating the calling thread's torch state that is thread-local."""
    torch = sys.modules.get("torch")
    if torch is None:
        return contextlib.nullcontext
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    cuda = torch.cuda.is_initialized()
    device, stream = (torch.cuda.current_device(), torch.cuda.current_stream()) if cuda else (None, None)

    def context():
        stack = contextlib.ExitStack()
        if inference:  # (a model built under inference_mode is written in place only inside it)
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(grad))
        if cuda:
            stack.enter_context(torch.cuda.device(device))
            stack.enter_context(torch.cuda.stream(stream))
        return stack

    return context


def run_to_completion(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, finished even if a signal interrupts the calling (main) thread; returns its result
    or raises its exception."""
    if threading.current_thread() is not threading.main_thread() or (tasks := _helper()) is None:
        return fn(*args, **kwargs)
    done = threading.Lock()
    done.acquire()
    box: list = []
    tasks.put((fn, args, kwargs, _callers_context(), box, done))
    while not done.acquire(timeout=_WAIT_SLICE_S):  # a signal raises here; the helper finishes the call all the same
        pass
    ok, value = box[0]
    if ok:
        return value
    raise value


def uninterruptible(method):
    """Decorator: the method runs through :func:`run_to_completion`."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        return run_to_completion(method, *args, **kwargs)

    return wrapper
