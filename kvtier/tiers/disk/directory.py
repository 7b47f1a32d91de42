"""The store directory: creation, ownership lock, identity check and start-up recovery.

Layout::

    <dir>/LOCK              flock'ed by the one DiskStore that has the directory open
    <dir>/index.lmdb/       LMDB environment (see index.py)
    <dir>/segments/*.seg    append-only record files (see segments.py, record.py)

Directories are 0700 and files 0600: blocks are derived from users' prompts.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

import lmdb

from kvtier.tiers.disk.errors import (
    DiskIndexUnreadable,
    DiskLayoutMismatch,
    DiskStoreBusy,
    NotADiskStore,
    UnsafeDiskDirectory,
)
from kvtier.tiers.disk.index import BlockIndex, IndexWriter
from kvtier.tiers.disk.record import FORMAT_VERSION
from kvtier.tiers.disk.segments import SegmentFiles
from kvtier.tiers.disk.stats import DiskStats, collect, index_dir, segments_dir
from kvtier.tiers.layout import BlockGeometry

_OURS = {"LOCK", "index.lmdb", "segments"}
_MAX_SEQ = 1 << 62  # record headers hold 64-bit sequence numbers, index locations 32-bit segments
_MAX_SEGMENT = 1 << 31


def check_private(path: Path, follow: bool) -> None:
    """Refuse a directory another user could write to (or that belongs to another user).

    Blocks are derived from users' prompts, and a planted record or a swapped sub-directory
    would be read back as KV: the store directory must be ours alone. ``follow``: whether a
    symbolic link is acceptable (the configured path itself may be one; our sub-directories
    never are).
    """
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDiskDirectory(
            f"disk tier directory {path} is a symbolic link; kvtier creates its sub-directories "
            "itself and refuses links planted in their place. Remove it, or use a new directory."
        )
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UnsafeDiskDirectory(
            f"disk tier directory {path} is owned by uid {st.st_uid}, not by this process's user "
            f"(uid {uid}); refusing it because another user controls what it holds. Use a "
            "directory of your own (or chown it to this user)."
        )
    if st.st_mode & stat.S_IWOTH:
        raise UnsafeDiskDirectory(
            f"disk tier directory {path} is world-writable (mode {stat.S_IMODE(st.st_mode):o}); "
            f"anyone could plant or replace cached blocks in it. Run `chmod 700 {path}` or use "
            "a new directory (kvtier creates it 0700)."
        )


def prepare(root: Path) -> int:
    """Create (0700) or accept ``root`` and lock it; returns the lock's descriptor."""
    if root.exists():
        if not root.is_dir():
            raise NotADiskStore(f"disk tier path {root} exists and is not a directory")
        check_private(root, follow=True)
        entries = set(os.listdir(root))
        if "index.lmdb" not in entries and entries - _OURS:
            raise NotADiskStore(
                f"disk tier path {root} is a non-empty directory without a kvtier index "
                "(index.lmdb); refusing to write into it. Point the disk tier at an empty or "
                "new directory."
            )
        fresh = "index.lmdb" not in entries
    else:
        root.mkdir(mode=0o700, parents=True)
        fresh = True
    if fresh:
        os.chmod(root, 0o700)
    for sub in (index_dir(root), segments_dir(root)):
        if not os.path.lexists(sub):
            sub.mkdir(mode=0o700)
            os.chmod(sub, 0o700)
        check_private(sub, follow=False)
    fd = os.open(root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DiskStoreBusy(
            f"disk tier directory {root} is already in use by another kvtier store "
            "(this or another process); give each instance its own directory"
        ) from None
    return fd


def release(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def check_meta(index: BlockIndex, root: Path, geometry: BlockGeometry) -> tuple[int, int]:
    """Refuse a directory of another geometry/format; initialise a fresh one.

    Returns ``(next sequence number, next segment id)`` as recorded.
    """
    with index.read() as v:
        fingerprint = v.meta("fingerprint")
        version = v.meta("format_version")
        stored_geometry = (v.meta("geometry") or b"?").decode(errors="replace")
        next_seq = v.meta_int("next_seq")
        next_seg = v.meta_int("next_segment")
        ages = v.keys_by_age() if next_seq == 0 and v.num_blocks() else []
    if fingerprint is None:
        with IndexWriter(index) as w:
            w.set_meta("fingerprint", geometry.fingerprint().encode())
            w.set_meta("geometry", geometry.describe().encode())
            w.set_meta("format_version", str(FORMAT_VERSION).encode())
            w.set_meta_int("block_bytes", geometry.block_bytes)
            w.set_meta("created", repr(time.time()).encode())
        return 1, 1
    if version != str(FORMAT_VERSION).encode():
        raise DiskLayoutMismatch(
            f"disk tier directory {root} uses on-disk format {version!r}, this kvtier writes "
            f"format {FORMAT_VERSION}. Use another directory or delete {root} to start afresh."
        )
    if fingerprint.decode(errors="replace") != geometry.fingerprint():
        raise DiskLayoutMismatch(
            f"disk tier directory {root} was written for geometry [{stored_geometry}] "
            f"(fingerprint {fingerprint.decode(errors='replace')}), but this run uses "
            f"[{geometry.describe()}] (fingerprint {geometry.fingerprint()}). Its blocks cannot "
            f"be read under this geometry: use another directory for this model/block size, or "
            f"delete {root} to start afresh."
        )
    if ages:  # no counter recorded (should not happen): never reuse a sequence number
        with index.read() as v:
            next_seq = max((e.seq for e in map(v.entry, ages) if e), default=0) + 1
    if next_seq >= _MAX_SEQ or next_seg >= _MAX_SEGMENT:
        raise DiskIndexUnreadable(
            f"disk tier index in {root} records impossible counters (next sequence {next_seq}, "
            f"next segment {next_seg}): it is damaged. Delete {root} (it is a cache) and start "
            "again."
        )
    return max(next_seq, 1), max(next_seg, 1)


def open_segments(
    index: BlockIndex, files: SegmentFiles, next_seg: int, segment_bytes: int, fsync: bool
) -> int:
    """Pick the segment to append to; drop orphans and empty leftovers. Returns next free id.

    Bytes past the active segment's recorded end were never indexed (a crash between the
    append and the commit) and are cut off; segment files unknown to the index are removed.
    """
    with index.read() as v:
        segs = v.segments()
    disk = files.on_disk()
    for orphan in disk.keys() - segs.keys():
        files.remove(orphan)
    next_seg = max([next_seg, 1] + [s + 1 for s in segs] + [s + 1 for s in disk])
    active = max(segs) if segs else None
    usable = (
        active is not None and active in disk
        and disk[active] >= segs[active].end and segs[active].end < segment_bytes
    )
    stale = [
        s for s, info in segs.items() if info.live_records == 0 and not (usable and s == active)
    ]
    with IndexWriter(index) as w:
        for s in stale:
            w.drop_segment(s)
            w.add_meta_int("reclaimed_bytes", disk.get(s, 0))
        if usable:
            assert active is not None
            files.open_active(active, segs[active].end)
        else:
            files.create(next_seg, sync_dir=fsync)
            w.set_segment_end(next_seg, 0)
            next_seg += 1
        w.set_meta_int("next_segment", next_seg)
    for s in stale:
        files.remove(s)
    return next_seg


def read_stats(root: Path) -> DiskStats:
    """Stats of a directory, read-only, without knowing its geometry."""
    if not (index_dir(root) / "data.mdb").is_file():
        raise NotADiskStore(f"{root} is not a kvtier disk-tier directory (no index.lmdb found)")
    try:
        ix = BlockIndex(index_dir(root), map_size=1 << 20, sync=False, readonly=True)
    except lmdb.Error as exc:
        if "already open" in str(exc):
            raise DiskStoreBusy(
                f"{root} is open in this process; use that DiskStore's stats() instead"
            ) from exc
        raise NotADiskStore(f"cannot open the kvtier index in {root}: {exc}") from exc
    try:
        with ix.read() as v:
            if v.meta("fingerprint") is None:
                raise NotADiskStore(f"{root} has an index but no kvtier metadata")
            return collect(v, SegmentFiles(segments_dir(root)))
    finally:
        ix.close()
