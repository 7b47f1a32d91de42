"""What recomputing costs on this engine, measured: the time of large forward passes.

Cost-aware loading (``kvtier.manager.cost``) needs the engine's prefill time per token, and a
fixed guess is wrong by an order of magnitude between models and GPUs. So :class:`ForwardTimer`
times the forward passes of steps that compute many tokens (where prefill is compute-bound):
a pair of timing events around the forward, on the stream it runs on (``bind`` before it,
``wait_for_save`` after it was enqueued), read back without blocking once the second fired.
Steps with a synchronous load are not timed (the forward waits for the copy there). On a CPU
engine the forward is synchronous, so wall time is used. The scheduler turns the reported
times into seconds per token (:mod:`..recompute`)."""

from __future__ import annotations

from collections import deque
from typing import Any

from kvtier.connectors.vllm.recompute import MIN_TOKENS

MAX_PENDING = 8


class ForwardTimer:
    def __init__(self, device: Any) -> None:
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self._open: tuple[int, Any] | None = None
        self._pending: deque = deque()
        self._done: list[tuple[int, float]] = []

    def _now(self) -> Any:
        if self.cuda:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream())
            return ev
        import time

        return time.perf_counter()

    def begin(self, tokens: int) -> None:
        self._open = None
        if tokens >= MIN_TOKENS and len(self._pending) < MAX_PENDING:
            self._open = (tokens, self._now())

    def end(self) -> None:
        if self._open is None:
            return
        tokens, start = self._open
        self._open = None
        self._pending.append((tokens, start, self._now()))

    def take(self) -> tuple[tuple[int, float], ...]:
        """Finished measurements since the last call (never waits for the GPU)."""
        while self._pending:
            tokens, start, end = self._pending[0]
            if self.cuda:
                if not end.query():
                    break
                seconds = start.elapsed_time(end) / 1e3
            else:
                seconds = end - start
            self._pending.popleft()
            if seconds > 0:
                self._done.append((tokens, seconds))
        out, self._done = tuple(self._done), []
        return out
