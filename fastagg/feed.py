"""Feeding a GPU :class:`~fastagg.Accumulator` from host memory, with the host-to-device copy of the next client
overlapping the fold of the current one.

Client updates reach a server in host memory (sockets, files). ``HostFeeder`` keeps two pinned host staging
buffers and two device buffers; ``add(update)`` copies the update into a free pinned buffer (no copy when the
update *is* that buffer: :meth:`HostFeeder.buffer` hands it out for a receive to write into), starts its
host-to-device copy on a copy stream, and only then folds the client before it on the compute stream. The fold of
client k and the copy of client k+1 run at once, so a round is bound by the PCIe link, not by link + fold::

    feeder = fastagg.HostFeeder(acc)              # acc = fastagg.Accumulator(like=w_on_gpu), flat
    for update, n, node in arriving():            # host tensors / numpy arrays of acc.numel elements
        feeder.add(update, n, client_id=node)
    report = feeder.flush()                       # folds the last one; which clients were folded or refused
    acc.fedexp_step(eps=1e-3, params=w_on_gpu)

A client is folded one ``add`` later than it is given (its copy must be in flight first), so refusals (NaN/Inf,
overflow, a resent id) are reported by :meth:`flush` rather than raised by ``add``; ``flush`` must be called
before the accumulator is read. On a CPU accumulator the feeder folds at once (nothing to overlap).

Receive into :meth:`buffer` where you can: on an H200 (bench/RESULTS.md) a client staged there costs 1.03x a bare
pinned host-to-device copy of its bytes, while an update in pageable memory first takes the host's copy into
pinned memory, which ran at 35-45 GB/s on 16 threads against the link's 55 GB/s (1.8x per client; staging in
chunks so that link and host overlap was slower, both then contending for host memory). Flat
accumulators only (``like`` a 1-D tensor): flatten models with :mod:`fastagg.flat`. A feeder belongs to one thread;
threads that receive updates at once each use their own feeder on the shared accumulator (its adds are thread-safe).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .stream import Accumulator


@dataclass
class FeedReport:
    """What :meth:`HostFeeder.flush` returns: the ids (or arrival numbers, for clients given without an id) of the
    clients folded and of those refused, with the reason."""

    folded: list = field(default_factory=list)
    refused: list = field(default_factory=list)  # (id, reason)


class HostFeeder:
    """Double-buffered host-to-device feeding of ``acc`` (see the module docstring)."""

    def __init__(self, acc: Accumulator):
        if not isinstance(acc, Accumulator):
            raise TypeError(f"HostFeeder feeds an Accumulator, got {type(acc).__name__}")
        if acc._form.kind != "flat" or len(acc._form.shapes[0]) != 1 or acc._form.numpy:
            raise ValueError("HostFeeder feeds flat accumulators (like a 1-D torch tensor); flatten the model first "
                             "(fastagg.flat)")
        self.acc = acc
        self._cuda = acc.device.type == "cuda"
        self._count = 0
        self._report = FeedReport()
        self._pending: tuple | None = None  # (slot, weight, id) of the client copied but not folded
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(device=acc.device)
            self._pinned: list = [None, None]
            self._device: list = [None, None]
            self._copied = [torch.cuda.Event(), torch.cuda.Event()]
            self._read = [None, None]  # event after the fold that last read each device buffer
            self._next = 0

    def buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The pinned host buffer the next :meth:`add` will copy from, for a receive to write the update into (then
        ``add(buffer, ...)`` copies nothing on the host). Valid until that ``add``. CPU accumulators: a fresh
        tensor."""
        if not self._cuda:
            return torch.empty(self.acc.numel, dtype=dtype)
        k = self._next
        self._wait_host(k)
        return self._staging(k, dtype)

    def add(self, update: Any, weight: float = 1.0, *, client_id: Any = None) -> None:
        """Stage one client's update (host tensor or numpy array of ``acc.numel`` elements, the accumulator's
        dtype) and fold the client before it. Validation of the update itself happens at its fold."""
        x = torch.from_numpy(np.ascontiguousarray(update)) if isinstance(update, np.ndarray) else update
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"update must be a tensor or a numpy array, got {type(update).__name__}")
        if x.device.type != "cpu":
            raise ValueError(f"update is on {x.device}; HostFeeder takes host memory (use acc.add for device data)")
        if x.numel() != self.acc.numel:
            raise ValueError(f"update has {x.numel()} elements; the accumulator holds {self.acc.numel}")
        if x.dtype != self.acc._dtype:
            raise TypeError(f"update has dtype {x.dtype}; the accumulator's like has {self.acc._dtype}")
        name = client_id if client_id is not None else self._count
        self._count += 1
        if not self._cuda:
            self._fold(x.reshape(-1), weight, client_id, name)
            return
        k = self._next
        self._next ^= 1
        self._wait_host(k)
        pinned = self._staging(k, x.dtype)
        if x.data_ptr() != pinned.data_ptr():
            pinned.copy_(x.reshape(-1))
        dev = self._device[k]
        with torch.cuda.stream(self._copy_stream):
            if self._read[k] is not None:
                self._copy_stream.wait_event(self._read[k])  # the fold that read this device buffer is done
            dev.copy_(pinned, non_blocking=True)
            self._copied[k].record(self._copy_stream)
        previous, self._pending = self._pending, (k, weight, client_id, name)
        if previous is not None:
            self._fold_slot(*previous)

    def flush(self) -> FeedReport:
        """Fold the last staged client; returns (and forgets) the report of every client since the last flush."""
        if self._pending is not None:
            previous, self._pending = self._pending, None
            self._fold_slot(*previous)
        report, self._report = self._report, FeedReport()
        return report

    # -- internals ------------------------------------------------------------------------------------------------
    def _staging(self, k: int, dtype: torch.dtype) -> torch.Tensor:
        if self._pinned[k] is None or self._pinned[k].dtype != dtype:
            self._pinned[k] = torch.empty(self.acc.numel, dtype=dtype, pin_memory=True)
            self._device[k] = torch.empty(self.acc.numel, dtype=dtype, device=self.acc.device)
            self._read[k] = None
        return self._pinned[k]

    def _wait_host(self, k: int) -> None:
        """Before the host writes pinned buffer k: its last host-to-device copy has finished."""
        if self._pinned[k] is not None:
            self._copied[k].synchronize()

    def _fold_slot(self, k: int, weight, client_id, name) -> None:
        torch.cuda.current_stream(self.acc.device).wait_event(self._copied[k])
        self._fold(self._device[k], weight, client_id, name)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.acc.device))
        self._read[k] = ev

    def _fold(self, x: torch.Tensor, weight, client_id, name) -> None:
        try:
            ok = self.acc.add(x, weight, on_nonfinite="skip", client_id=client_id)
        except (TypeError, ValueError) as e:
            self._report.refused.append((name, str(e)))
            return
        if ok:
            self._report.folded.append(name)
        else:
            self._report.refused.append((name, "contains NaN or Inf, or would overflow the running sum"))


__all__ = ["HostFeeder", "FeedReport"]
