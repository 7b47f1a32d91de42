"""The GIL switch interval while kvtier shares the process with vLLM's engine loop.

vLLM's engine loop is a Python thread that rarely blocks. A thread that wants the GIL back
after a blocking call (a disk read, an fsync, a socket) gets it only when the holder blocks or
when the interpreter's switch interval (5 ms by default) runs out, and a disk read or write is
a chain of such hand-offs, so beside a busy engine loop it takes many times as long as alone
(figures: docs/design-measurements.md). The same holds for vLLM's own input and output threads
under ``vllm serve``, so the runtime applies it with every tier configuration.

A shorter interval only matters while some thread waits for the GIL (a lone thread is never
interrupted), so it costs nothing while kvtier is idle. It is process-wide state: the runtime
that sets it puts the previous value back when it closes, and never raises an interval someone
else set lower."""

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
