"""Tensor parallelism: every rank's disk directory holds the same blocks, and only those.

Ranks are simulated in one process the way the connector runs them: the settings give each
rank its config (``rank_config``: its own directory, the same capacity) and geometry; every
background move and load runs on every rank, and the manager hears one outcome per job (ok
only if it worked on all ranks, failed keys unioned), as the scheduler's job ledger does.
Before the fix, a demotion that failed on one rank or a record found corrupt on one rank was
forgotten by the index while the other ranks kept their slices, and a restart intersected the
ranks' keys and never deleted the rest: disk use grew past capacity run after run. A read that
failed on one rank (corrupt, or transiently: EIO, EMFILE) is now deleted on every rank within
the run, and a transient failure is counted as such, not as corruption.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from reliability.corrupt import flip_payload

from kvtier.config import load_config
from kvtier.tiers.disk.catalog.inventory import restored_keys
from kvtier.connectors.vllm.settings import ConnectorSettings
from kvtier.manager.factory import build_manager
from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.disk import DiskStore
from kvtier.transfer import TransferEngine
from kvtier.transfer.disk_io import CpuToDiskHandler, DiskDropHandler, DiskToCpuHandler
from support.promotions import is_promotion  # noqa: E402

PAGE = 1024
LAYERS = 2
BLOCK = LAYERS * PAGE  # one rank's slice of a block


def settings_for(tmp: Path, world: int, cpu_blocks: int = 4, disk_blocks: int = 6) -> ConnectorSettings:
    cfg = load_config(text=f"tiers:\n  cpu: {{capacity: {cpu_blocks * BLOCK}}}\n"
                           f"  disk: {{path: {tmp / 'disk'}, capacity: {disk_blocks * BLOCK}, "
                           f"fsync: false, compression: none}}\n", env={})
    return ConnectorSettings(config=cfg, block_size=16, hash_block_size=16, block_tokens=16,
                             layer_names=tuple(f"l{i}" for i in range(LAYERS)), page_bytes=PAGE,
                             sliding_window=None, world_size=world, tp_size=world,
                             kv_dtype="uint8", identity="tp-ranks-test")


class FailingCpuToDisk(CpuToDiskHandler):
    failing = False

    async def run(self, src, dst):
        if self.failing:
            raise OSError(5, "Input/output error (injected on this rank)")
        return await super().run(src, dst)


class Rank:
    def __init__(self, settings: ConnectorSettings, r: int) -> None:
        cfg, geo = settings.rank_config(r), settings.geometry(r)
        self.pool = CpuBlockPool(geo, cfg.cpu_slots(settings.block_bytes), pin=False, background=False)
        self.store = DiskStore(cfg.disk.path, geo, compression="none", fsync=False)
        self.writer = FailingCpuToDisk(self.pool, self.store)
        self.engine = TransferEngine([self.writer, DiskToCpuHandler(self.pool, self.store),
                                      DiskDropHandler(self.store)])
        self.r = r

    def fill(self, slot: int, key: bytes) -> None:
        """This rank's slice of ``key``: bytes naming the key and the rank."""
        pattern = (key + bytes([self.r])) * (BLOCK // (len(key) + 1) + 1)
        self.pool.slot(slot).copy_(torch.frombuffer(bytearray(pattern[:BLOCK]), dtype=torch.uint8))

    def close(self) -> None:
        self.engine.close()
        self.store.close()


class Ranks:
    """The manager plus one worker per rank; ``run`` does what the job ledger does."""

    def __init__(self, settings: ConnectorSettings, manager=None) -> None:
        self.settings = settings
        self.ranks = [Rank(settings, r) for r in range(settings.world_size)]
        self.manager = manager or build_manager(settings.config, settings.block_bytes)

    def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> tuple[bool, set[bytes]]:
        ok, failed, _ = self.run_reads(src, dst)
        return ok, failed

    def run_reads(self, src: LoadStoreSpec, dst: LoadStoreSpec
                  ) -> tuple[bool, set[bytes], set[bytes]]:
        """Also the keys that failed only transiently, on every rank that failed them."""
        results = [rk.engine.wait([rk.engine.submit(src, dst)])[0] for rk in self.ranks]
        failed = {k for r in results for k in r.failed_keys}
        hard = {k for r in results for k in set(r.failed_keys) - set(r.transient_keys)}
        return all(r.ok for r in results), failed, failed - hard

    def background(self) -> None:
        while True:
            todo = self.manager.take_background_transfers()
            if not todo:
                return
            for t in todo:  # a promotion reports the keys it could not read, as workers do
                ok, failed, transient = self.run_reads(t.src, t.dst)
                if is_promotion(t):
                    self.manager.complete_background(t.id, ok, failed, transient)
                else:
                    self.manager.complete_background(t.id, ok)

    def store(self, keys: list[bytes]) -> None:
        plan = self.manager.prepare_store(keys)
        for rk in self.ranks:
            for key, slot in zip(plan.keys, plan.cpu_slots):
                rk.fill(slot, key)
        self.manager.complete_store(plan.keys, True)
        self.background()

    def disk_index(self) -> set[bytes]:
        return {k for k in self.manager.tier(Medium.DISK).entries}

    def on_disk(self, r: int) -> set[bytes]:
        return set(self.ranks[r].store.keys_by_age())

    def close(self) -> None:
        for rk in self.ranks:
            rk.close()


def k(i: int) -> bytes:
    return f"block-{i:04d}".encode()


@pytest.fixture
def ranks(tmp_path):
    rs = Ranks(settings_for(tmp_path, 2))
    yield rs
    rs.close()


def test_demotion_failing_on_one_rank_is_deleted_on_every_rank(ranks):
    ranks.ranks[1].writer.failing = True
    ranks.store([k(i) for i in range(4)])  # CPU full: the cold end is demoted, fails on rank 1
    ranks.ranks[1].writer.failing = False
    assert ranks.manager.stats.failed_stores["DISK"] > 0
    assert ranks.on_disk(0) == ranks.on_disk(1) == ranks.disk_index()


def disk_only_block(rs: Ranks) -> bytes:
    """A block held by the disk tier only (its next lookup promotes it: DISK -> CPU)."""
    keys = [k(i) for i in range(4)]
    rs.store(keys)
    rs.store([k(i) for i in range(10, 14)])  # pushes the first blocks out of CPU
    cpu = rs.manager.tier(Medium.CPU)
    on_disk_only = [key for key in keys if key not in cpu and key in rs.disk_index()]
    assert on_disk_only
    return on_disk_only[0]


def promote(rs: Ranks, victim: bytes):
    """The lookup that promotes ``victim``, and its read run on every rank; (promotion, ok,
    failed, transient), not yet settled."""
    found = rs.manager.lookup([victim])
    assert found.pending and found.tiers == ()
    [promotion] = rs.manager.take_background_transfers()
    assert is_promotion(promotion) and promotion.keys == (victim,)
    assert promotion.src == LoadStoreSpec.disk([victim])
    return (promotion, *rs.run_reads(promotion.src, promotion.dst))


def fill_disk(rs: Ranks, start: int) -> None:
    for i in range(start, start + 24, 4):
        rs.store([k(j) for j in range(i, i + 4)])


def test_record_corrupt_on_one_rank_is_deleted_on_every_rank(tmp_path):
    """The index forgets it, and the other rank's slice (unusable alone) is deleted at once,
    not at the next start-up: until then it sat on disk over capacity."""
    settings = settings_for(tmp_path, 2)
    rs = Ranks(settings)
    try:
        victim = disk_only_block(rs)
        flip_payload(rs.ranks[0].store, victim, None)
        promotion, ok, failed, transient = promote(rs, victim)
        assert failed == {victim} and not transient  # rank 0 found it bad; rank 1 read it
        rs.manager.complete_background(promotion.id, ok, failed, transient)
        rs.background()
        found = rs.manager.lookup([victim])
        assert found.num_hits == 0 and not found.pending
        assert victim not in rs.manager.tier(Medium.CPU)  # its slot was freed
        assert victim not in rs.disk_index() | rs.on_disk(0) | rs.on_disk(1)
        assert rs.manager.stats.failed_loads == 1 and rs.manager.stats.failed_loads_transient == 0
        assert rs.ranks[0].store.stats().checksum_failures == 1
        fill_disk(rs, 20)
        assert rs.on_disk(0) == rs.on_disk(1) == rs.disk_index()
        assert all(rs.ranks[r].store.stats().num_blocks <= 6 for r in range(2))
    finally:
        rs.close()
    geos = [settings.geometry(r) for r in range(2)]
    assert restored_keys(settings.disk_paths(), geos)[1] == []  # nothing left to reconcile


def test_transient_read_failure_on_one_rank_is_deleted_on_every_rank(tmp_path):
    """EIO on rank 1's read of a block: rank 1's store keeps its record (no corruption is
    counted, nothing of the segment is touched), the manager counts a transient failure, and
    the block is deleted from every rank within the run, so each rank stays within capacity."""
    settings = settings_for(tmp_path, 2)
    rs = Ranks(settings)
    try:
        victim = disk_only_block(rs)
        files = rs.ranks[1].store._files
        real_pread = files.pread

        def eio(*args, **kwargs):
            raise OSError(errno.EIO, "Input/output error (injected on rank 1)")

        files.pread = eio
        promotion, ok, failed, transient = promote(rs, victim)
        files.pread = real_pread
        assert failed == transient == {victim}
        assert rs.ranks[1].store.contains(victim)  # kept by the store: the read failed, not it
        rs.manager.complete_background(promotion.id, ok, failed, transient)
        rs.background()
        assert victim not in rs.manager.tier(Medium.CPU)  # its slot was freed
        assert victim not in rs.disk_index() | rs.on_disk(0) | rs.on_disk(1)
        assert rs.manager.stats.failed_loads == rs.manager.stats.failed_loads_transient == 1
        st = rs.ranks[1].store.stats()
        assert st.checksum_failures == 0 and st.read_errors == 1
        fill_disk(rs, 20)
        assert rs.on_disk(0) == rs.on_disk(1) == rs.disk_index()
        for r in range(2):
            st = rs.ranks[r].store.stats()
            assert st.num_blocks <= 6 and st.logical_bytes <= settings.config.disk.capacity
        assert rs.manager.pins() == 0
    finally:
        rs.close()


def test_restart_deletes_blocks_present_on_some_ranks_only(tmp_path):
    settings = settings_for(tmp_path, 2)
    rs = Ranks(settings)
    rs.store([k(i) for i in range(6)])
    rs.ranks[0].store.delete_many([k(0)])  # as a crash between the ranks' writes leaves it
    rs.ranks[1].store.delete_many([k(1)])
    before = (rs.on_disk(0), rs.on_disk(1))
    rs.close()
    assert k(1) in before[0] and k(0) in before[1]

    geos = [settings.geometry(r) for r in range(2)]
    common, partial = restored_keys(settings.disk_paths(), geos)
    assert set(partial) == {k(0), k(1)} and not set(common) & set(partial)
    manager = build_manager(settings.config, settings.block_bytes, common, partial)
    rs = Ranks(settings, manager)
    try:
        rs.background()
        assert rs.on_disk(0) == rs.on_disk(1) == set(common) == rs.disk_index()
    finally:
        rs.close()
    assert restored_keys(settings.disk_paths(), geos) == (common, [])


def test_disk_capacity_is_per_rank(tmp_path):
    """``tiers.disk.capacity`` bounds each rank's directory (its slice of every block), so
    the ranks together use up to world_size x capacity; the README says so."""
    settings = settings_for(tmp_path, 2, cpu_blocks=4, disk_blocks=6)
    capacity = settings.config.disk.capacity
    assert all(settings.rank_config(r).disk.capacity == capacity for r in range(2))
    assert settings.rank_config(0).disk.path != settings.rank_config(1).disk.path
    rs = Ranks(settings)
    try:
        for i in range(0, 40, 4):
            rs.store([k(j) for j in range(i, i + 4)])
        assert rs.manager.usage()["DISK"]["capacity_blocks"] == capacity // BLOCK == 6
        for r in range(2):
            st = rs.ranks[r].store.stats()
            assert st.num_blocks == 6 and st.logical_bytes == capacity  # full, not over
    finally:
        rs.close()
