"""The disk tier's contents at start-up, for the scheduler-side manager.

Choice: the workers own the disk stores (they hold the bytes and the directory lock); the
scheduler only needs the list of keys, oldest first, once, before its first lookup. It reads
each rank's LMDB index read-only (LMDB allows readers in other processes while one process
writes) and checks the directory's geometry fingerprint, so a directory of another model or
configuration is refused here too. When a worker of this very process already opened the
store (vLLM with multiprocessing off builds the worker first), LMDB refuses a second open of
the environment in one process, so the open store registered here is asked instead. With
several workers a block is usable only if every rank has its slice: the keys are intersected,
and the keys some ranks hold without the others (a demotion that failed on one rank, a record
found corrupt on one rank, a crash between the ranks' writes) are handed to the manager to be
deleted on every rank, so they do not pile up on disk across restarts. A replicated layout
(MLA) has one directory, rank 0's (``ConnectorSettings.disk_paths``): its keys are the truth.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Sequence

import lmdb

from kvtier.tiers.disk import DiskLayoutMismatch, DiskStore
from kvtier.tiers.disk.catalog import lmdb_check
from kvtier.tiers.disk.errors import DiskIndexUnreadable
from kvtier.tiers.disk.catalog.index import BlockIndex
from kvtier.tiers.disk.stats import index_dir
from kvtier.tiers.layout import BlockGeometry

log = logging.getLogger(__name__)

_open_stores: dict[str, DiskStore] = {}
_lock = threading.Lock()


def _norm(path: Path) -> str:
    return str(Path(path).resolve())


def register_open_store(path: Path, store: DiskStore) -> None:
    with _lock:
        _open_stores[_norm(path)] = store


def unregister_open_store(path: Path, store: DiskStore) -> None:
    with _lock:
        if _open_stores.get(_norm(path)) is store:
            del _open_stores[_norm(path)]


def read_keys(path: Path, geometry: BlockGeometry) -> list[bytes]:
    """Keys in the store at ``path``, oldest first; [] when there is no store there yet."""
    with _lock:
        store = _open_stores.get(_norm(path))
    if store is not None:
        if store.geometry.fingerprint() != geometry.fingerprint():
            raise DiskLayoutMismatch(f"disk tier directory {path} is open for another geometry")
        return store.keys_by_age()
    ix_path = index_dir(Path(path))
    if not (ix_path / "data.mdb").is_file():
        return []
    try:  # checked before it is mapped: a truncated index would SIGBUS the scheduler
        fd = os.open(ix_path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            lmdb_check.check_data_file(fd, ix_path, Path(path), full=False)
        finally:
            os.close(fd)
        ix = BlockIndex(ix_path, map_size=1 << 20, sync=False, readonly=True)
    except (DiskIndexUnreadable, OSError, lmdb.Error) as exc:
        # the worker's DiskStore refuses the same directory and runs without the disk tier
        log.error("kvtier: disk tier index in %s is unreadable (%s); starting without its "
                  "blocks", path, exc)
        return []
    try:
        with ix.read() as v:
            fingerprint = v.meta("fingerprint")
            if fingerprint is None:
                return []
            if fingerprint.decode(errors="replace") != geometry.fingerprint():
                stored = (v.meta("geometry") or b"?").decode(errors="replace")
                raise DiskLayoutMismatch(
                    f"disk tier directory {path} was written for [{stored}], but this engine "
                    f"uses [{geometry.describe()}] (fingerprints differ: another model, dtype, "
                    f"block size, KV layout, hash algorithm or tensor-parallel layout). Use "
                    f"another directory or delete {path}."
                )
            return v.keys_by_age()
    finally:
        ix.close()


def restored_keys(paths: Sequence[Path], geometries: Sequence[BlockGeometry]
                  ) -> tuple[list[bytes], list[bytes]]:
    """(keys present on every rank's disk, in rank 0's age order; keys present on some
    ranks only, to be deleted)."""
    if not paths:
        return [], []
    per_rank = [read_keys(path, geometry) for path, geometry in zip(paths, geometries)]
    if len(per_rank) == 1:
        return per_rank[0], []
    common = set(per_rank[0]).intersection(*per_rank[1:])
    partial = dict.fromkeys(k for keys in per_rank for k in keys if k not in common)
    if partial:
        log.warning("kvtier: %d disk blocks are on some ranks only; deleting them",
                    len(partial))
    return [k for k in per_rank[0] if k in common], list(partial)
