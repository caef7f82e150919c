"""The Accumulator's round bookkeeping: what a round has folded (:class:`Round`, replaced whole, never changed), its
clients in fold order (:class:`Log`), one client on its way into the sums (:class:`Fold`) and the tokens that tell
an add its client was folded."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from ..rows import ClientRows


class Log:
    """The clients of a round in fold order, append-only: their squared norms, ids and fold tokens, with the
    positions of the ids and tokens (membership in O(1)). Only the first ``n`` entries of a :class:`Round` count;
    entries past it are what an interrupted fold appended before its round was committed, dropped by the next
    fold (so a fold costs O(its clients), not O(the round))."""

    def __init__(self):
        self.norms: list = []
        self.ids: list = []
        self.tokens: list = []
        self.id_pos: dict = {}
        self.token_pos: dict = {}

    def truncate(self, n: int) -> None:
        # the lists may differ in length past n (an append interrupted half-way); a key is in a table only once it
        # is in its list, so the lists' tails name every table entry to drop
        for keys, table in ((self.ids, self.id_pos), (self.tokens, self.token_pos)):
            for key in keys[n:]:
                if key is not None and table.get(key, -1) >= n:
                    del table[key]
        del self.norms[n:], self.ids[n:], self.tokens[n:]

    def append(self, norm: torch.Tensor, client_id: Any, token: int | None) -> None:
        i = len(self.ids)
        self.norms.append(norm)
        self.ids.append(client_id)
        self.tokens.append(token)
        if client_id is not None:
            self.id_pos[client_id] = i
        if token is not None:
            self.token_pos[token] = i


@dataclasses.dataclass(frozen=True)
class Round:
    """Everything a round has folded. It is never changed, only replaced by a new one in a single assignment, so
    a call interrupted anywhere (a signal) leaves the old round or the new one, never a mix: the sums, the client
    count and the ids always agree. ``scratch`` is the spare sum buffer (None while a step holds it as its mean);
    the first ``n`` entries of ``log`` are the round's clients (see :class:`Log`); a fold's token there tells an add
    that it was folded by a folder that was interrupted before it could say so."""

    sum: torch.Tensor
    scratch: torch.Tensor | None
    n: int
    log: Log
    weighted_sq: torch.Tensor
    buffer_sums: tuple
    total_weight: float
    zero: bool = False  # the sum is all zeros (a new round): a compressed fold writes it, reading nothing
    unwritten: bool = False  # ... and its buffer does not hold them yet (Accumulator._sum writes them when read)

    @classmethod
    def empty(cls, zeros: torch.Tensor, scratch: torch.Tensor | None, num_buffers: int) -> "Round":
        """A round of no client over ``zeros`` (all zeros: the caller zeroed it)."""
        return cls(zeros, scratch, 0, Log(), torch.zeros((), dtype=torch.float64, device=zeros.device),
                   (None,) * num_buffers, 0.0, zero=True)

    def ids(self) -> list:
        return self.log.ids[:self.n]

    def norms(self) -> list:
        return self.log.norms[:self.n]

    def norm_tensor(self, device: torch.device) -> torch.Tensor:
        """The clients' squared norms as one float64 ``(n,)`` tensor on ``device``."""
        norms = self.norms()
        if not norms:
            return torch.zeros(0, dtype=torch.float64, device=device)
        return torch.stack(norms)

    def has_id(self, client_id: Any) -> bool:
        return self.log.id_pos.get(client_id, self.n) < self.n

    def has_token(self, token: int) -> bool:
        return self.log.token_pos.get(token, self.n) < self.n

    def extended(self, entries: list, **changes) -> "Round":
        """This round with ``entries`` ((norm, id, token) each) folded in, and ``changes`` to its other fields;
        appends to the shared log (past this round's ``n``: invisible until the new round is assigned)."""
        self.log.truncate(self.n)
        for norm, client_id, token in entries:
            self.log.append(norm, client_id, token)
        fields = {"sum": self.sum, "scratch": self.scratch, "log": self.log, "weighted_sq": self.weighted_sq,
                  "buffer_sums": self.buffer_sums, "total_weight": self.total_weight}  # (dataclasses.replace: slow)
        fields.update(changes)
        return Round(n=self.n + len(entries), **fields)


_tokens = itertools.count()


@dataclasses.dataclass(eq=False)
class Fold:
    """One client on its way into the sums, and how that ended: ``folded``, or ``error`` (raised by its adder)."""

    rows: ClientRows
    weight: float
    client_id: Any
    on_nonfinite: str
    buffers: list  # its weighted buffers, float64 (state_dict clients)
    name: str | None = None  # how an error names it (add's: "delta (client N)")
    scale: float = 1.0  # the update folded is scale * delta (the round's weight grows by weight alone)
    done: bool = False
    folded: bool = False
    error: BaseException | None = None
    token: int = dataclasses.field(default_factory=lambda: next(_tokens))

    def finish(self, *, folded: bool = False, error: BaseException | None = None) -> None:
        self.folded, self.error, self.done = folded, error, True


def check_id(client_id: Any) -> None:
    if client_id is not None and (not isinstance(client_id, (str, int)) or isinstance(client_id, bool)):
        raise TypeError(f"client_id must be a str or an int, got {type(client_id).__name__}")
