"""A running instance's stats, kept up to date in a JSON file for ``kvtier stats``.

A daemon thread calls ``collect()`` every ``interval_s`` and replaces the file atomically
(temp name + rename), so a reader never sees half a snapshot. The file carries the writer's
pid and a timestamp, so ``kvtier stats`` can tell a live instance from a stale file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 1


def write_snapshot(path: Path, data: dict) -> None:
    payload = {"format": SNAPSHOT_FORMAT, "pid": os.getpid(), "written_at": time.time(), **data}
    # unique per writer: two instances in one process (a restart in tests) must not collide
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(payload, fh, default=str)
    os.replace(tmp, path)


_NESTED = ("usage", "transfers")  # tier/direction -> {name: number}
_FLAT = ("manager", "requests", "disk", "events")  # name -> number | {name: number} | text


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _scalar(v: object) -> bool:
    return v is None or isinstance(v, (bool, str)) or _number(v)


def _well_formed(data: dict) -> bool:
    """Shape check of a snapshot: a file is input like any other, and ``kvtier stats`` must
    never trip over a damaged or hostile one (it is refused instead)."""
    if data.get("format") != SNAPSHOT_FORMAT:
        return False
    if not (isinstance(data.get("pid"), int) and not isinstance(data.get("pid"), bool)):
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


def read_snapshot(path: Path) -> dict | None:
    """The snapshot at ``path`` (parsed as JSON only, shape-checked), or None if absent,
    unreadable or malformed."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and _well_formed(data) else None


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
