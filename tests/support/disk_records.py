"""Where a disk-tier record lives, for tests that damage or inspect it on disk.

Works for a store of this process (``DiskStore``) and for one served by the disk I/O process
(``DiskProcess``, the worker's default): the child owns the LMDB environment, so this process
reads the index read-only, as the scheduler does at start-up.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.tiers.disk import DiskStore
from kvtier.tiers.disk.catalog.index import BlockIndex, IndexEntry
from kvtier.tiers.disk.segments import segment_name
from kvtier.tiers.disk.stats import index_dir, segments_dir


def record_entry(store, key: bytes) -> IndexEntry | None:
    if isinstance(store, DiskStore):
        return store._index.get(key)
    ix = BlockIndex(index_dir(Path(store.root)), map_size=1 << 20, sync=False, readonly=True)
    try:
        return ix.get(key)
    finally:
        ix.close()


def segment_path(store, seg: int) -> Path:
    return segments_dir(Path(store.root)) / segment_name(seg)


def holds(store, key: bytes) -> bool:
    return key in set(store.keys_by_age())
