"""A per-step timeline of the connector's work, to see where a hit's time goes.

Off unless ``KVTIER_TIMELINE`` names a file. Then both halves record one mark per event:
``{"t": seconds, "pid": ..., "who": "sched" | "worker", "ev": name, ...fields}``. ``t`` is
``time.monotonic()``, a clock every process on the host shares, so the scheduler's, the
workers' and a client's own marks fall on one axis. When off, a mark costs one attribute test.

Marks are kept in memory and written as JSON lines by :meth:`Timeline.flush` (every
``FLUSH_EVERY`` marks, at exit, when vLLM shuts the connector down, or when a caller asks): a
write per mark slowed the marked process itself. ``vllm serve``'s engine processes may be
killed without running exit handlers: with ``KVTIER_TIMELINE_FLUSH_S`` set, the first mark that
many seconds after the last write also writes, losing at most that much at a kill. It is off
otherwise, so a write never lands inside a request an in-process benchmark is timing."""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

ENV = "KVTIER_TIMELINE"
FLUSH_EVERY = 50_000


def _flush_after(value: str | None) -> float | None:
    """``KVTIER_TIMELINE_FLUSH_S``: seconds > 0; anything else leaves it off (a diagnostic
    switch must not stop the connector from loading)."""
    try:
        seconds = float(value) if value else None
    except ValueError:
        seconds = None
    return seconds if seconds is not None and seconds > 0 else None


FLUSH_AFTER_S = _flush_after(os.environ.get("KVTIER_TIMELINE_FLUSH_S"))


class Timeline:
    def __init__(self, path: str | None) -> None:
        self.enabled = bool(path)
        self._path = path
        self._marks: list[tuple[float, str, str, dict]] = []
        # re-entrant: a garbage-collector callback may mark (a host probe timing GC passes) while
        # this thread is inside mark() or flush(), and must not wait for itself
        self._lock = threading.RLock()
        self._write_lock = threading.RLock()
        self._pid = os.getpid()
        self._flushed_at = time.monotonic()
        if path:
            atexit.register(self.flush)

    def mark(self, who: str, ev: str, **fields: Any) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        with self._lock:
            self._marks.append((now, who, ev, fields))
            full = len(self._marks) >= FLUSH_EVERY or (
                FLUSH_AFTER_S is not None and now - self._flushed_at > FLUSH_AFTER_S)
        if full:
            self.flush()

    def flush(self) -> None:
        """Append the marks so far to the file (one JSON line each)."""
        if not self._path:
            return
        with self._write_lock:  # batches reach the file in the order they were taken
            with self._lock:
                marks, self._marks = self._marks, []
                self._flushed_at = time.monotonic()
            if not marks:
                return
            lines = [json.dumps({"t": t, "pid": self._pid, "who": who, "ev": ev, **fields},
                                separators=(",", ":"), default=str) for t, who, ev, fields in marks]
            with open(self._path, "a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")


def ms_since(began: float) -> float:
    """Milliseconds since ``began`` (a ``time.perf_counter()`` reading), for a mark's ``ms``:
    how long the marked call itself took, beside when it ended (``t``)."""
    return round((time.perf_counter() - began) * 1e3, 3)


_timeline: Timeline | None = None


def timeline() -> Timeline:
    """The process's timeline (opened on first use from ``KVTIER_TIMELINE``)."""
    global _timeline
    if _timeline is None:
        _timeline = Timeline(os.environ.get(ENV) or None)
    return _timeline
