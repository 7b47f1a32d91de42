"""One load path (``kvtier.runtime.load_job``): which keys a failed load really failed.

A disk hit whose DISK -> CPU hop worked but whose CPU -> GPU hop raised has an intact disk
record and an intact CPU copy: only the engine's blocks are untrusted. ``kvtier bench`` and
the reliability rig used to fail every key of an errored job, so the manager forgot disk
blocks that were fine (the record stayed on disk, unindexed: leaked).
"""

from __future__ import annotations

import pytest

from kvtier.bench.replay import Replay, block_key
from kvtier.bench.trace import TraceRequest
from kvtier.config import load_config
from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.runtime import worker as worker_mod
from kvtier.runtime.load_job import (excluded_keys, failed_load_keys, gpu_untrusted, load_hops,
                                     load_outcome, measured_hops)
from kvtier.transfer.cpu_copy import CpuToGpuHandler, GpuToCpuHandler
from kvtier.transfer.jobs import JobResult

BB = 16 * 1024
CPU_TO_GPU = (Medium.CPU, Medium.GPU)
DISK_TO_CPU = (Medium.DISK, Medium.CPU)


def result(error=None, direction=CPU_TO_GPU, failed=(), hops=()):
    return JobResult(1, error is None and not failed, error, tuple(failed), 0, 0.0, direction,
                     tuple(hops))


def test_copy_to_gpu_error_fails_no_key_but_untrusts_the_gpu():
    r = result("boom", CPU_TO_GPU, hops=[(DISK_TO_CPU, 100, 0.1)])
    assert failed_load_keys(r, [b"a", b"b"]) == set()
    assert gpu_untrusted(r)
    assert measured_hops(r) == []  # a failed job teaches the cost model nothing


def test_disk_read_error_fails_every_promoted_key():
    r = result("eio", DISK_TO_CPU)
    assert failed_load_keys(r, [b"a", b"b"], excluded=[b"c"]) == {b"a", b"b", b"c"}


def test_unreadable_records_fail_alone():
    r = result(None, CPU_TO_GPU, failed=[b"b"], hops=[(DISK_TO_CPU, 10, 0.5), (CPU_TO_GPU, 0, 0.1)])
    assert failed_load_keys(r, [b"a", b"b"]) == {b"b"}
    assert not gpu_untrusted(r)
    assert measured_hops(r) == [(Medium.DISK, 10, 0.5)]


def test_only_joined_keys_that_a_joined_promotion_failed_are_excluded():
    keys, joined = [b"a", b"b", b"c"], [False, True, True]
    # b"a" failed in a promotion too, but this load reads it itself: not excluded
    assert excluded_keys(keys, joined, [{b"a", b"b"}, set()]) == {b"b"}
    assert excluded_keys(keys, joined, []) == frozenset()
    assert excluded_keys(keys, (), [{b"b"}]) == frozenset()  # joined nothing


def test_a_load_outcome_names_failed_keys_their_blocks_and_what_joined_loads_miss():
    keys, from_disk = [b"a", b"b", b"c"], [True, True, False]
    r = JobResult(1, False, None, (b"b", b"c"), 0, 0.0, CPU_TO_GPU,
                  ((DISK_TO_CPU, 10, 0.5), (CPU_TO_GPU, 30, 0.1)), transient_keys=(b"b",))
    out = load_outcome(r, keys, from_disk, gpu_ids=[1, 2, 3, 4, 5, 6], per_block=2,
                       unloaded_gpu_ids=[9])
    assert out.failed == (b"b", b"c") and out.transient == (b"b",)  # key order
    assert out.untrusted_gpu_ids == {3, 4, 5, 6, 9}
    assert out.promotion_failed == {b"b"}  # of the promoted keys only
    assert out.measured == ((Medium.DISK, 10, 0.5), (Medium.CPU, 30, 0.1))


def test_a_load_outcome_after_a_hop_raised_trusts_no_block_and_measures_nothing():
    r = result("boom", CPU_TO_GPU, hops=[(CPU_TO_GPU, 100, 0.1)])
    out = load_outcome(r, [b"a", b"b"], [False, False], gpu_ids=[1, 2], per_block=1,
                       excluded=[b"b"])
    assert out.failed == (b"b",) and out.transient == ()
    assert out.untrusted_gpu_ids == {1, 2} and out.measured == ()
    assert out.promotion_failed is None  # it promoted nothing: no joined load waits on it


def test_hops_promote_then_copy_all_but_excluded():
    hops = load_hops([b"a", b"b", b"c"], [5, 6, 7], [True, False, False],
                     [1, 2, 3, 4, 8, 9], 2, excluded={b"b"})
    assert hops == [(LoadStoreSpec.disk([b"a"]), LoadStoreSpec.cpu([5])),
                    (LoadStoreSpec.cpu([5, 7]), LoadStoreSpec.gpu([1, 2, 8, 9]))]
    assert load_hops([b"a"], [1], [False], [1], 1, excluded={b"a"}) == []
    # nothing excluded: every key's pages, in order
    assert load_hops([b"a", b"b"], [3, 4], [False, False], [7, 8, 9, 10], 2) == [
        (LoadStoreSpec.cpu([3, 4]), LoadStoreSpec.gpu([7, 8, 9, 10]))]


def test_a_whole_load_marks_its_engine_copy_whole_and_nothing_else():
    """``whole`` (the forward waits for the whole load) reaches the copy into the engine's
    pages, with or without exclusions; promotions into the CPU tier are not marked."""
    for excluded in ((), {b"b"}):
        hops = load_hops([b"a", b"b"], [3, 4], [True, False], [7, 8], 1, excluded=excluded,
                         whole=True)
        assert [dst.whole for _, dst in hops] == [False, True]
        assert hops[-1][1] != LoadStoreSpec.gpu(hops[-1][1].ids)  # the flag is part of it
    assert not load_hops([b"a"], [3], [False], [7], 1)[0][1].whole


class FlakyCpuToGpu(CpuToGpuHandler):
    failing = False

    async def run(self, src, dst):
        if FlakyCpuToGpu.failing:
            raise RuntimeError("injected CPU -> GPU copy failure")
        return await super().run(src, dst)


@pytest.fixture
def flaky_bench(monkeypatch, tmp_path):
    monkeypatch.setattr(worker_mod, "gpu_handlers",
                        lambda view, pool: [GpuToCpuHandler(view, pool), FlakyCpuToGpu(view, pool)])
    monkeypatch.setattr(FlakyCpuToGpu, "failing", False)
    cfg = load_config(text=f"tiers:\n  cpu: {{capacity: {4 * BB}}}\n"
                           f"  disk: {{path: {tmp_path / 'disk'}, capacity: {64 * BB}, fsync: false}}\n",
                      env={})
    rep = Replay(cfg, BB, gpu_blocks=16)
    yield rep
    rep.close()


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
    assert rep.manager.lookup(keys, sighting=False).tiers == (Medium.DISK,) * 4

    FlakyCpuToGpu.failing = True
    rep.run_request(request(a))
    rep.drain()
    FlakyCpuToGpu.failing = False
    disk = rep.manager.tier(Medium.DISK)
    assert rep.result.failed_loads == 4  # recomputed: the engine's copies were not trusted
    assert rep.manager.stats.failed_loads == 0  # ... but no block was bad
    assert all(disk.is_ready(k) for k in keys), "an intact disk block was forgotten"
    assert sorted(rep.worker.store.keys_by_age()) == sorted(disk.entries), "disk record leaked"

    rep.engine_cache.release(keys)
    before = dict(rep.result.blocks)
    rep.run_request(request(a))  # the promotion's CPU copies were published: CPU hits
    assert rep.result.blocks["CPU"] - before["CPU"] == 4
    assert rep.result.wrong_blocks == 0


def test_a_remote_reads_progress_points_are_samples_of_its_line():
    """The points a shared-tier read reported on its way (bytes verified, seconds since it
    started) feed the cost model beside the hop itself; points too small to measure a
    bandwidth are left out, and a failed load teaches nothing."""
    from kvtier.manager.cost import MIN_SAMPLE_BYTES

    remote = (Medium.REMOTE, Medium.CPU)
    mib = 1 << 20
    hops = [(remote, 256 * mib, 0.0725), (CPU_TO_GPU, 256 * mib, 0.0067)]
    progress = [(remote, 8 * mib, 0.041), (remote, 64 * mib, 0.048), (remote, 192 * mib, 0.063)]
    assert 8 * mib < MIN_SAMPLE_BYTES <= 64 * mib
    ok = JobResult(1, True, None, (), 0, 0.0, CPU_TO_GPU, tuple(hops), progress=tuple(progress))
    assert measured_hops(ok) == [(Medium.REMOTE, 256 * mib, 0.0725),
                                 (Medium.CPU, 256 * mib, 0.0067),
                                 (Medium.REMOTE, 64 * mib, 0.048),
                                 (Medium.REMOTE, 192 * mib, 0.063)]
    failed = JobResult(1, False, "gone", (), 0, 0.0, remote, tuple(hops[:1]),
                       progress=tuple(progress))
    assert measured_hops(failed) == []


def test_a_long_reads_progress_gives_two_samples_not_dozens():
    """A read reports dozens of points; the cost model forgets per sample, so keeping them all
    would let one job (a cold first one) outweigh the next several. Two are kept, a third and
    two thirds of the way, beside the hop itself."""
    from kvtier.runtime.load_job import PROGRESS_SAMPLES

    remote = (Medium.REMOTE, Medium.CPU)
    mib = 1 << 20
    progress = [(remote, 16 * mib * (i + 1), 0.01 * (i + 1)) for i in range(24)]
    hops = [(remote, 384 * mib, 0.25), (CPU_TO_GPU, 384 * mib, 0.02)]
    r = JobResult(1, True, None, (), 0, 0.0, CPU_TO_GPU, tuple(hops), progress=tuple(progress))
    got = measured_hops(r)
    assert PROGRESS_SAMPLES == 2
    assert got == [(Medium.REMOTE, 384 * mib, 0.25), (Medium.CPU, 384 * mib, 0.02),
                   (Medium.REMOTE, 16 * mib * 9, 0.09), (Medium.REMOTE, 16 * mib * 17, 0.17)]
