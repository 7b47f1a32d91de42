"""Stopping a child process for a test, and knowing it is stopped before the test goes on."""

from __future__ import annotations

import os
import signal
import time


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once it is stopped: the signal is delivered asynchronously,
    and a child still running answers a request sent right after ``kill`` (seen on a loaded
    CI machine)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")
