"""A log line when the shared tier's writes fall behind what this instance stores.

A block waits in the write backlog while at most ``max_writes_in_flight`` are written; if the
CPU tier evicts it first, or the backlog overflows, it never reaches the shared tier and every
other instance recomputes it. ``remote_writes_skipped`` counts those blocks, but a counter
does not tell an operator why sharing stopped paying: one server accepts a few GB/s of SETs,
and instances that produce KV faster (long turns, high load) outrun it
(docs/design-measurements.md). So the first such loss, and
then at most one per ``interval_s``, logs the window's blocks lost and written and what lets
the tier keep up.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger(__name__)

INTERVAL_S = 60.0


class WriteLagNotice:
    def __init__(self, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._since = clock()  # start of the window the next line reports
        self._warned_at: float | None = None
        self._lost = 0  # in the window
        self._written = 0
        self.lines = 0  # warnings logged

    def written(self, blocks: int) -> None:
        self._written += blocks

    def lost(self, blocks: int) -> None:
        """``blocks`` will not reach the shared tier (evicted or pushed out while waiting)."""
        self._lost += blocks
        now = self._clock()
        if self._warned_at is not None and now - self._warned_at < self.interval_s:
            return
        log.warning(
            "kvtier: the shared tier's writes are behind: %d blocks left this instance before "
            "their write in the last %.0f s (%d written); other instances recompute them. A "
            "Cluster with more primaries, more tiers.remote.io_processes or "
            "max_writes_in_flight, or a larger CPU tier lets the writes keep up "
            "(kvtier_remote_writes_skipped_total counts them)",
            self._lost, now - self._since, self._written)
        self.lines += 1
        self._warned_at = self._since = now
        self._lost = self._written = 0
