"""Crash consistency of the disk tier: a child process stores, deletes, compacts and reopens a
DiskStore (fsync on) and is SIGKILLed at random points; after every kill the store must hold
exactly the acknowledged history (plus, atomically, the call in flight), every listed block
must verify and be a version written for its key, and no read may fail.

The checker itself is tested first, so a green run means something.
"""

from __future__ import annotations

import os

import pytest

from reliability.blocks import GEO, block, key
from reliability.crash_child import STORE_OPTS
from reliability.crash_loop import CrashSummary, judge, read_back, replay_journal, run_crash_iterations

from kvtier.tiers.disk import DiskStore

CI_ITERATIONS = 24
LONG_ITERATIONS = 240


def _assert_clean(s: CrashSummary, iterations: int) -> None:
    assert s.violations == [], "\n".join(s.violations[:10])
    assert s.runs == iterations
    assert s.wrong_blocks == s.lost_acked == s.resurrected == s.torn == 0
    assert s.kills >= iterations - 1  # a child outliving its kill window is not a kill
    assert s.acked_ops > 0 and s.blocks_verified > 0
    mid_call = sum(s.kills_by_phase[p] for p in ("put", "delete", "compact", "reopen"))
    assert mid_call >= 1, f"no kill landed inside a store call: {dict(s.kills_by_phase)}"


def test_sigkill_at_random_points_keeps_every_acknowledged_block(tmp_path):
    s = run_crash_iterations(tmp_path, CI_ITERATIONS, seed=7)
    _assert_clean(s, CI_ITERATIONS)


@pytest.mark.slow
def test_sigkill_long_run(tmp_path):
    s = run_crash_iterations(tmp_path, LONG_ITERATIONS, seed=11)
    _assert_clean(s, LONG_ITERATIONS)
    assert min(s.kills_by_phase[p] for p in ("put", "delete", "compact")) >= 5


# -- the checker catches what it is there to catch -------------------------------------------

def test_journal_replay_separates_acknowledged_from_in_flight():
    lines = ["O", "p 0 1:10 2:10", "P 0", "d 1 2", "D 1", "p 2 3:12 1:12"]
    before, after, phase, acked = replay_journal(lines, {5: 3})
    assert before == {5: 3, 1: 10} and after == {5: 3, 1: 12, 3: 12}
    assert phase == "put" and acked == 2
    assert replay_journal(["O", "c 0", "C 0"], {})[1:3] == (None, "between ops")
    assert replay_journal([], {1: 1})[:3] == ({1: 1}, None, "open")


@pytest.mark.parametrize(
    "seen, kind",
    [({1: 10}, "lost_acked"),  # acked key 2 vanished
     ({1: 10, 2: 9}, "lost_acked"),  # acked key 2 rolled back to an older version
     ({1: 10, 2: 10, 4: 1}, "resurrected"),  # a deleted key came back
     ({1: 10, 2: 10, 3: 12}, "torn")],  # half of the in-flight batch (3:12, 1:12)
)
def test_judge_flags_every_kind_of_loss(seen, kind):
    s = CrashSummary()
    judge(seen, {1: 10, 2: 10}, {1: 12, 2: 10, 3: 12}, s, "t")
    assert s.violations and getattr(s, kind) >= 1
    ok = CrashSummary()
    judge({1: 12, 2: 10, 3: 12}, {1: 10, 2: 10}, {1: 12, 2: 10, 3: 12}, ok, "t")
    assert ok.violations == []


def test_read_back_flags_a_block_that_does_not_verify(tmp_path):
    path = tmp_path / "store"
    with DiskStore(path, GEO, **STORE_OPTS) as s:
        s.put_many([(key(i), block(key(i), 5)) for i in range(3)])
        e = s._index.get(key(1))
        seg = path / "segments" / f"{e.segment:08d}.seg"
    with open(seg, "r+b") as f:  # flip one payload byte of key 1
        f.seek(e.offset + e.length - 3)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    s = CrashSummary()
    seen = read_back(path, s)
    assert seen == {0: 5, 2: 5} and s.wrong_blocks == 1 and s.violations
