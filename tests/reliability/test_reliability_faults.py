"""Full disk and I/O errors: the disk tier degrades, the CPU tier and the transfer workers carry
on, nothing wrong is ever served or indexed, and the disk comes back when it works again.

Faults are injected under the disk tier only (reliability.faults); one test also fills a real
tmpfs when this process may mount one.
"""

from __future__ import annotations

import random
import subprocess

import pytest

from reliability.blocks import block, identify, key
from reliability.faults import DiskFaults
from reliability.rig import StackRig

from kvtier.manager.disk_health import DiskHealth

WRITE_FAULTS = ["write_enospc", "write_eio", "torn_write", "fsync_eio", "index_full"]


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _work(rig: StackRig, lo: int, hi: int, old: int = 0) -> None:
    """Store keys lo..hi in pairs; after each, load a recent run and one old (disk) key."""
    for i in range(lo, hi, 2):
        rig.store_blocks([key(i), key(i + 1)])
        rig.drain()
        rig.load_blocks([key(j) for j in range(max(lo, i - 4), i)])
        if old < lo:
            rig.load_blocks([key(old + (i % max(1, lo - old)))])
        rig.drain()


def _disk_jobs(rig: StackRig) -> int:
    return rig.engine.stats()["CPU->DISK"].jobs


def _store_is_clean(rig: StackRig) -> None:
    """Everything the store lists reads back as exactly its key's block."""
    for k in rig.store.keys_by_age():
        data = rig.store.get(k)
        assert data is not None and identify(k, data) == 0, f"store lists a bad block {k.hex()}"


# -- the health state machine on its own ------------------------------------------------------

def test_disk_health_degrades_probes_backs_off_and_recovers():
    clock = FakeClock()
    h = DiskHealth(fail_threshold=3, retry_after_s=10, max_retry_after_s=25, clock=clock)
    assert h.admit(8) == 8
    h.on_demotion(False)
    h.on_demotion(False)
    h.on_demotion(True)  # a success in between resets the run
    h.on_demotion(False)
    h.on_demotion(False)
    assert not h.degraded and h.admit(8) == 8
    h.on_demotion(False)
    assert h.degraded and h.degradations == 1 and h.admit(8) == 0
    clock.t += 9.9
    assert h.admit(8) == 0
    clock.t += 0.2
    assert h.admit(8) == 1  # one probe block, and only one probe at a time
    h.on_demotion_started()
    assert h.admit(8) == 0
    h.on_demotion(False)  # probe failed: wait twice as long
    clock.t += 19.9
    assert h.admit(8) == 0
    clock.t += 0.2
    assert h.admit(8) == 1
    h.on_demotion_started()
    h.on_demotion(False)  # backoff is capped at 25 s
    clock.t += 25.1
    assert h.admit(8) == 1
    h.on_demotion_started()
    h.on_demotion(True)
    assert not h.degraded and h.admit(8) == 8 and h.degradations == 1
    with pytest.raises(ValueError):
        DiskHealth(fail_threshold=0)


# -- injected write faults through the whole stack ---------------------------------------------

@pytest.mark.parametrize("kind", WRITE_FAULTS)
def test_failing_disk_degrades_cpu_keeps_working_and_disk_recovers(tmp_path, kind):
    clock = FakeClock()
    rig = StackRig(tmp_path / "d", cpu_blocks=8, disk_blocks=64, fsync=True,
                   health=DiskHealth(fail_threshold=2, retry_after_s=10, clock=clock))
    stats = rig.manager.stats
    try:
        _work(rig, 0, 24)
        assert stats.stored_blocks["DISK"] > 0 and not stats.disk_degraded
        with DiskFaults(seed=1) as faults:
            faults.arm(kind)
            _work(rig, 24, 40, old=0)
            assert stats.disk_degraded and stats.disk_degradations == 1
            assert faults.injected[kind] >= 2
            # degraded: no demotion is even tried until the cool-down is over ...
            jobs, skipped = _disk_jobs(rig), stats.store_skipped_no_space
            cpu_stored, disk_hits = rig.c.stored_blocks, rig.c.loaded_blocks["DISK"]
            _work(rig, 40, 64, old=0)
            assert _disk_jobs(rig) == jobs
            # ... while the CPU tier keeps storing and serving, and the disk keeps serving reads
            assert rig.c.stored_blocks == cpu_stored + 24
            assert stats.store_skipped_no_space == skipped  # dirty blocks are evictable now
            assert rig.c.loaded_blocks["DISK"] > disk_hits
            clock.t += 10.5  # cool-down over: exactly one probe, which fails too
            _work(rig, 64, 70)
            assert _disk_jobs(rig) == jobs + 1 and stats.disk_degraded
            faults.disarm()  # space is back
            clock.t += 10.5  # the backoff doubled: still waiting
            _work(rig, 70, 74)
            assert _disk_jobs(rig) == jobs + 1
            clock.t += 10.0
            before = stats.stored_blocks["DISK"]
            _work(rig, 74, 100)
        assert not stats.disk_degraded and stats.disk_degradations == 1
        assert stats.stored_blocks["DISK"] > before + 1  # demotions flow again
        assert rig.c.wrong_blocks == 0 and rig.c.failed_load_blocks == 0
        rig.drain()
        assert rig.leaks() == dict.fromkeys(rig.leaks(), 0)
        _store_is_clean(rig)  # no failed batch left an indexed record behind
    finally:
        rig.close()


def test_read_errors_are_misses_and_the_blocks_are_forgotten(tmp_path):
    rig = StackRig(tmp_path / "d", cpu_blocks=4, disk_blocks=32, flush_reserve=4)
    try:
        keys = [key(i) for i in range(12)]
        for i in range(0, 12, 2):
            rig.store_blocks(keys[i:i + 2])
            rig.drain()
        disk_only = keys[:8]
        with DiskFaults() as faults:
            faults.arm("read_eio")
            assert rig.load_blocks(keys[8:]) == 4  # CPU hits are untouched by the disk's trouble
            rig.drain()
            for k in disk_only[:4]:  # promoted by the lookup; the read fails: a miss
                assert rig.load_blocks([k]) == 0
            rig.drain()
        assert faults.injected["read_eio"] == 4
        assert rig.c.failed_load_blocks == 4 and not rig.c.failed_jobs
        assert rig.c.promoted_blocks == 0 and rig.manager.stats.failed_loads_transient == 4
        assert all(k not in rig.manager.cpu and k not in rig.manager.disk
                   for k in disk_only[:4])
        assert rig.c.loaded_blocks["CPU"] == 4 and rig.c.wrong_blocks == 0
        assert rig.manager.lookup(disk_only[:4]).num_hits == 0
        assert rig.store.stats().read_errors == 4
        for k in disk_only[4:]:  # the disk works again: the rest still loads exactly
            assert rig.load_blocks([k]) == 1
            rig.drain()
        assert rig.c.loaded_blocks["DISK"] == 4 and rig.c.wrong_blocks == 0
        assert rig.leaks() == dict.fromkeys(rig.leaks(), 0)
    finally:
        rig.close()


def test_random_faults_of_every_kind_under_load_serve_nothing_wrong(tmp_path):
    rng = random.Random(5)
    clock = FakeClock()
    rig = StackRig(tmp_path / "d", cpu_blocks=12, disk_blocks=48, disk_write_jobs=2, fsync=True,
                   health=DiskHealth(fail_threshold=3, retry_after_s=1, clock=clock))
    try:
        with DiskFaults(seed=9) as faults:
            for kind in ("write_enospc", "write_eio", "torn_write", "fsync_eio", "index_full"):
                faults.arm(kind, 0.06)
            faults.arm("read_eio", 0.1)
            for step in range(400):
                clock.t += rng.random()
                base = rng.randrange(0, 120)
                keys = [key(base + j) for j in range(rng.randint(1, 4))]
                if rng.random() < 0.5:
                    rig.store_blocks(keys)
                else:
                    rig.load_blocks(keys)
                rig.throttle(4)
            rig.drain()
        assert len(faults.injected) == 6 and sum(faults.injected.values()) >= 40, faults.injected
        assert rig.c.failed_load_blocks > 0  # read errors reached loads, not only compaction
        assert rig.c.wrong_blocks == 0
        assert rig.c.loaded_blocks["DISK"] > 0 and rig.c.loaded_blocks["CPU"] > 0
        assert rig.leaks() == dict.fromkeys(rig.leaks(), 0)
        _store_is_clean(rig)
        for k in rig.store.keys_by_age()[:5]:  # engine and disk alive after the storm
            if rig.manager.lookup([k]).num_hits:
                rig.load_blocks([k])
        rig.drain()
        assert rig.c.wrong_blocks == 0
    finally:
        rig.close()


# -- a real full file system -------------------------------------------------------------------

@pytest.fixture
def small_tmpfs(tmpfs_mount):
    return tmpfs_mount("320k", "the injected-ENOSPC tests above cover this path otherwise")


def test_real_full_tmpfs_degrades_and_recovers_when_space_returns(small_tmpfs):
    clock = FakeClock()
    rig = StackRig(small_tmpfs / "d", cpu_blocks=8, disk_blocks=4096, fsync=True,
                   compression="none", segment_bytes=8 * 2120,
                   health=DiskHealth(fail_threshold=2, retry_after_s=10, clock=clock))
    stats = rig.manager.stats
    try:
        i = 0
        while not stats.disk_degraded and i < 2000:  # ~150 blocks fill 320 KiB
            _work(rig, i, i + 8)
            i += 8
        assert stats.disk_degraded, "the tmpfs never filled up"
        assert rig.store.stats().write_errors >= 2
        cpu_stored = rig.c.stored_blocks
        _work(rig, i, i + 40)
        assert rig.c.stored_blocks == cpu_stored + 40  # the CPU tier does not care
        subprocess.run(["mount", "-o", "remount,size=8m", str(small_tmpfs)], check=True)
        clock.t += 11
        before = stats.stored_blocks["DISK"]
        _work(rig, i + 40, i + 80)
        assert not stats.disk_degraded and stats.stored_blocks["DISK"] > before
        assert rig.c.wrong_blocks == 0
        rig.drain()
        assert rig.leaks() == dict.fromkeys(rig.leaks(), 0)
        _store_is_clean(rig)
    finally:
        rig.close()


def test_block_helper_is_self_checking():
    assert identify(key(1), block(key(1))) == 0
    assert identify(key(1), block(key(2))) is None
    assert identify(key(1), block(key(1), 3, compressible=True)) == 3
