"""One load path (``kvtier.transfer.jobs``): what a finished load or promotion means.

A load is one CPU -> GPU copy of READY CPU slots; blocks held on disk (or in the shared tier)
are promoted into CPU memory first, as background transfers. A copy into the GPU that raised
fails no key: the disk record and the CPU copy are intact, only the engine's blocks are
untrusted. ``kvtier bench`` and the reliability rig used to fail every key of an errored job,
so the manager forgot disk blocks that were fine (the record stayed on disk, unindexed:
leaked). A promotion that could not read a key fails that key (the manager forgets it); one
that raised failed every key it promoted (nothing reached the CPU slots).
"""

from __future__ import annotations

import pytest

from support.disk_records import record_entry, segment_path

from kvtier.bench.replay import Replay, block_key
from kvtier.bench.trace import TraceRequest
from kvtier.config import load_config
from kvtier.manager.specs import Medium
from kvtier.runtime import worker as worker_mod
from kvtier.transfer.jobs import (gpu_untrusted, is_promotion, measured_hops, promotion_outcome,
                                  untrusted_gpu_ids)
from kvtier.transfer.cpu_copy import CpuToGpuHandler, GpuToCpuHandler
from kvtier.transfer.jobs import JobResult

BB = 16 * 1024
CPU_TO_GPU = (Medium.CPU, Medium.GPU)
DISK_TO_CPU = (Medium.DISK, Medium.CPU)
REMOTE_TO_CPU = (Medium.REMOTE, Medium.CPU)


def result(error=None, direction=CPU_TO_GPU, failed=(), nbytes=0, seconds=0.0, transient=()):
    return JobResult(1, error is None and not failed, error, tuple(failed), nbytes, seconds,
                     direction, transient_keys=tuple(transient))


def test_only_reads_from_below_into_the_cpu_tier_are_promotions():
    assert is_promotion(Medium.DISK, Medium.CPU) and is_promotion(Medium.REMOTE, Medium.CPU)
    for route in ((Medium.CPU, Medium.GPU), (Medium.GPU, Medium.CPU),
                  (Medium.CPU, Medium.DISK), (Medium.CPU, Medium.REMOTE),
                  (Medium.DISK, Medium.DISK)):
        assert not is_promotion(*route), route


def test_a_copy_to_gpu_that_raised_untrusts_every_engine_block_and_measures_nothing():
    r = result("boom", CPU_TO_GPU, nbytes=100, seconds=0.1)
    assert gpu_untrusted(r)
    assert measured_hops(r) == []  # a failed job teaches the cost model nothing
    assert untrusted_gpu_ids(r, gpu_ids=[1, 2, 3, 4], unloaded_gpu_ids=[9]) == {1, 2, 3, 4, 9}


def test_a_load_that_worked_untrusts_only_what_no_tier_supplied_and_measures_its_copy():
    r = result(None, CPU_TO_GPU, nbytes=30, seconds=0.1)
    assert not gpu_untrusted(r)
    assert untrusted_gpu_ids(r, gpu_ids=[1, 2, 3], unloaded_gpu_ids=[7, 8]) == {7, 8}
    assert measured_hops(r) == [(Medium.CPU, 30, 0.1)]
    assert untrusted_gpu_ids(r, gpu_ids=[1]) == frozenset()


def test_a_promotion_fails_its_unreadable_records_alone_in_key_order():
    keys = [b"a", b"b", b"c", b"d"]
    r = result(None, DISK_TO_CPU, failed=[b"d", b"b"], nbytes=20, seconds=0.5,
               transient=[b"d", b"x"])  # x: not one of the failed keys
    out = promotion_outcome(r, keys)
    assert out.failed == (b"b", b"d") and out.transient == (b"d",)
    assert out.measured == ((Medium.DISK, 20, 0.5),)
    fine = promotion_outcome(result(None, DISK_TO_CPU, nbytes=40, seconds=0.2), keys)
    assert (fine.failed, fine.transient, fine.measured) == ((), (), ((Medium.DISK, 40, 0.2),))


def test_a_promotion_whose_read_raised_fails_every_key_it_promoted():
    keys = [b"a", b"b", b"c"]
    for route in (DISK_TO_CPU, REMOTE_TO_CPU):
        r = result("eio", route, failed=[b"b"], transient=[b"a", b"b", b"c"],
                   nbytes=10, seconds=0.1)
        out = promotion_outcome(r, keys)
        assert out.failed == (b"a", b"b", b"c")  # nothing reached the CPU slots
        assert out.transient == (b"a", b"b", b"c")
        assert out.measured == ()


class FlakyCpuToGpu(CpuToGpuHandler):
    failing = False

    async def run(self, src, dst):
        if FlakyCpuToGpu.failing:
            raise RuntimeError("injected CPU -> GPU copy failure")
        return await super().run(src, dst)


@pytest.fixture
def flaky_bench(monkeypatch, tmp_path):
    monkeypatch.setattr(worker_mod, "gpu_handlers",
                        lambda view, pool, **_: [GpuToCpuHandler(view, pool),
                                                 FlakyCpuToGpu(view, pool)])
    monkeypatch.setattr(FlakyCpuToGpu, "failing", False)
    cfg = load_config(text=f"tiers:\n  cpu: {{capacity: {4 * BB}}}\n"
                           f"  disk: {{path: {tmp_path / 'disk'}, capacity: {64 * BB}, fsync: false,\n"
                           # a loaded CI machine can keep the disk I/O child from answering
                           # within the default 5 s: it would be taken as hung, the promotion
                           # failed and every hit a miss (what these tests check is elsewhere)
                           f"         request_timeout_s: 120}}\n",
                      env={})
    rep = Replay(cfg, BB, gpu_blocks=16)
    yield rep
    rep.close()


def settled(rep):
    """Drain until no transfer is left: a drain's last pump may queue a demotion."""
    for _ in range(20):
        rep.drain()
        if not rep._background and not rep._stores:
            return
    raise AssertionError("transfers kept coming")


def request(ids):
    return TraceRequest(0.0, 512 * len(ids), 1, tuple(ids))


def test_bench_disk_hit_whose_gpu_copy_fails_keeps_its_disk_block(flaky_bench):
    rep = flaky_bench
    a = [1, 2, 3, 4]
    keys = [block_key(h) for h in a]
    rep.run_request(request(a))
    rep.drain()
    for first in (10, 20, 30):  # push a's blocks out of the CPU tier
        rep.run_request(request(range(first, first + 4)))
        rep.drain()
    assert rep.manager.usage()["CPU"]["capacity_blocks"] == 4
    rep.engine_cache.release(keys)
    disk, cpu = rep.manager.tier(Medium.DISK), rep.manager.tier(Medium.CPU)
    assert all(disk.is_ready(k) for k in keys)
    assert not any(cpu.is_ready(k) for k in keys)  # a disk hit: promoted, then loaded

    FlakyCpuToGpu.failing = True
    rep.run_request(request(a))
    settled(rep)
    FlakyCpuToGpu.failing = False
    assert rep.result.failed_loads == 4  # recomputed: the engine's copies were not trusted
    assert rep.manager.stats.failed_loads == 0  # ... but no block was bad
    assert all(disk.is_ready(k) for k in keys), "an intact disk block was forgotten"
    assert sorted(rep.worker.store.keys_by_age()) == sorted(disk.entries), "disk record leaked"
    assert all(cpu.is_ready(k) for k in keys), "the promotion's CPU copies were dropped"

    rep.engine_cache.release(keys)
    before = dict(rep.result.blocks)
    rep.run_request(request(a))  # the promotion's CPU copies were published: CPU hits
    assert rep.result.blocks["CPU"] - before["CPU"] == 4
    assert rep.result.blocks.get("DISK", 0) == before.get("DISK", 0)
    assert rep.result.wrong_blocks == 0


def test_bench_disk_hit_whose_record_is_unreadable_recomputes_and_forgets_it(flaky_bench):
    """The DISK -> CPU promotion could not read one record: that key is failed and forgotten
    (its CPU slot freed, its disk entry dropped); the blocks before it are loaded from the
    CPU tier, the rest recomputed, nothing wrong reaches the engine."""
    rep = flaky_bench
    a = [1, 2, 3, 4]
    keys = [block_key(h) for h in a]
    rep.run_request(request(a))
    rep.drain()
    for first in (10, 20, 30):
        rep.run_request(request(range(first, first + 4)))
        rep.drain()
    rep.engine_cache.release(keys)
    disk = rep.manager.tier(Medium.DISK)
    assert all(disk.is_ready(k) for k in keys)
    entry = record_entry(rep.worker.store, keys[2])
    with open(segment_path(rep.worker.store, entry.segment), "r+b") as f:
        f.seek(entry.offset + entry.length - 64)
        chunk = f.read(16)
        f.seek(entry.offset + entry.length - 64)
        f.write(bytes(x ^ 0xFF for x in chunk))  # its checksum no longer matches

    before = dict(rep.result.blocks)
    rep.run_request(request(a))
    settled(rep)
    assert rep.result.wrong_blocks == 0
    assert rep.result.blocks.get("DISK", 0) - before.get("DISK", 0) == 2  # a[0], a[1]
    # the unreadable record is gone (vLLM recomputed the block: it may be stored again, as a
    # new record)
    assert record_entry(rep.worker.store, keys[2]) != entry, "an unreadable record was kept"
    assert rep.manager.stats.failed_loads == 1  # that record alone
    assert all(disk.is_ready(k) for k in keys[:2] + keys[3:]), "an intact record was forgotten"
    assert sorted(rep.worker.store.keys_by_age()) == sorted(disk.entries), "disk record leaked"


def test_a_remote_reads_progress_points_are_samples_of_its_line():
    """The points a shared-tier promotion reported on its way (bytes verified, seconds since
    it started) feed the cost model beside the read itself; points too small to measure a
    bandwidth are left out, and a failed read teaches nothing."""
    from kvtier.manager.cost import MIN_SAMPLE_BYTES

    mib = 1 << 20
    progress = [(8 * mib, 0.041), (64 * mib, 0.048), (192 * mib, 0.063)]
    assert 8 * mib < MIN_SAMPLE_BYTES <= 64 * mib
    ok = JobResult(1, True, None, (), 256 * mib, 0.0725, REMOTE_TO_CPU, progress=tuple(progress))
    assert measured_hops(ok) == [(Medium.REMOTE, 256 * mib, 0.0725),
                                 (Medium.REMOTE, 64 * mib, 0.048),
                                 (Medium.REMOTE, 192 * mib, 0.063)]
    assert promotion_outcome(ok, [b"a"]).measured == tuple(measured_hops(ok))
    failed = JobResult(1, False, "gone", (), 256 * mib, 0.0725, REMOTE_TO_CPU,
                       progress=tuple(progress))
    assert measured_hops(failed) == []
    # a load into the GPU measures its copy (the CPU tier's bandwidth) alone
    copy = JobResult(1, True, None, (), 256 * mib, 0.0067, CPU_TO_GPU)
    assert measured_hops(copy) == [(Medium.CPU, 256 * mib, 0.0067)]
    assert measured_hops(JobResult(1, True, None, (), 0, 0.0, CPU_TO_GPU)) == []  # moved none


def test_a_long_reads_progress_gives_two_samples_not_dozens():
    """A read reports dozens of points; the cost model forgets per sample, so keeping them all
    would let one job (a cold first one) outweigh the next several. Two are kept, a third and
    two thirds of the way, beside the read itself."""
    from kvtier.transfer.jobs import PROGRESS_SAMPLES

    mib = 1 << 20
    progress = [(16 * mib * (i + 1), 0.01 * (i + 1)) for i in range(24)]
    r = JobResult(1, True, None, (), 384 * mib, 0.25, REMOTE_TO_CPU, progress=tuple(progress))
    got = measured_hops(r)
    assert PROGRESS_SAMPLES == 2
    assert got == [(Medium.REMOTE, 384 * mib, 0.25),
                   (Medium.REMOTE, 16 * mib * 9, 0.09), (Medium.REMOTE, 16 * mib * 17, 0.17)]
