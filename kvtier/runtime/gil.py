"""The GIL switch interval while kvtier shares the process with vLLM's engine loop.

vLLM's engine loop is a Python thread that rarely blocks: while a load is in flight it runs
step after step, a fraction of a millisecond apart. A thread that wants the GIL back after a
blocking call (a disk read, an fsync, a socket) gets it only when the holder blocks or when
the interpreter's switch interval runs out: 5 ms by default. A disk read or write is a chain
of such hand-offs (engine loop -> reader thread -> each syscall -> completion), so each one
waits up to 5 ms: with a busy Python thread beside it, a disk read takes many times as long
as alone (figures: docs/design-measurements.md).

The same holds for threads that are not kvtier's: under ``vllm serve`` the engine-core process
hands each step's output to its own output thread (and takes requests from an input thread)
while the engine loop goes on into the next step; with kvtier's per-step work in that loop,
those threads wait for the GIL too, for hits and for requests kvtier neither loads nor stores
alike. So the runtime applies it with every tier configuration, not only with I/O threads.

A shorter interval only matters while some thread waits for the GIL (a lone thread is never
interrupted), so it costs the engine nothing while kvtier is idle and bounds each hand-off
while it is not. It is process-wide state: the runtime that sets it puts the previous value
back when it closes, and never raises an interval someone else set lower.
"""

from __future__ import annotations

import logging
import sys

from kvtier.config.schema import MAX_GIL_SWITCH_INTERVAL_MS

log = logging.getLogger(__name__)


class SwitchInterval:
    """Lowers ``sys.getswitchinterval()`` to ``ms`` (0: leave it) until :meth:`restore`."""

    def __init__(self, ms: float) -> None:
        if not 0 <= ms <= MAX_GIL_SWITCH_INTERVAL_MS:
            raise ValueError(f"GIL switch interval must be within [0, "
                             f"{MAX_GIL_SWITCH_INTERVAL_MS:g}] ms, got {ms}")
        self._previous: float | None = None
        target = ms / 1000.0
        current = sys.getswitchinterval()
        if ms and target < current:
            self._previous = current
            sys.setswitchinterval(target)
            log.info("kvtier: GIL switch interval %.2f ms (was %.2f ms) while kvtier runs "
                     "(gil_switch_interval_ms)", ms, current * 1000)

    @property
    def applied(self) -> bool:
        return self._previous is not None

    def restore(self) -> None:
        if self._previous is not None:
            sys.setswitchinterval(self._previous)
            self._previous = None
