"""Small loads in one kernel launch: the job's arguments in reusable pinned host memory.

Why: a CPU hit's copy is enqueued on the engine thread before the step's forward is launched,
so every host microsecond of the enqueue is on the request's first-token path. The staged path
(:mod:`pipeline`) issues ~15 CUDA calls for a one-chunk job, each costing several times its
idle time while the GPU is busy, so a one-block load's enqueue costs far more host time than
its copy takes on the GPU (docs/design-measurements.md). A small load is instead one launch of
the layer kernel over *all* layers (:mod:`direct`), reading the pinned slots and a pinned
buffer of engine block ids and slot addresses through UVA: no upload, no staging buffer, no
DMA request; the job issues a stream wait per wait event, two timing events and the launch.

A buffer is taken again only after the kernel that read it has finished (its job's ``done``
event, queried, never waited for); when the next one is still in use or a job does not fit,
the caller falls back to the staged path."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

DEFAULT_ARG_BUFFERS = 8
DEFAULT_ARG_WORDS = 8192  # int64 words per buffer: engine block ids + one address per slot


class PinnedArgRing:
    """``buffers`` pinned int64 arrays handed out round robin, each busy until an event.
    Not thread-safe: its loader takes and holds buffers under its own lock."""

    def __init__(self, buffers: int = DEFAULT_ARG_BUFFERS, words: int = DEFAULT_ARG_WORDS) -> None:
        if buffers < 1 or words < 2:
            raise ValueError("a pinned argument ring needs at least one buffer of 2 words")
        self.words = words
        self._tensors = [torch.empty(words, dtype=torch.int64).pin_memory()
                         for _ in range(buffers)]
        self._arrays = [t.numpy() for t in self._tensors]
        self._free: deque[int] = deque(range(buffers))
        self._busy: deque[tuple[int, torch.cuda.Event]] = deque()

    def take(self, words: int) -> tuple[int, np.ndarray, int] | None:
        """(buffer index, its numpy view, its address) for ``words`` words, or None: too many
        words, or every buffer still read by a kernel that has not finished."""
        if words > self.words:
            return None
        while self._busy and self._busy[0][1].query():
            self._free.append(self._busy.popleft()[0])
        if not self._free:
            return None
        i = self._free.popleft()
        return i, self._arrays[i], self._tensors[i].data_ptr()

    def hold(self, i: int, until: torch.cuda.Event) -> None:
        """Buffer ``i`` is read by work that ends with ``until``."""
        self._busy.append((i, until))

    def give_back(self, i: int) -> None:
        """Buffer ``i`` was taken but nothing was launched with it."""
        self._free.appendleft(i)
