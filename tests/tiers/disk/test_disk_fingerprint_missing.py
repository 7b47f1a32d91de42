"""Issue 36.3: an index whose geometry fingerprint is gone while it still holds blocks must be
refused (the one-line ``DiskLayoutMismatch`` of a geometry mismatch), never adopted by the next
model that opens it; an index with no blocks is initialised for the run's geometry."""

from __future__ import annotations

import pytest

from kvtier.tiers.disk import DiskLayoutMismatch, DiskStore
from kvtier.tiers.disk.catalog.index import BlockIndex, IndexWriter
from kvtier.tiers.layout import BlockGeometry

MODEL_A = BlockGeometry(num_layers=2, kv_parts=2, engine_blocks_per_block=1, page_bytes=256,
                        dtype="uint8", model="model-a")
MODEL_B = BlockGeometry(num_layers=2, kv_parts=2, engine_blocks_per_block=1, page_bytes=256,
                        dtype="uint8", model="model-b")


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _without_fingerprint(path) -> None:
    ix = BlockIndex(path / "index.lmdb", map_size=1 << 26, sync=True)
    try:
        with IndexWriter(ix) as w:
            assert w.txn.delete(b"fingerprint", db=ix.meta)
    finally:
        ix.close()


def test_blocks_of_one_model_are_not_served_to_another_once_the_fingerprint_is_gone(tmp_path):
    assert MODEL_A.block_bytes == MODEL_B.block_bytes
    assert MODEL_A.fingerprint() != MODEL_B.fingerprint()
    path = tmp_path / "d"
    with DiskStore(path, MODEL_A) as s:
        s.put_many([(_key(i), bytes([i]) * MODEL_A.block_bytes) for i in range(64)])
    _without_fingerprint(path)
    for geometry in (MODEL_B, MODEL_A):  # not even the writer's own geometry is provable
        with pytest.raises(DiskLayoutMismatch) as info:
            DiskStore(path, geometry)
        message = str(info.value)
        assert "\n" not in message
        assert str(path) in message and "64 blocks" in message and "fingerprint" in message
    # nothing was written by the refusals: still no fingerprint, still 64 entries
    ix = BlockIndex(path / "index.lmdb", map_size=1 << 26, sync=True, readonly=True)
    try:
        with ix.read() as v:
            assert v.meta("fingerprint") is None and v.num_blocks() == 64
    finally:
        ix.close()


def test_an_empty_index_without_a_fingerprint_is_initialised_for_this_run(tmp_path):
    path = tmp_path / "d"
    with DiskStore(path, MODEL_A) as s:
        s.put_many([(_key(1), bytes(MODEL_A.block_bytes))])
        assert s.delete_many([_key(1)]) == 1
    _without_fingerprint(path)
    with DiskStore(path, MODEL_B) as s:
        s.put_many([(_key(2), b"\x02" * MODEL_B.block_bytes)])
        assert s.get(_key(2)) == b"\x02" * MODEL_B.block_bytes
        assert s.stats().fingerprint == MODEL_B.fingerprint()
    with pytest.raises(DiskLayoutMismatch):
        DiskStore(path, MODEL_A)
