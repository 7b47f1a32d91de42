"""Issue 36.5: a disk I/O child that stops answering (SIGSTOP here; a process stuck in the
kernel on a dead disk looks the same) must not stall a load or a write past the request's
deadline: the child is declared lost, killed and replaced as after a crash, the load comes back
failed (the engine recomputes) and the write raises."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from support.stopped import stop

from kvtier.config import load_config
from kvtier.config.errors import ConfigError
from kvtier.config.schema import DiskTierConfig
from kvtier.tiers.child import wire
from kvtier.tiers.disk.io.process import (
    DEADLINE_BYTES,
    START_TIMEOUT_S,
    DiskProcess,
    DiskProcessGone,
)
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.layout import BlockGeometry

GEO = BlockGeometry(num_layers=1, kv_parts=2, engine_blocks_per_block=1, page_bytes=1024,
                    dtype="uint8", model="deadline-test")
TIMEOUT_S = 1.0


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


@pytest.fixture
def pool():
    return CpuBlockPool(GEO, 16, pin=False, shared=True)


@pytest.fixture
def proc(pool, tmp_path):
    dp = DiskProcess(pool, DiskTierConfig(path=tmp_path / "disk", capacity=1 << 28,
                                          request_timeout_s=TIMEOUT_S),
                     GEO, connections=2, respawn_after_s=0.2)
    yield dp
    try:
        os.kill(dp.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    dp.close()


def test_a_stopped_child_fails_the_load_within_the_deadline_and_is_replaced(pool, proc):
    pool.slot(0).fill_(5)
    proc.put_slots([0], [key(1)])
    stopped = proc.pid
    stop(stopped)
    t0 = time.monotonic()
    # two loads at once, one per connection: both come back failed, neither hangs
    results: list = []
    threads = [threading.Thread(target=lambda s=s: results.append(
        proc.fetch_slots([key(1)], [s])), daemon=True) for s in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT_S)
    took = time.monotonic() - t0
    assert not any(t.is_alive() for t in threads), "a load hangs on a stopped child"
    assert results == [([0], [0])] * 2  # failed (transient): the engine recomputes
    assert took < 2.5 * TIMEOUT_S, took
    # declared lost: killed, and a write fails at once instead of waiting again
    assert proc._proc.wait(5) == -signal.SIGKILL
    with pytest.raises(DiskProcessGone, match="hung"):
        proc.put_slots([0], [key(2)])
    time.sleep(0.3)
    pool.slot(1).fill_(6)
    proc.put_slots([1], [key(3)])  # this call starts the replacement
    assert proc.respawns == 1 and proc.pid != stopped
    failed, transient = proc.fetch_slots([key(1), key(3)], [8, 9])
    assert (failed, transient) == ([], [])
    assert bytes(pool.slot(8).numpy()) == b"\x05" * GEO.block_bytes
    assert bytes(pool.slot(9).numpy()) == b"\x06" * GEO.block_bytes


def test_stats_answer_while_a_hung_child_is_being_replaced(pool, proc):
    """Issue 48.6: ``kvtier bench``'s final report asks for the disk stats; with the child
    lost and its replacement not started yet, it raised DiskProcessGone. Now the last
    answered stats come back."""
    pool.slot(0).fill_(5)
    proc.put_slots([0], [key(1)])
    before = proc.stats()
    assert before.num_blocks == 1
    proc.respawn_after_s = 3600.0  # the replacement is not due while the report runs
    stop(proc.pid)
    assert proc.fetch_slots([key(1)], [1])[0] == [0]  # past its deadline: lost
    assert proc.stats() == before


def test_a_stopped_child_fails_a_write_within_the_deadline(pool, proc):
    stop(proc.pid)
    t0 = time.monotonic()
    with pytest.raises(DiskProcessGone, match="hung"):
        proc.put_slots([0], [key(9)])
    assert time.monotonic() - t0 < 2.5 * TIMEOUT_S


def test_the_deadline_grows_with_the_bytes_a_request_moves(proc):
    per_share = DEADLINE_BYTES // GEO.block_bytes
    assert proc.deadline_s(wire.FETCH, 1) == TIMEOUT_S
    assert proc.deadline_s(wire.PUT, per_share) == TIMEOUT_S
    assert proc.deadline_s(wire.PUT, per_share + 1) == 2 * TIMEOUT_S
    assert proc.deadline_s(wire.STATS, 0) == proc.deadline_s(wire.DELETE, 3) == TIMEOUT_S
    assert proc.deadline_s(wire.KEYS, 0) == START_TIMEOUT_S  # once, at start-up


def test_request_timeout_is_read_from_yaml_and_checked(tmp_path):
    disk = {"path": str(tmp_path)}
    assert load_config(data={"tiers": {"disk": disk}}).disk.request_timeout_s == 5.0
    cfg = load_config(data={"tiers": {"disk": {**disk, "request_timeout_s": 30}}})
    assert cfg.disk.request_timeout_s == 30.0
    for bad in (0, -1, "soon"):
        with pytest.raises(ConfigError, match="request_timeout_s"):
            load_config(data={"tiers": {"disk": {**disk, "request_timeout_s": bad}}})
