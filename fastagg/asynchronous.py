"""Asynchronous buffered aggregation: FedBuff (Nguyen et al., AISTATS 2022) and FedAsync (Xie et al., 2019) on the
streaming :class:`fastagg.Accumulator`, with any :mod:`fastagg.server` optimizer as the server step.

Updates arrive at any time, each trained from some earlier model version. An update trained from version ``v``
arriving while the server is at version ``V`` has staleness ``s = V - v``; it is folded into the current buffer
with the coefficient ``n_i * staleness(s)`` (``n_i`` the client's own weight) while the buffer's total weight grows
by ``n_i`` alone, so after ``K`` updates (``buffer_size``) the server optimizer steps on

    mean = sum_i n_i s(tau_i) delta_i / sum_i n_i          (FedBuff: n_i = 1 gives the paper's sum_i s(tau_i) delta_i / K)

and the version advances (``normalize="flsim"``: on FLSim's undivided sum instead, a partial buffer's too; FLSim's
staleness normalisation is ``Polynomial(a, avg_staleness=1)``: docs/ASYNC.md lists every difference from FLSim).
``buffer_size=1`` with ``FedAvg(lr=alpha)`` is FedAsync's ``w <- w + alpha s(tau) (w_i - w_tau)`` (the update
against the model the client started from: FLSim's ``fed_buff_aggregation`` direction, which FLSim found to train
better than the paper's ``w_i - w``). Staleness rules (FLSim's and the papers'
names): :class:`Constant`, :class:`Polynomial` ``(1 + s)^-a`` (FedBuff's ``a = 0.5``), :class:`Hinge` (FedAsync's),
:class:`Threshold` (FLSim's). Updates older than ``max_staleness`` are refused.

Threads: many request threads may :meth:`AsyncServer.submit` at once (their folds combine in the Accumulator's
sweeps). Each submit reserves a slot in the first buffer with room, so a buffer never holds more than ``K``
updates; the submit that completes a buffer steps it, and buffers step in the order they filled, one step at a
time. An update that arrives during a step goes into the next buffer: never lost, never counted twice. A failed
fold (NaN, Inf) frees its slot. No buffer's content can stop the server (one client must never stop the others):
a buffer whose total weight is 0 when it is due (every client sent weight 0) takes no step and is discarded, and
so is a buffer the optimizer refuses for its numbers (a ValueError of the step while the optimizer's
hyperparameters are valid: its statistics or its step overflow); the version stays, the ids stay folded, and the
discard is reported (:attr:`SubmitResult.discarded`, :attr:`AsyncServer.discarded`). Weights too small to
normalise by (below :attr:`AsyncServer.min_weight`, other than 0) are refused at submit. Any other failed step (a
hyperparameter set to an invalid value, the parameters replaced, any error not a ValueError) keeps its buffer, its
ids and the version: the next submit or flush steps it again. :meth:`fetch` returns the model and its version
consistently (never half a step). The staleness is measured when the update is submitted. A client id is folded
at most once per version it trained from. :meth:`state_dict` / :meth:`load_state_dict` save and restore the
buffers (with the ids of their updates), the version and the optimizer: a consistent copy while threads submit, an
atomic restore that checks the buffers against the ids.

Signals: a Ctrl-C (or a timer whose handler raises) during a call from the main thread interrupts only the wait:
the call (a fold, a step, a restore) runs to completion on a helper thread, so no update is half-folded or lost and
no buffer is dropped; the next call from the main thread sees all it did, and a program that the signal ends waits
for it at exit (:mod:`fastagg._uninterruptible`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Any

import torch

from ._checks import check_int, check_number
from ._uninterruptible import uninterruptible
from .server import ServerOptimizer
from .stream import Accumulator

__all__ = ["AsyncServer", "SubmitResult", "Constant", "Polynomial", "Hinge", "Threshold", "StaleUpdate", "StepError"]


class StaleUpdate(ValueError):
    """An update trained from a version older than the server's ``max_staleness`` allows (or a version from the
    future): refused, nothing folded."""


class StepError(RuntimeError):
    """A submit folded its update, but the server step that update completed raised (the optimizer's error is the
    ``__cause__``; a failure that is not of the buffer's content: an invalid hyperparameter, the parameters
    replaced): the buffer stays queued with its updates, ids and the version (the next submit or ``flush`` steps
    it). ``result`` is the submit's :class:`SubmitResult` (``folded`` True; ``stepped``: any versions
    produced before the failing step). Not a ValueError: those mean that nothing was folded."""

    def __init__(self, message: str, result: "SubmitResult"):
        super().__init__(message)
        self.result = result


# -- staleness rules ---------------------------------------------------------------------------------------------
class _Staleness:
    def __call__(self, s: int) -> float:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class Constant(_Staleness):
    """``s(tau) = 1``: every update counts the same, however stale (FLSim's ``ConstantStalenessWeight``)."""

    def __call__(self, s: int) -> float:
        return 1.0


class Polynomial(_Staleness):
    """``s(tau) = (1 + tau)^-exponent`` (FedBuff's choice with ``exponent = 0.5``; FedAsync's polynomial; FLSim's
    ``PolynomialStalenessWeight``, whose exponent is in [0, 1]).

    ``avg_staleness`` (default 0: a fresh update weighs 1) divides by the rule's value there, as FLSim does:
    ``s(tau) = ((1 + tau) / (1 + avg_staleness))^-exponent``; FLSim's default is ``avg_staleness=1`` (a fresh
    update weighs ``2^exponent``; docs/ASYNC.md)."""

    def __init__(self, exponent: float = 0.5, *, avg_staleness: int = 0):
        self.exponent = check_number(exponent, "exponent")
        self.avg_staleness = check_int(avg_staleness, "avg_staleness")

    def __call__(self, s: int) -> float:
        return ((1.0 + s) / (1.0 + self.avg_staleness)) ** -self.exponent


class Hinge(_Staleness):
    """FedAsync's hinge: ``s(tau) = 1`` for ``tau <= b``, else ``1 / (a (tau - b) + 1)``."""

    def __init__(self, a: float = 10.0, b: int = 4):
        self.a = check_number(a, "a")
        self.b = check_int(b, "b")

    def __call__(self, s: int) -> float:
        return 1.0 if s <= self.b else 1.0 / (self.a * (s - self.b) + 1.0)


class Threshold(_Staleness):
    """FLSim's ``ThresholdStalenessWeight``: 1 up to ``cutoff``, ``value_after_cutoff`` beyond; divided, as FLSim
    does, by its value at ``avg_staleness`` (default 0, FLSim's 1: the same unless ``cutoff`` is 0)."""

    def __init__(self, cutoff: int, value_after_cutoff: float = 0.0, *, avg_staleness: int = 0):
        self.cutoff = check_int(cutoff, "cutoff")
        self.value_after_cutoff = check_number(value_after_cutoff, "value_after_cutoff")
        self.avg_staleness = check_int(avg_staleness, "avg_staleness")
        if self._raw(self.avg_staleness) == 0:
            raise ValueError(f"Threshold's value at avg_staleness={avg_staleness} is 0 (value_after_cutoff=0 beyond "
                             f"cutoff={cutoff}): it cannot be divided by")

    def _raw(self, s: int) -> float:
        return 1.0 if s <= self.cutoff else self.value_after_cutoff

    def __call__(self, s: int) -> float:
        return self._raw(s) / self._raw(self.avg_staleness)


@dataclasses.dataclass
class SubmitResult:
    """What :meth:`AsyncServer.submit` did: ``folded`` (False: a NaN/Inf update with ``on_nonfinite="skip"``), the
    update's ``staleness`` and staleness weight, ``stepped``: the versions this call's step(s) produced (empty
    when it only folded), and ``discarded``: ``(updates, why)`` of each buffer this call discarded instead of
    stepping on it (its total weight was 0, or the optimizer refused its numbers)."""

    folded: bool
    staleness: int
    staleness_weight: float
    stepped: list
    discarded: list = dataclasses.field(default_factory=list)


_DISCARDED = object()  # what _step_one returns for a head it discarded


class _Buffer:
    """One buffer of K slots: an Accumulator, the slots reserved by submits still folding, the updates folded."""

    def __init__(self, acc: Accumulator):
        self.acc = acc
        self.reserved = 0
        self.folded = 0
        self.ids: list = []  # (version trained from, client id) of each update folded here with a client id
        self.stepping = False  # its step is running: no new slot in it (it stays queued until the step succeeds)


def _zeros_like(like: Any) -> Any:
    if isinstance(like, torch.Tensor):
        return torch.zeros_like(like)
    if isinstance(like, dict):
        return {k: torch.zeros_like(v) for k, v in like.items()}
    return [torch.zeros_like(v) for v in like]


def _refused_content(opt, head: _Buffer) -> bool:
    """After the step of optimizer ``opt`` on ``head`` raised a ValueError: True when the buffer's numbers were
    refused (the optimizer's hyperparameters are valid and the accumulator fits its parameters), False when the
    failure is the optimizer's own (kept and retried)."""
    try:
        opt._check_group()
    except Exception:  # noqa: BLE001 (an invalid hyperparameter, however the check says it)
        return False
    return head.acc.device == opt.device and head.acc.numel == opt._p.segments.numel


def _version(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise StaleUpdate(f"version must be a whole number >= 0 (the model version the client trained from), "
                              f"got {v!r}")
    if v < 0:
        raise StaleUpdate(f"version must be >= 0, got {v}")
    return v


class AsyncServer:
    """A FedBuff / FedAsync server around ``optimizer`` (any :mod:`fastagg.server` optimizer; module docstring).

    Args:
        optimizer: the server step taken after every ``buffer_size`` updates (FedBuff: ``FedAvgM`` or ``FedAdam``
            are the common choices; FedAsync: ``FedAvg(lr=alpha)`` with ``buffer_size=1``).
        buffer_size: K, the updates per step.
        staleness: the staleness rule (default ``Polynomial(0.5)``, FedBuff's).
        max_staleness: updates staler than this are refused (:class:`StaleUpdate`); None: no bound.
        on_nonfinite: an update holding NaN or Inf raises (``"raise"``) or is dropped (``"skip"``); either way
            nothing of it is folded.
        normalize: what a step's pseudo-gradient is divided by. ``"weights"`` (default): the buffer's total client
            weight, ``sum_i n_i s(tau_i) delta_i / sum_i n_i`` (the paper's ``/ K`` for ``n_i = 1``; a partial
            buffer's :meth:`flush` divides by the weight it holds). ``"flsim"``: nothing, FLSim's FedBuff
            (``ReductionType.WEIGHTED_SUM``): ``sum_i n_i s(tau_i) delta_i``, a partial buffer's flush too (pass
            FLSim's example weight as ``weight``; its lr is then ours / K for the same full-buffer step).
            docs/ASYNC.md compares the two.

    Attributes:
        min_weight: with ``normalize="weights"``, the smallest positive ``weight`` a submit takes (the square root
            of the smallest normal number of the accumulator's compute dtype: 1.1e-19 in float32): a buffer of
            smaller weights has a total weight whose reciprocal overflows, and its step would be NaN. 0 is taken
            (the update counts for nothing). With ``"flsim"`` the weight only scales the update: any is taken.
        discarded: ``(version, updates, why)`` of every buffer discarded instead of stepped (module docstring).
    """

    def __init__(self, optimizer, *, buffer_size: int = 10, staleness: _Staleness | None = None,
                 max_staleness: int | None = None, on_nonfinite: str = "raise", normalize: str = "weights"):
        if not isinstance(optimizer, ServerOptimizer):
            raise TypeError(f"optimizer must be a fastagg.server optimizer, got {type(optimizer).__name__}")
        if optimizer.aggregate is not None:
            raise TypeError("the asynchronous server folds updates into running sums; an optimizer whose aggregate= "
                            "needs every update at once (robust rules, DP mechanisms) cannot step on them")
        buffer_size = check_int(buffer_size, "buffer_size", minimum=1)
        if max_staleness is not None:
            max_staleness = check_int(max_staleness, "max_staleness", what="an integer >= 0 or None")
        if staleness is None:
            staleness = Polynomial(0.5)
        if not callable(staleness):
            raise TypeError(f"staleness must be a staleness rule (Constant, Polynomial, Hinge, Threshold), got "
                            f"{type(staleness).__name__}")
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
        if normalize not in ("weights", "flsim"):
            raise ValueError(f"normalize must be 'weights' or 'flsim', got {normalize!r}")
        self.normalize = normalize
        self.optimizer, self.buffer_size, self.staleness = optimizer, buffer_size, staleness
        self.max_staleness, self.on_nonfinite = max_staleness, on_nonfinite
        self.version = 0
        self._like = optimizer.broadcast()
        self._lock = threading.Lock()       # the version, the buffers' slots and counts, the ids
        self._quiet = threading.Condition(self._lock)  # state_dict waits on it for the folds under way to end
        self._pausing = False               # state_dict is waiting: submits take no new slot until it has its copy
        self._step_lock = threading.Lock()  # one step at a time; fetch reads the model under it
        self._buffers: list[_Buffer] = [self._new_buffer()]
        self._ids: dict[int, set] = {}      # version trained from -> client ids folded (or folding)
        self.min_weight = math.sqrt(torch.finfo(self._buffers[0].acc.compute_dtype).tiny) \
            if normalize == "weights" else 0.0
        self.discarded: list[tuple[int, int, str]] = []
        self._dropped_ids: list = []  # client ids from the current version of updates discarded since the last step

    def _new_buffer(self) -> _Buffer:
        return _Buffer(Accumulator(like=self._like, backend=self.optimizer._backend.name))

    # -- the clients' side -------------------------------------------------------------------------------------
    @uninterruptible
    def fetch(self) -> tuple[Any, int]:
        """``(model, version)``: a copy of the current model (the optimizer's ``broadcast()`` form) and its version,
        read between steps."""
        with self._step_lock:
            model = self.optimizer.broadcast()
            if isinstance(model, torch.Tensor):
                model = model.detach().clone()
            elif isinstance(model, dict):
                model = {k: v.detach().clone() for k, v in model.items()}
            else:
                model = [v.detach().clone() for v in model]
            return model, self.version

    @uninterruptible
    def submit(self, delta: Any, version: Any, *, weight: float = 1.0, client_id: Any = None,
               base: Any = None) -> SubmitResult:
        """Fold one client's update (``delta``: its update against the model of ``version``, in the model's form;
        with ``base`` its full model and the model it started from). Steps the server when this update completes a
        buffer (and any later buffer already full). Raises :class:`StaleUpdate` for a version from the future, a
        negative or fractional one, or one staler than ``max_staleness``; ``ValueError`` for a client id already
        folded from this version, or (``on_nonfinite="raise"``) an update with NaN/Inf. Nothing is folded then.
        :class:`StepError` when the update was folded but the step it completed failed (and kept its buffer); a
        buffer discarded instead of stepped is reported in the result's ``discarded``. ``ValueError`` for a weight
        above 0 but below :attr:`min_weight`."""
        v = _version(version)
        w = check_number(weight, "weight")
        if 0 < w < self.min_weight:
            raise ValueError(f"weight={w!r} is too small to normalise by: a buffer's total weight must have a finite "
                             f"reciprocal; give 0 or a weight >= {self.min_weight:.3g}")
        with self._lock:
            self._quiet.wait_for(lambda: not self._pausing)
            if v > self.version:
                raise StaleUpdate(f"version {v} is from the future: the server is at version {self.version}")
            s = self.version - v
            if self.max_staleness is not None and s > self.max_staleness:
                raise StaleUpdate(f"the update is {s} versions stale (trained from {v}, the server is at "
                                  f"{self.version}); max_staleness={self.max_staleness}")
            factor = float(self.staleness(s))
            if not math.isfinite(factor) or factor < 0:
                raise ValueError(f"the staleness rule gave {factor!r} for staleness {s}")
            if client_id is not None:
                seen = self._ids.setdefault(v, set())
                if client_id in seen:
                    raise ValueError(f"client {client_id!r} was already folded from version {v}")
                seen.add(client_id)
            buf = next((b for b in self._buffers if not b.stepping and b.reserved + b.folded < self.buffer_size),
                       None)
            if buf is None:
                buf = self._new_buffer()
                self._buffers.append(buf)
            buf.reserved += 1
        folded = False
        # "flsim": every update adds 1/K to the buffer's total weight, so a full buffer's mean is the plain sum
        fold_weight, fold_scale = (w, factor) if self.normalize == "weights" else \
            (1.0 / self.buffer_size, self.buffer_size * w * factor)
        try:
            folded = buf.acc.add(delta, fold_weight, base=base, on_nonfinite=self.on_nonfinite, scale=fold_scale)
        finally:
            with self._lock:
                buf.reserved -= 1
                if folded:
                    buf.folded += 1
                    if client_id is not None:
                        buf.ids.append((v, client_id))
                elif client_id is not None and v in self._ids:  # (a step may have forgotten v meanwhile)
                    self._ids[v].discard(client_id)
                if self._pausing:
                    self._quiet.notify_all()
        result = SubmitResult(folded, s, factor, [])
        if folded:
            try:
                self._step_full_buffers(result.stepped, result.discarded)
            except Exception as e:  # the update is in; only the step failed (a signal's exception passes as is)
                raise StepError(f"the update was folded, but the server step it completed failed ({e!r}); the "
                                f"buffer stays queued and steps at the next submit or flush", result) from e
        return result

    # -- the server's side -------------------------------------------------------------------------------------
    def _step_full_buffers(self, produced: list, discarded: list) -> None:
        """Step every full buffer at the head of the queue, in order; appends the versions produced and the
        buffers discarded."""
        while (v := self._step_head(minimum=self.buffer_size, discarded=discarded)) is not None:
            produced.append(v)

    def _step_head(self, *, minimum: int, discarded: list) -> int | None:
        """Step on the head buffer if it holds at least ``minimum`` folded updates and none still folding; returns
        the version that step produced (read under the lock: another thread may step right after), or None. A head
        discarded instead (:meth:`_step_one`) is reported in ``discarded`` and the next head considered in its
        place."""
        while (v := self._step_one(minimum=minimum, discarded=discarded)) is _DISCARDED:
            pass
        return v

    def _step_one(self, *, minimum: int, discarded: list) -> Any:
        """Step on the head buffer as :meth:`_step_head` says; ``_DISCARDED`` when its content cannot be stepped on.
        The step lock is taken before the head is chosen, so buffers step in the order they filled, one at a time.

        A head whose content cannot be stepped on is discarded (``(updates, why)`` appended to ``discarded``, the
        version stays, its clients stay folded): one whose total weight is 0, and one the optimizer refuses with a
        ValueError while its hyperparameters are valid and the accumulator fits its parameters (its statistics or
        its step overflow: the same numbers would fail every retry, forever). Any other failure (an invalid
        hyperparameter, the parameters replaced or moved, an error not a ValueError) leaves the buffer, its
        updates, its clients' ids and the version as they were, and the next submit or :meth:`flush` steps it
        again. (The submit that completed the buffer then raises :class:`StepError`: its update is folded, retried
        with the same client id it is refused as already folded, so nothing is counted twice.)"""
        with self._step_lock:
            with self._lock:
                head = self._buffers[0]
                if head.folded < max(minimum, 1) or head.reserved:
                    return None
                head.stepping = True  # a partial head (flush) takes no new update while it steps
            why = None
            if self.normalize == "weights" and not head.acc.total_weight > 0:
                why = "its total weight is 0 (every update in it has weight 0)"
            else:
                try:
                    self.optimizer.step(self._summed(head))
                except ValueError as e:
                    if not _refused_content(self.optimizer, head):
                        with self._lock:
                            head.stepping = False
                        raise
                    why = f"the optimizer refused its numbers ({e})"
                except BaseException:
                    with self._lock:
                        head.stepping = False
                    raise
            with self._lock:
                self._buffers.pop(0)
                if not self._buffers:
                    self._buffers.append(self._new_buffer())
                if why is not None:
                    discarded.append((head.folded, why))
                    self.discarded.append((self.version, head.folded, why))
                    self._dropped_ids.extend(cid for v, cid in head.ids if v == self.version)
                    self._forget_ids()  # (ids kept only while their update was pending)
                    return _DISCARDED
                self.version += 1
                self._dropped_ids = []
                self._forget_ids()
                return self.version

    def _summed(self, head: _Buffer) -> Accumulator:
        """What the step takes: the buffer's accumulator; with ``normalize="flsim"`` a partial buffer's (a flush)
        is padded to the total weight 1 of a full one by a zero update in a copy (the buffer stays as it was, for a
        step that fails), so its step is the plain sum too."""
        if self.normalize == "weights" or head.folded >= self.buffer_size:
            return head.acc
        padded = self._new_buffer().acc
        padded.merge(head.acc)
        zero = _zeros_like(self._like)
        padded.add(zero, (self.buffer_size - head.folded) / self.buffer_size)
        return padded

    def _forget_ids(self) -> None:
        """Ids of versions no update can come from any more (staler than max_staleness) are dropped, but for those
        of updates still pending in a buffer (every pending id is in ``_ids``: :meth:`load_state_dict` checks it)."""
        if self.max_staleness is not None:
            for old in [k for k in self._ids if k < self.version - self.max_staleness]:
                pending = {cid for b in self._buffers for (v, cid) in b.ids if v == old}
                if pending:
                    self._ids[old] = pending
                else:
                    del self._ids[old]

    @property
    def pending(self) -> int:
        """Updates folded and waiting for their buffer's step."""
        with self._lock:
            return sum(b.folded for b in self._buffers)

    @uninterruptible
    def flush(self) -> bool:
        """Step on the head buffer now even if it holds fewer than K updates (the end of a run); False when it holds
        none. A head that is discarded instead (its total weight is 0, ...: module docstring) is reported in
        :attr:`discarded`, and the next buffer steps in its place."""
        return self._step_head(minimum=1, discarded=[]) is not None

    def __reduce_ex__(self, protocol):
        raise TypeError("an AsyncServer cannot be pickled or copied (it holds locks and its buffers' accumulators): "
                        "save server.state_dict() and restore it with load_state_dict()")

    @uninterruptible
    def state_dict(self) -> dict:
        """The version, the optimizer's state and every buffer's sums (updates folded but not yet stepped), the ids
        folded per version: a restarted server continues as if it had not stopped. A consistent copy while other
        threads submit: taken between steps, after the folds under way have ended (new submits wait the while), so
        every buffer's count, sums and the ids agree. (A submit that has not returned is acknowledged to no one, so
        a copy that holds it -- or a later one that does not, if it was refused -- loses nothing.)"""
        with self._quiesced():
            return {"version": self.version, "optimizer": self.optimizer.state_dict(),
                    "buffers": [{"acc": b.acc.state_dict(), "folded": b.folded, "ids": list(b.ids)}
                                for b in self._buffers],
                    "ids": {k: sorted(v, key=repr) for k, v in self._ids.items()},
                    "discarded_ids": list(self._dropped_ids),
                    "buffer_size": self.buffer_size, "normalize": self.normalize}

    @contextlib.contextmanager
    def _quiesced(self):
        """Holding both locks, with no fold under way and new submits waiting (between steps)."""
        with self._step_lock, self._lock:
            self._pausing = True
            try:
                self._quiet.wait_for(lambda: not any(b.reserved for b in self._buffers))
                yield
            finally:
                self._pausing = False
                self._quiet.notify_all()

    @uninterruptible
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`. Atomic: the version, every buffer and the ids are checked first (and against
        each other: each buffer's ids are listed in the state's ids and in no other buffer, at most ``folded`` of
        them, and every id folded from the state's version -- no step since -- is in a buffer), then the
        optimizer's state (which its own ``load_state_dict`` checks before it changes anything), and only then is
        anything of this server assigned; a bad state raises ``ValueError`` / ``TypeError`` naming what is wrong
        and leaves the server as it was."""
        if not isinstance(state, dict) or not {"version", "optimizer", "buffers", "ids"} <= set(state):
            raise ValueError("not an AsyncServer state_dict (needs version, optimizer, buffers, ids)")
        version = _version(state["version"])
        if state.get("normalize", "weights") != self.normalize:  # (its buffers' sums are of the other kind)
            raise ValueError(f"the state is of a server with normalize={state.get('normalize', 'weights')!r}; this "
                             f"one has normalize={self.normalize!r}")
        buffers = _restored_buffers(state["buffers"], self.buffer_size, self._new_buffer)
        ids = _restored_ids(state["ids"], version)
        dropped = _restored_dropped(state.get("discarded_ids", []), buffers, ids, version)
        with self._quiesced():  # (a fold under way would land in a buffer that is replaced)
            self.optimizer.load_state_dict(state["optimizer"])  # checked before it changes anything; last to fail
            self.version = version
            self._buffers = buffers or [self._new_buffer()]
            self._ids = ids
            self._dropped_ids = dropped


# -- restoring a state_dict: AsyncServer.load_state_dict's checks, in its order ---------------------------------------
def _restored_buffers(raw: Any, buffer_size: int, new_buffer) -> list:
    """The state's buffers as new ones (``new_buffer()``), each accumulator restored and its count and ids
    checked."""
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"the state's buffers must be a list, got {type(raw).__name__}")
    buffers = []
    for i, b in enumerate(raw):
        if not isinstance(b, dict) or not {"acc", "folded", "ids"} <= set(b):
            raise ValueError(f"buffer {i} of the state must be a dict with 'acc', 'folded' and 'ids' (the ids of "
                             f"its updates)")
        buf = new_buffer()
        try:
            buf.acc.load_state_dict(b["acc"])
        except (ValueError, TypeError) as e:
            raise type(e)(f"buffer {i} of the state: {e}") from e
        folded = b["folded"]
        if (not isinstance(folded, int) or isinstance(folded, bool) or not 0 <= folded <= buffer_size
                or folded != buf.acc.num_clients):
            raise ValueError(f"buffer {i} of the state holds {buf.acc.num_clients} updates but says {folded!r} "
                             f"(buffer_size {buffer_size})")
        buf.folded = folded
        if not isinstance(b["ids"], (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2
                                                              for p in b["ids"]):
            raise ValueError(f"buffer {i} of the state: its ids must be a list of (version, client id) pairs")
        if len(b["ids"]) > folded:
            raise ValueError(f"buffer {i} of the state lists {len(b['ids'])} client ids for {folded} updates")
        for p in b["ids"]:
            try:
                buf.ids.append((_version(p[0]), p[1]))
            except StaleUpdate:
                raise ValueError(f"buffer {i} of the state: {p[0]!r} is not a version") from None
        buffers.append(buf)
    return buffers


def _restored_ids(raw: Any, version: int) -> dict:
    """The state's ids folded per version (none after ``version``), as sets."""
    if not isinstance(raw, dict):
        raise ValueError(f"the state's ids must be a dict (version -> client ids), got {type(raw).__name__}")
    ids = {}
    for k, v in raw.items():
        try:
            key = _version(k)
        except StaleUpdate:
            raise ValueError(f"the state's ids are keyed by version; {k!r} is not one") from None
        if key > version:
            raise ValueError(f"the state's ids list version {key}, after the state's version {version}")
        if not isinstance(v, (list, tuple, set)):
            raise ValueError(f"the state's ids of version {key} must be a list, got {type(v).__name__}")
        try:
            ids[key] = set(v)
        except TypeError:
            raise TypeError(f"the state's ids of version {key} hold an unhashable client id") from None
        if len(ids[key]) != len(v):
            raise ValueError(f"the state's ids of version {key} list a client twice")
    return ids


def _restored_dropped(dropped: Any, buffers: list, ids: dict, version: int) -> list:
    """The state's discarded ids of ``version``, once every buffer's ids were checked against ``ids``: each pending
    update in one buffer only and listed there; every id folded from ``version`` pending or discarded (the updates
    folded from this version, then discarded)."""
    where: dict = {}  # (version, client id) -> the buffer holding it
    for i, buf in enumerate(buffers):
        for key, cid in buf.ids:
            try:
                first = where.setdefault((key, cid), i)
            except TypeError:
                raise TypeError(f"buffer {i} of the state holds an unhashable client id") from None
            if first != i or buf.ids.count((key, cid)) > 1:
                raise ValueError(f"client {cid!r} (from version {key}) is pending in buffers {first} and {i} of "
                                 f"the state: its update would step twice")
            if cid not in ids.get(key, ()):
                raise ValueError(f"buffer {i} of the state holds client {cid!r} from version {key}, which the "
                                 f"state's ids do not list")
    if not isinstance(dropped, (list, tuple)):
        raise ValueError(f"the state's discarded_ids must be a list, got {type(dropped).__name__}")
    try:
        bad = next((cid for cid in dropped if (version, cid) in where or cid not in ids.get(version, ())), None)
    except TypeError:
        raise TypeError("the state's discarded_ids hold an unhashable client id") from None
    if bad is not None:
        raise ValueError(f"the state's discarded_ids list client {bad!r} (from version {version}), which "
                         f"{'a buffer holds' if (version, bad) in where else 'the ids do not list'}")
    dropped = list(dropped)
    missing = [cid for cid in ids.get(version, ()) if (version, cid) not in where and cid not in dropped]
    if missing:
        raise ValueError(f"the state's ids list {len(missing)} client(s) folded from version {version} (the "
                         f"state's own: no step since), e.g. {missing[0]!r}, that no buffer holds (nor was "
                         f"discarded): their updates would be lost")
    return dropped
