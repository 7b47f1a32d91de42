"""Parent side of the crash test: start the child, SIGKILL it at a random point, check the store.

After each kill the store is reopened and held to the journal (see crash_child.py):

* every block the index lists reads back, verifies and is exactly a version written for its
  key (``wrong_blocks`` otherwise);
* the store's contents equal the acknowledged history, or that history plus the whole of the
  one call in flight (a batch commits atomically): an acknowledged put that is missing or
  older is ``lost_acked``, an acknowledged delete that came back is ``resurrected``, anything
  else off is ``torn``;
* the store counts no checksum failure or read error (a crash must never leave an indexed
  record that does not verify).

The same directory carries on from one iteration to the next, so later children also recover
from what earlier kills left behind.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from reliability.blocks import GEO, identify, key
from reliability import crash_child

from kvtier.tiers.disk import DiskStore

CHILD = Path(crash_child.__file__).resolve()
PHASES = {"p": "put", "d": "delete", "c": "compact", "r": "reopen"}


@dataclass
class CrashSummary:
    runs: int = 0
    kills: int = 0
    kills_by_phase: Counter = field(default_factory=Counter)
    acked_ops: int = 0
    blocks_verified: int = 0
    wrong_blocks: int = 0
    lost_acked: int = 0
    resurrected: int = 0
    torn: int = 0
    counted_failures: int = 0
    violations: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "violations"}
        d["kills_by_phase"] = dict(self.kills_by_phase)
        d["violations"] = len(self.violations)
        return d


def replay_journal(lines: list[str], state: dict[int, int]) -> tuple[dict[int, int], dict[int, int] | None, str, int]:
    """Apply acknowledged ops to ``state``; returns (acked state, state if the op in flight
    also landed or None, phase of the kill, acknowledged op count)."""
    state = dict(state)
    pending: tuple[str, list[str]] | None = None
    opened = False
    acked = 0
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        tag = parts[0]
        if tag == "O":
            opened = True
        elif tag in PHASES:
            pending = (tag, parts[2:])
        elif tag.lower() in PHASES and pending is not None:
            apply_op(state, *pending)
            pending = None
            acked += 1
    if pending is None:
        return state, None, "between ops" if opened else "open", acked
    after = dict(state)
    apply_op(after, *pending)
    return state, after, PHASES[pending[0]], acked


def apply_op(state: dict[int, int], tag: str, args: list[str]) -> None:
    if tag == "p":
        for a in args:
            i, v = a.split(":")
            state[int(i)] = int(v)
    elif tag == "d":
        for a in args:
            state.pop(int(a), None)


def read_back(path: Path, summary: CrashSummary) -> dict[int, int]:
    """Open the store, read and verify every indexed block; returns key number -> version."""
    numbers = {key(i): i for i in range(crash_child.KEYSPACE)}
    seen: dict[int, int] = {}
    with DiskStore(path, GEO, **crash_child.STORE_OPTS) as s:
        listed = s.keys_by_age()
        if len(set(listed)) != len(listed) or len(listed) != s.stats().num_blocks:
            summary.violations.append(f"index lists {len(listed)} keys, duplicates or count off")
        for k in listed:
            i = numbers.get(k)
            data = s.get(k)
            version = identify(k, data) if data is not None and i is not None else None
            summary.blocks_verified += 1
            if version is None:
                summary.wrong_blocks += 1
                summary.violations.append(f"block {k.hex()[:12]} listed but unreadable or wrong")
                continue
            seen[i] = version
        st = s.stats()
        failures = st.checksum_failures + st.read_errors
        if failures > summary.counted_failures:
            summary.violations.append(f"store counted {failures} failed reads after a crash")
        summary.counted_failures = failures
    return seen


def judge(seen: dict[int, int], before: dict[int, int], after: dict[int, int] | None,
          summary: CrashSummary, where: str) -> None:
    if seen == before or (after is not None and seen == after):
        return
    for i in sorted(set(seen) | set(before) | set(after or {})):
        got, acked, maybe = seen.get(i), before.get(i), (after or before).get(i)
        if got in (acked, maybe):
            continue  # fine for this key alone; the batch as a whole was torn
        if acked is not None and (got is None or got < acked):
            summary.lost_acked += 1
        elif acked is None and got is not None and maybe != got:
            summary.resurrected += 1
    summary.torn += 1
    summary.violations.append(f"{where}: store {seen} matches neither acked {before} nor {after}")


def run_crash_iterations(root: Path, iterations: int, seed: int = 0, *,
                         max_delay_s: float = 0.12, early_kill_share: float = 0.1,
                         summary: CrashSummary | None = None) -> CrashSummary:
    """``iterations`` child lives on the store at ``root``, each ended by SIGKILL."""
    summary = summary or CrashSummary()
    rng = random.Random(seed)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    store_dir = root / "store"
    state: dict[int, int] = {}
    for it in range(iterations):
        journal = root / f"journal-{it}.txt"
        err = root / f"child-{it}.err"
        with open(err, "wb") as err_fh:
            child = subprocess.Popen(
                [sys.executable, str(CHILD), str(store_dir), str(journal), str(seed * 100_000 + it + 1)],
                stdout=subprocess.DEVNULL, stderr=err_fh,
            )
        summary.runs += 1
        try:
            if rng.random() < early_kill_share:  # somewhere in start-up or open-time recovery
                time.sleep(rng.uniform(0.0, 0.4))
            else:
                _wait_opened(journal, child)
                time.sleep(rng.uniform(0.0, max_delay_s))
        finally:
            killed = child.poll() is None
            if killed:
                os.kill(child.pid, signal.SIGKILL)
            child.wait()
        lines = journal.read_text().splitlines() if journal.exists() else []
        if killed:
            summary.kills += 1
        elif child.returncode != 0 or "X" not in lines:
            tail = err.read_text()[-2000:]
            summary.violations.append(f"iteration {it}: child failed (rc {child.returncode}): {tail}")
        before, after, phase, acked = replay_journal(lines, state)
        summary.kills_by_phase[phase] += killed
        summary.acked_ops += acked
        seen = read_back(store_dir, summary)
        judge(seen, before, after, summary, f"iteration {it} (killed in {phase})")
        state = seen
        journal.unlink(missing_ok=True)
        err.unlink(missing_ok=True)
    return summary


def _wait_opened(journal: Path, child: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and child.poll() is None:
        try:
            with open(journal, "rb") as fh:
                if fh.read(2).startswith(b"O"):
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.002)
