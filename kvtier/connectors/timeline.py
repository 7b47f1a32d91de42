"""A per-step timeline of the connector's work, to see where a hit's time goes.

Off unless ``KVTIER_TIMELINE`` names a file. Then both halves append one JSON line per mark:
``{"t": seconds, "pid": ..., "who": "sched" | "worker", "ev": name, ...fields}``. ``t`` is
``time.monotonic()``, a clock every process on the host shares, so the scheduler's lines, the
workers' lines and a benchmark client's own marks fall on one axis
(``benchmarks/vllm_e2e.py`` prints the steps of one hit from it). When off, a mark costs one
attribute test.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

ENV = "KVTIER_TIMELINE"


class Timeline:
    def __init__(self, path: str | None) -> None:
        self.enabled = bool(path)
        self._file = open(path, "a", buffering=1, encoding="utf-8") if path else None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def mark(self, who: str, ev: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"t": time.monotonic(), "pid": self._pid, "who": who, "ev": ev,
                           **fields}, separators=(",", ":"), default=str)
        with self._lock:
            self._file.write(line + "\n")


_timeline: Timeline | None = None


def timeline() -> Timeline:
    """The process's timeline (opened on first use from ``KVTIER_TIMELINE``)."""
    global _timeline
    if _timeline is None:
        _timeline = Timeline(os.environ.get(ENV) or None)
    return _timeline
