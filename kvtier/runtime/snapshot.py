"""A running instance's stats, kept up to date in a JSON file for ``kvtier stats``.

A daemon thread calls ``collect()`` every ``interval_s`` and replaces the file atomically
(temp name + rename), so a reader never sees half a snapshot. The file carries the writer's
pid and a timestamp, so ``kvtier stats`` can tell a live instance from a stale file.

A write that fails (ENOSPC, EIO) removes its temp file: the writer retries every interval, and
a full disk must not collect one orphan per second. A snapshot is input like any other when
read back: anything outside the shape ``kvtier stats`` needs (a pid os.kill cannot take, a
number beyond 2**63, text where a counter belongs) is refused or dropped here, so rendering
never meets a TypeError or OverflowError.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 1
MAX_PID = (1 << 31) - 1  # what os.kill takes (Linux pids stay below 2**22)
MAX_NUMBER = float(1 << 63)  # counters, bytes and rates: anything larger is not a measurement


def write_snapshot(path: Path, data: dict) -> None:
    payload = {"format": SNAPSHOT_FORMAT, "pid": os.getpid(), "written_at": time.time(), **data}
    # unique per writer: two instances in one process (a restart in tests) must not collide
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, default=str)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_NESTED = ("usage", "transfers")  # tier/direction -> {name: number}
_FLAT = ("manager", "requests", "disk", "events")  # name -> number | {name: number} | text
_COUNTERS = ("usage", "transfers", "manager", "requests")  # numbers (and flags) only


def _number(v: object) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return -MAX_NUMBER < v < MAX_NUMBER  # also False for nan; never converts a huge int


def _scalar(v: object) -> bool:
    return v is None or isinstance(v, (bool, str)) or _number(v)


def _well_formed(data: dict) -> bool:
    """Shape check of a snapshot: a file is input like any other, and ``kvtier stats`` must
    never trip over a damaged or hostile one (it is refused instead)."""
    if data.get("format") != SNAPSHOT_FORMAT:
        return False
    pid = data.get("pid")
    if not (isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= MAX_PID):
        return False
    if not _number(data.get("written_at")):
        return False
    for name in _NESTED:
        section = data.get(name, {})
        if not isinstance(section, dict) or not all(
            isinstance(v, dict) and all(_scalar(x) for x in v.values()) for v in section.values()
        ):
            return False
    for name in _FLAT:
        section = data.get(name, {})
        if section is None:
            continue
        if not isinstance(section, dict) or not all(
            _scalar(v) or (isinstance(v, dict) and all(_scalar(x) for x in v.values()))
            for v in section.values()
        ):
            return False
    return True


def _counters_only(section: dict) -> dict:
    """``section`` without values that are not numbers or flags (text, null): these sections
    are summed, divided and formatted with ``:.3f``."""
    out = {}
    for k, v in section.items():
        if isinstance(v, dict):
            out[k] = {x: y for x, y in v.items() if _number(y) or isinstance(y, bool)}
        elif _number(v) or isinstance(v, bool):
            out[k] = v
    return out


def read_snapshot(path: Path) -> dict | None:
    """The snapshot at ``path`` (parsed as JSON only, shape-checked), or None if absent,
    unreadable or malformed; counter sections keep numbers only."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not (isinstance(data, dict) and _well_formed(data)):
        return None
    for name in _COUNTERS:
        if isinstance(data.get(name), dict):
            data[name] = _counters_only(data[name])
    return data


class SnapshotWriter:
    def __init__(self, path: Path, collect: Callable[[], dict], interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self._collect = collect
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-stats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.write_now()

    def write_now(self) -> None:
        try:
            write_snapshot(self.path, self._collect())
        except Exception as exc:  # noqa: BLE001 - stats must never take the instance down
            log.warning("kvtier: cannot write stats snapshot %s: %s", self.path, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.write_now()
