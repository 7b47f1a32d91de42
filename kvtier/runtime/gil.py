"""The GIL switch interval while kvtier's I/O threads share the process with vLLM.

vLLM's engine loop is a Python thread that rarely blocks: while a load is in flight it runs
step after step (one every ~0.6 ms on an H100). A thread that wants the GIL back after a
blocking call (a disk read, an fsync, a socket) gets it only when the holder blocks or when
the interpreter's switch interval runs out: 5 ms by default. A disk read or write is a chain
of such hand-offs (engine loop -> reader thread -> each syscall -> completion), so each one
waits up to 5 ms. Measured (benchmarks/gil_starvation.py, this repository's 2-core CI
machine): with a busy Python thread beside it, reading one 512 KiB block through the disk
tier took 49 ms instead of 0.8 ms, 64 blocks 291 ms instead of 9 ms; in real vLLM on the
lent H100 one block's DISK -> CPU hop took 7.2 ms and 32 MiB from the page cache 28 ms.

A shorter interval only matters while some thread waits for the GIL (a lone thread is never
interrupted), but while kvtier's threads are busy it taxes the engine thread: every 0.2 ms it
is stopped to hand the GIL over. Measured on this repository's CI machine, a pure-Python loop
beside a busy disk writer ran 1.35x slower at 0.2 ms and at full speed at 5 ms; in real vLLM
on the H100 (1B shape) a disk-config request whose prefix was recomputed took 61 ms against
47 ms for the same prompt with kvtier out of the way while write-back was busy. So by default the
interval is short only while a request waits on kvtier's threads: a load that promotes from
disk or the shared tier holds it (:meth:`SwitchInterval.hold`) until the load's result is
seen, and background work (write-back, shared-tier writes) runs at Python's interval. A shared
tier keeps it short throughout (``always``): its lookups, which requests wait on too, run on
its own threads at any time.

It is process-wide state: the runtime that sets it puts the previous value back when it closes
(or its last hold ends), and never raises an interval someone else set lower.
"""

from __future__ import annotations

import logging
import sys

from kvtier.config.schema import MAX_GIL_SWITCH_INTERVAL_MS

log = logging.getLogger(__name__)


class SwitchInterval:
    """Lowers ``sys.getswitchinterval()`` to ``ms`` (0: leave it): from construction when
    ``always``, else while at least one :meth:`hold` is open; :meth:`restore` ends it all."""

    def __init__(self, ms: float, *, always: bool = True) -> None:
        if not 0 <= ms <= MAX_GIL_SWITCH_INTERVAL_MS:
            raise ValueError(f"GIL switch interval must be within [0, "
                             f"{MAX_GIL_SWITCH_INTERVAL_MS:g}] ms, got {ms}")
        self._target = ms / 1000.0
        self._previous: float | None = None
        self._holds: set = set()
        self.always = always
        if always:
            self._lower()

    def _lower(self) -> None:
        current = sys.getswitchinterval()
        if self._target and self._previous is None and self._target < current:
            self._previous = current
            sys.setswitchinterval(self._target)
            log.debug("kvtier: GIL switch interval %.2f ms (was %.2f ms)",
                      self._target * 1000, current * 1000)

    def _put_back(self) -> None:
        if self._previous is not None:
            sys.setswitchinterval(self._previous)
            self._previous = None

    @property
    def applied(self) -> bool:
        return self._previous is not None

    def hold(self, token: object) -> None:
        """Someone waits on an I/O thread until :meth:`release` (``token``): short hand-offs."""
        self._holds.add(token)
        self._lower()

    def release(self, token: object) -> None:
        self._holds.discard(token)
        if not self._holds and not self.always:
            self._put_back()

    def restore(self) -> None:
        self._holds.clear()
        self._put_back()
