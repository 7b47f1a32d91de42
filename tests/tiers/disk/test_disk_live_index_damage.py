"""Issue 36.7: the LMDB index damaged while the store is open (pages overwritten behind its
back) must never raise an LMDB error out of ``DiskStore.get`` / ``fetch_into`` / ``contains``:
each read is a miss, the store marks itself unhealthy (reads miss, writes fail, counted), and
the damaged file is verified again at the next open instead of being vouched for as clean."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest

from kvtier.tiers.disk import DiskIndexUnreadable, DiskStore, DiskWriteError
from kvtier.tiers.disk.catalog.lmdb_check import is_live_damage
from kvtier.tiers.disk.reader import ReadStatus
from kvtier.tiers.layout import BlockGeometry

GEO = BlockGeometry(num_layers=1, kv_parts=2, engine_blocks_per_block=1, page_bytes=256,
                    dtype="uint8", model="live-damage")
KEYS = [i.to_bytes(4, "little") * 8 for i in range(300)]


def _block(i: int) -> bytes:
    return bytes([i % 251]) * GEO.block_bytes


def _damage_index_pages(path: Path) -> None:
    """Every page after the two meta pages overwritten with plausible-looking garbage."""
    data = path / "index.lmdb" / "data.mdb"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        for pg in range(2, size // 4096):
            f.seek(pg * 4096)
            f.write((pg * 7919).to_bytes(8, "little") + b"\x00\x00\x02\x00\x20\x00\x10\x00"
                    + b"\xf0\x0f" * 2040)


def test_a_damaged_live_index_reads_as_misses_and_marks_the_store_unhealthy(tmp_path):
    path = tmp_path / "d"
    store = DiskStore(path, GEO, segment_bytes=1 << 20)
    try:
        store.put_many([(k, _block(i)) for i, k in enumerate(KEYS)])
        assert store.get(KEYS[5]) == _block(5)
        _damage_index_pages(path)
        out = memoryview(bytearray(GEO.block_bytes))
        assert store.get(KEYS[7]) is None  # raised lmdb.BadTxnError before
        assert store.healthy is False
        assert "damaged" in store.index_damage and str(path) in store.index_damage
        assert store.fetch_into(KEYS[8], out) is ReadStatus.MISS
        assert store.get_into(KEYS[9], out) is False
        assert store.contains(KEYS[10]) is False
        with pytest.raises(DiskWriteError, match="damaged"):
            store.put_many([(b"n" * 32, _block(1))])
    finally:
        store.close()
    # closed after damage: not marked clean, so the next open verifies the file and refuses it
    with pytest.raises(DiskIndexUnreadable):
        DiskStore(path, GEO, segment_bytes=1 << 20)


def test_passing_lmdb_conditions_are_not_called_damage():
    assert not is_live_damage(lmdb.ReadersFullError("mdb_txn_begin", 1))
    assert not is_live_damage(lmdb.MapResizedError("mdb_txn_begin", 1))
    assert is_live_damage(lmdb.CorruptedError("mdb_get", 1))
    assert is_live_damage(lmdb.BadTxnError("mdb_get", 1))
    assert is_live_damage(lmdb.BadDbiError("mdb_get", 1))
