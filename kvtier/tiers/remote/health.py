"""Whether the shared tier is usable right now, and when to look again.

A server that is down, hung or refusing writes must cost the instance nothing but its remote
hits: after a failed operation the tier is *degraded* and every operation fails at once (no
socket is touched) until a probe (one PING every ``probe_interval_s``) succeeds. Misses caused
by eviction are not failures; only errors of the connection or the server are.
"""

from __future__ import annotations

import threading
import time


class RemoteHealth:
    def __init__(self, probe_interval_s: float, clock=time.monotonic) -> None:
        self.probe_interval_s = probe_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self.degraded = False
        self.degradations = 0  # episodes so far
        self.last_error = ""
        self._next_probe = 0.0

    def usable(self) -> bool:
        return not self.degraded

    def failed(self, why: str) -> None:
        with self._lock:
            self.last_error = why
            if not self.degraded:
                self.degraded = True
                self.degradations += 1
            self._next_probe = self._clock() + self.probe_interval_s

    def probe_due(self) -> bool:
        """True once per interval while degraded (the caller then probes)."""
        with self._lock:
            if not self.degraded or self._clock() < self._next_probe:
                return False
            self._next_probe = self._clock() + self.probe_interval_s
            return True

    def recovered(self) -> None:
        with self._lock:
            self.degraded = False
