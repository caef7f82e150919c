"""Flat combining (Hendler, Incze, Shavit and Tzafrir, SPAA 2010): many threads each bring one item to fold into
a shared structure; they queue their items, and whichever thread takes the structure's lock folds every item
queued by then in one sweep. The :class:`fastagg.Accumulator` folds concurrent adds this way (one pass over the
running sum for k clients instead of k passes); its arithmetic stays in fastagg/stream/fold.py, the concurrency is
here.

An item has ``done`` and ``finish(folded=..., error=...)``; whether it is in the structure is asked of the
structure itself (``committed(item)``), never remembered here, so an item taken by a folder that a signal
interrupted is folded by the next folder, never twice.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class FlatCombiner:
    """Queue and fold concurrent items under ``lock`` (an RLock the structure's other operations hold as well).

    ``fold_group(items)`` folds a group (each item records its own outcome, or the group is interrupted);
    ``committed(item)`` says whether the structure holds the item."""

    def __init__(self, lock: threading.RLock, fold_group: Callable[[list], None], committed: Callable[[Any], bool]):
        self.lock = lock
        self.pending: list = []
        self._qlock = threading.Lock()  # guards `pending`
        self._fold_group = fold_group
        self._committed = committed
        self._last_group, self._last_fold_s = 1, 0.0  # how many items the last fold took, and its seconds

    def join_or_fold(self, item: Any) -> None:
        """Queue ``item``, then take the lock: whoever gets it first folds every item queued by then in one sweep;
        an item already folded by another thread finds itself done and returns.

        When the last fold took several items, their threads are about to queue their next ones: the folder waits
        for as many (at most a tenth of the last fold's time, 1 ms at most; PostgreSQL's commit_delay with
        commit_siblings, for the same reason), so the items keep folding together instead of one alone, then the
        rest.

        Signal safety: no wait here can leave a lock or a condition half-taken (a lock's acquire interrupted by a
        signal raises without holding it; ``with`` releases what it took); an interrupted call withdraws its item
        unless it was folded already.
        """
        try:
            with self._qlock:
                self.pending.append(item)
            while not self.settled(item):
                with self.lock:
                    if self.settled(item):
                        break
                    self._fold_queue(item)
        except BaseException:  # interrupted (a signal): withdraw the item unless it was folded already
            with self._qlock:
                if item in self.pending:
                    self.pending.remove(item)
            raise

    def settled(self, item: Any) -> bool:
        """``item`` is done: refused, or folded (the structure holds it: its word is final)."""
        if not item.done and self._committed(item):
            item.finish(folded=True)
        return item.done

    def settle(self, items: list) -> None:
        for item in items:
            self.settled(item)

    def _fold_queue(self, mine: Any) -> None:
        """Fold every queued item (the caller holds the lock), ``mine`` among them even when an interrupted folder
        took it off the queue and never put it back."""
        deadline = time.perf_counter() + min(0.1 * self._last_fold_s, 1e-3)
        while len(self.pending) < self._last_group and time.perf_counter() < deadline:
            time.sleep(2e-5)  # no condition variable: an interrupted wait on one can leave its lock released
        with self._qlock:
            group, self.pending = self.pending, []
        if mine not in group:
            group.append(mine)
        t0 = time.perf_counter()
        try:
            self._fold_group(group)
        finally:
            self.settle(group)
            undone = [f for f in group if not f.done and f is not mine]
            if undone:  # interrupted (a signal): the others' items go to the next folder
                with self._qlock:
                    self.pending[:0] = undone
        self._last_group, self._last_fold_s = len(group), time.perf_counter() - t0
