"""A failed load of a CPU hit must not free a slot that a queued demotion still reads (issue 14.1).

The old ``complete_load(keys, failed)`` dropped a failed CPU hit at once. With the block's
CPU -> DISK demotion already handed out (taken, not yet run), the slot went back to the free
list, the next store wrote another block into it, and the demotion then copied that block's
bytes to disk under the first key, with a valid checksum: a later disk hit served wrong bytes.
The same held for a second load still reading the slot. A load (one CPU -> GPU copy) reads the
slot and never writes it, so the block stays resident after a failed load.

The first test runs the exact sequence through the real manager, CPU pool, disk store and
transfer engine (the reliability rig's stack), failing the load by a real copy error; the
others pin down the manager's side, including a failed promotion (DISK -> CPU, the read that
writes the slot), which does free it.
"""

from __future__ import annotations

import logging

import pytest

from reliability.blocks import block, key
from reliability.rig import StackRig

from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.manager.tiered import TieredOffloadingManager
from kvtier.transfer.jobs import untrusted_gpu_ids
from support.promotions import settle_promotions


@pytest.fixture
def rig(tmp_path):
    logging.disable(logging.WARNING)
    # 2 CPU slots and a flush reserve of 2: every stored block is demoted at once
    r = StackRig(tmp_path / "disk", cpu_blocks=2, disk_blocks=8, gpu_blocks=8,
                 compression="none", flush_reserve=2)
    yield r
    r.close()
    logging.disable(logging.NOTSET)


def _store(rig: StackRig, k: bytes) -> None:
    """The engine computed ``k``: GPU -> CPU through the real engine, then complete_store."""
    b = rig.free_gpu.pop()
    rig._write_gpu(k, b)
    plan = rig.manager.prepare_store([k])
    assert plan.keys == (k,)
    [res] = rig.engine.wait([rig.engine.submit(LoadStoreSpec.gpu([b]), plan.dst)], timeout=30)
    assert res.ok
    rig.manager.complete_store(plan.keys, True)
    rig.free_gpu.append(b)


def _load(rig: StackRig, k: bytes, gpu_id: int, report_failed: bool = False
          ) -> tuple[bool, bool]:
    """Load ``k`` into engine block ``gpu_id`` as the connector does: lookup until no longer
    "not yet" (a disk hit is promoted into CPU memory by the rig's pump meanwhile), then one
    CPU -> GPU job read with ``untrusted_gpu_ids``; (job ok, bytes right). ``report_failed``: a
    caller that reports the keys of a failed copy as failed anyway (the harshest caller the
    contract allows)."""
    assert rig.lookup([k]) == 1
    plan = rig.manager.prepare_load([k])
    assert plan.keys == (k,) and plan.src == LoadStoreSpec.cpu(plan.cpu_slots)
    [res] = rig.engine.wait([rig.engine.submit(plan.src, LoadStoreSpec.gpu([gpu_id]))],
                            timeout=30)
    untrusted = untrusted_gpu_ids(res, [gpu_id])
    right = not untrusted and rig._gpu_holds(k, gpu_id)
    failed = plan.keys if report_failed and untrusted else ()
    rig.manager.complete_load(plan.keys, failed)
    return res.ok and not untrusted, right


@pytest.mark.parametrize("report_failed", [False, True])
def test_failed_cpu_hit_load_does_not_let_a_queued_demotion_write_another_blocks_bytes(
        rig, report_failed):
    m = rig.manager
    a, b, c = key(1), key(2), key(3)
    _store(rig, a)
    [demotion] = m.take_background_transfers()  # A's CPU -> DISK copy: taken, not yet run
    assert demotion.keys == (a,) and demotion.dst.medium is Medium.DISK

    # A CPU hit of A whose CPU -> GPU copy errors (engine block id out of range: the copy
    # raises, as a CUDA error would): no engine block of it is trusted.
    ok, _ = _load(rig, a, gpu_id=10_000, report_failed=report_failed)
    assert not ok
    assert a in m.cpu  # the demotion still reads A's slot

    _store(rig, b)  # old code: B lands in A's freed slot
    [res] = rig.engine.wait([rig.engine.submit(demotion.src, demotion.dst)], timeout=30)
    m.complete_background(demotion.id, res.ok)
    assert res.ok

    assert rig.store.get(a) == block(a), "the disk record for A holds another block's bytes"
    # push A out of CPU memory, so the next load of A really comes from disk
    for t in m.take_background_transfers():
        [r] = rig.engine.wait([rig.engine.submit(t.src, t.dst)], timeout=30)
        m.complete_background(t.id, r.ok)
    _store(rig, c)
    rig.drain()
    if a not in m.cpu:  # on disk only: the lookup promotes it (the rig runs the read)
        assert a in m.disk
        promoted = rig.c.promoted_blocks
        ok, right = _load(rig, a, gpu_id=rig.free_gpu[0])
        assert rig.c.promoted_blocks == promoted + 1
    else:
        ok, right = _load(rig, a, gpu_id=rig.free_gpu[0])
    assert ok and right, "a load of A served bytes that are not A's"
    rig.drain()
    assert m.pins() == 0 and m.stats.protocol_errors == 0
    assert rig.c.failed_load_blocks == 0


def test_failed_cpu_hit_keeps_the_block_and_releases_only_its_own_pin():
    m = TieredOffloadingManager(cpu_blocks=2, disk_blocks=4, flush_reserve=2)
    a, b = b"A", b"B"
    plan = m.prepare_store([a])
    m.complete_store(plan.keys)
    slot_a = plan.cpu_slots[0]
    [demotion] = m.take_background_transfers()
    first = m.prepare_load([a])
    second = m.prepare_load([a])  # another request reading the same slot
    assert m.cpu.entries[a].readers == 2
    m.complete_load(first.keys, failed=first.keys)
    entry = m.cpu.get(a)
    assert entry is not None and entry.readers == 1 and entry.flushing
    assert m.lookup([a]).tiers == (Medium.CPU,)  # the CPU bytes are intact: still a hit
    plan_b = m.prepare_store([b])
    assert plan_b.keys == (b,) and plan_b.cpu_slots[0] != slot_a
    m.complete_store(plan_b.keys)
    m.complete_load(second.keys)
    m.complete_background(demotion.id, True)
    for t in m.take_background_transfers():
        m.complete_background(t.id, True)
    assert m.pins() == 0 and m.stats.protocol_errors == 0 and m.stats.failed_loads == 1


@pytest.mark.parametrize("how", ["failed_key", "read_raised"])
def test_failed_promotion_still_frees_its_slot(how):
    """A failed DISK -> CPU read left the CPU slot half written: that block must go (and the
    disk copy is treated as bad), unlike a CPU hit."""
    m = TieredOffloadingManager(cpu_blocks=1, disk_blocks=4, flush_reserve=1)
    plan = m.prepare_store([b"A"])
    m.complete_store(plan.keys)
    for t in m.take_background_transfers():
        m.complete_background(t.id, True)
    plan = m.prepare_store([b"B"])  # A is clean: evicted from CPU, kept on disk
    m.complete_store(plan.keys)
    for t in m.take_background_transfers():
        m.complete_background(t.id, True)
    found = m.lookup([b"A"])
    assert found.pending and found.tiers == ()
    assert b"A" in m.cpu and m.cpu.free_count == 0  # B made room for A's promotion
    if how == "failed_key":
        [promotion] = settle_promotions(m, failed=[b"A"])
    else:
        [promotion] = settle_promotions(m, ok=False)
    assert promotion.keys == (b"A",) and promotion.src.medium is Medium.DISK
    assert b"A" not in m.cpu and b"A" not in m.disk and m.cpu.free_count == 1
    assert m.stats.failed_loads == 1
    drops = m.take_background_transfers()  # the record is deleted on every rank
    assert [(t.dst.medium, t.keys) for t in drops] == [(Medium.DROP, (b"A",))]
    for t in drops:
        m.complete_background(t.id, True)
    found = m.lookup([b"A"])
    assert found.tiers == () and not found.pending
    assert m.pins() == 0 and m.stats.protocol_errors == 0
