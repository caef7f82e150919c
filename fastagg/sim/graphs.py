"""The simulator's local step replayed from a CUDA graph.

A batched local step -- every participant's losses and gradients (``torch.func.vmap`` over the model: ~200 kernels
for pfl-research's CNN) and the fused client step -- is captured once per round shape and replayed: one launch
instead of hundreds. On an H200, pfl-research's CIFAR-10 round (50 clients, 5 steps) went from 33.7 ms eager to
24.7 ms (bench/RESULTS.md), 26x a per-client torch loop instead of 19.5x.

The step reads its inputs from static buffers (the participants' params, the batch, the per-client lr), which each
call fills first. The first ``WARMUP`` calls of a shape run eagerly on a side stream (they are real steps, and they
let cuDNN and cuBLAS settle their workspaces, as capture requires), the next is captured and then replayed, and every
later call replays. Only client rules without per-client state take this path (``GRAPHED_RULES``): a stateful rule
indexes its state by the round's client ids, which changes the graph's addresses every round. A capture that fails
(an operation that needs the host) turns the graph off for that shape, and the step runs eagerly from then on.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

GRAPHED_RULES = ("sgd", "sps")
WARMUP = 2


class StepGraphs:
    """Captured local steps, one per (participants, batch shape, dtype), for one run on one CUDA device."""

    def __init__(self, step: Callable):
        """``step(x, xb, yb, mask, lr)``: one local step of every row of ``x`` in place (lr: float64 [M])."""
        self._step = step
        self._shapes: dict = {}

    def start(self, x0: torch.Tensor, batch: tuple) -> "_Shape":
        """The static buffers for a round whose participants start from ``x0`` [M, d] and whose batches look like
        ``batch`` (xb, yb, mask); ``x0`` is copied in."""
        key = (tuple(x0.shape), x0.dtype) + tuple((tuple(t.shape), t.dtype) for t in batch)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = _Shape(self._step, x0, batch)
        shape.x.copy_(x0)
        return shape


class _Shape:
    def __init__(self, step: Callable, x0: torch.Tensor, batch: tuple):
        self._step = step
        self.x = torch.empty_like(x0)
        self._batch = tuple(torch.empty_like(t) for t in batch)
        self._lr = torch.empty(x0.shape[0], dtype=torch.float64, device=x0.device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._eager_calls = 0
        self._failed = False

    def step(self, batch: tuple, lr: float) -> None:
        """One local step of ``self.x`` on ``batch`` with learning rate ``lr``."""
        for dst, src in zip(self._batch, batch):
            dst.copy_(src)
        self._lr.fill_(lr)
        if self._failed:
            self._run()
        elif self._graph is not None:
            self._graph.replay()
        elif self._eager_calls < WARMUP:
            self._eager_calls += 1
            side = torch.cuda.Stream(self.x.device)
            side.wait_stream(torch.cuda.current_stream(self.x.device))
            with torch.cuda.stream(side):
                self._run()
            torch.cuda.current_stream(self.x.device).wait_stream(side)
        else:
            self._capture()

    def _run(self) -> None:
        self._step(self.x, *self._batch, self._lr)

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._run()
        except Exception as e:  # noqa: BLE001 (any capture failure: the eager step still works)
            warnings.warn(f"fastagg.sim: the local step could not be captured in a CUDA graph ({e}); it runs "
                          "eagerly", RuntimeWarning, stacklevel=3)
            self._failed = True
            torch.cuda.synchronize(self.x.device)
            self._run()
            return
        self._graph = graph
        graph.replay()  # capture records the step; this runs it
