"""The GIL switch interval while kvtier shares the process with vLLM's engine loop.

vLLM's engine loop is a Python thread that rarely blocks. A thread that wants the GIL back
after a blocking call (a disk read, an fsync, a socket) gets it only when the holder blocks or
when the interpreter's switch interval (5 ms by default) runs out, and a disk read or write is
a chain of such hand-offs, so beside a busy engine loop it takes many times as long as alone
(figures: docs/design-measurements.md). The same holds for vLLM's own input and output threads
under ``vllm serve``, so the runtime applies it with every tier configuration (with
no disk or shared tier, only while the engine keeps up: below).

A shorter interval only matters while some thread waits for the GIL (a lone thread is never
interrupted), so it costs nothing while kvtier is idle. It is process-wide state: the runtime
that sets it puts the previous value back when it closes, and never raises an interval someone
else set lower.

It has a price where the engine loop itself is the bottleneck: past saturation every forced
hand-off to vLLM's input and output threads comes out of the loop's steps (step phases:
docs/design-measurements.md). With no tier whose reads run through this process's threads
(no disk, no shared tier) the interval is therefore short only while the engine keeps up,
and Python's while the scheduler leaves requests waiting (:meth:`SwitchInterval.engine_saturated`,
fed from each step's connector metadata)."""

from __future__ import annotations

import logging
import sys

from kvtier.config.schema import MAX_GIL_SWITCH_INTERVAL_MS

log = logging.getLogger(__name__)


class SwitchInterval:
    """Lowers ``sys.getswitchinterval()`` to ``ms`` (0: leave it) until :meth:`restore`.

    ``steady``: lowered for the whole run. Otherwise :meth:`engine_saturated` puts the earlier
    interval back while the engine is saturated and lowers it again once it keeps up."""

    def __init__(self, ms: float, *, steady: bool = True) -> None:
        if not 0 <= ms <= MAX_GIL_SWITCH_INTERVAL_MS:
            raise ValueError(f"GIL switch interval must be within [0, "
                             f"{MAX_GIL_SWITCH_INTERVAL_MS:g}] ms, got {ms}")
        self._previous: float | None = None
        self._target = ms / 1000.0
        self._steady = steady
        self._lowered = False
        current = sys.getswitchinterval()
        if ms and self._target < current:
            self._previous = current
            self._lower()
            log.info("kvtier: GIL switch interval %.2f ms (was %.2f ms) while kvtier runs%s "
                     "(gil_switch_interval_ms)", ms, current * 1000,
                     "" if steady else " and the engine keeps up")

    @property
    def applied(self) -> bool:
        return self._previous is not None

    @property
    def lowered(self) -> bool:
        """The short interval is in force now."""
        return self._lowered

    def _lower(self) -> None:
        sys.setswitchinterval(self._target)
        self._lowered = True

    def engine_saturated(self, saturated: bool) -> None:
        """The scheduler's verdict on this step: ``True`` while it leaves requests waiting.
        A steady interval, or one never applied, ignores it."""
        if self._steady or self._previous is None or saturated != self._lowered:
            return
        if saturated:
            sys.setswitchinterval(self._previous)
            self._lowered = False
        else:
            self._lower()

    def restore(self) -> None:
        if self._previous is not None:
            if self._lowered:
                sys.setswitchinterval(self._previous)
            self._lowered = False
            self._previous = None
