"""The store directory: creation, ownership lock, identity check and start-up recovery.

Layout::

    <dir>/index.lmdb/       LMDB environment (see index.py)
    <dir>/segments/*.seg    append-only record files (see segments.py, record.py)
    <dir>/HOST              the host serving it (see host.py: replicated layouts' readers)

The single-owner lock is an ``flock`` on the store directory's own descriptor, held for the
store's life: unlike a lock file, the directory cannot be unlinked and recreated under a
running store (a ``LOCK`` file left by older versions is ignored). The directory is opened once
with ``O_NOFOLLOW``; sub-directories are opened relative to it, also without following links,
and everything else is reached through those descriptors, so renaming or swapping the tree
after start-up cannot redirect the store. Its parents must not be changeable by another user
(world-writable without the sticky bit, owned by another user, or a link another user owns).

Directories are 0700 and files 0600: blocks are derived from users' prompts.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import NamedTuple

import lmdb

from kvtier.tiers.disk.catalog import lmdb_check
from kvtier.tiers.disk.errors import (
    DiskIndexUnreadable,
    DiskLayoutMismatch,
    DiskStoreBusy,
    NotADiskStore,
    UnsafeDiskDirectory,
)
from kvtier.tiers.disk.catalog.index import BlockIndex, IndexWriter
from kvtier.tiers.record import FORMAT_VERSION
from kvtier.tiers.disk.segments import SegmentFiles, open_dir
from kvtier.tiers.disk.stats import DiskStats, collect, index_dir, segments_dir
from kvtier.tiers.layout import BlockGeometry

_OURS = {"LOCK", "HOST", "HOST.tmp", "index.lmdb", "segments"}
_MAX_SEQ = 1 << 62  # record headers hold 64-bit sequence numbers, index locations 32-bit segments
_MAX_SEGMENT = 1 << 31


class Opened(NamedTuple):
    """Descriptors of an opened, locked store directory (the first one holds the lock)."""

    root_fd: int
    index_fd: int
    segments_fd: int


def check_owner_mode(st: os.stat_result, path: Path) -> None:
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


def _link_error(path: Path) -> UnsafeDiskDirectory:
    return UnsafeDiskDirectory(
        f"disk tier directory {path} is a symbolic link; kvtier refuses links (whoever can "
        "change the link could redirect the store). Configure the real path, or use a new "
        "directory."
    )


def check_parents(root: Path) -> None:
    """Refuse a store whose existing ancestors another user could change: a directory owned
    by someone other than us or root, one world-writable without the sticky bit, or a symlink
    owned by someone else (it could be re-pointed). Both the path as written and its
    resolved form are checked."""
    uid = os.geteuid()
    real = Path(os.path.realpath(root.parent))
    for p in dict.fromkeys([*reversed(root.parents), *reversed(real.parents), real]):
        try:
            st = os.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            continue  # created below, by us, 0700
        bad = None
        if st.st_uid not in (0, uid):
            bad = f"is owned by uid {st.st_uid}"
        elif stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH \
                and not st.st_mode & stat.S_ISVTX:
            bad = f"is world-writable without the sticky bit (mode {stat.S_IMODE(st.st_mode):o})"
        if bad:
            raise UnsafeDiskDirectory(
                f"disk tier directory {root}: its parent {p} {bad}; another user could swap the "
                "store's directory for their own. Use a directory under a parent only you (or "
                "root) can change."
            )


def _make_parents(parent: Path) -> None:
    """Create missing ancestors 0700 (never looser, whatever the umask)."""
    missing = []
    p = parent
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass  # a concurrent start created it: checked like any parent


def _open_root(root: Path) -> int:
    try:
        try:
            return open_dir(root)
        except FileNotFoundError:
            try:
                os.mkdir(root, 0o700)
            except FileExistsError:
                pass  # another process is creating the same store: its lock decides
            return open_dir(root)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(root):
            raise _link_error(root) from None
        if exc.errno == errno.ENOTDIR:
            raise NotADiskStore(f"disk tier path {root} exists and is not a directory") from None
        raise


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def _open_sub(root_fd: int, root: Path, name: str) -> int:
    created = False
    try:
        os.mkdir(name, 0o700, dir_fd=root_fd)
        created = True
    except FileExistsError:
        pass
    try:
        fd = open_dir(name, root_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            if exc.errno == errno.ELOOP or _is_link(name, root_fd):
                raise _link_error(root / name) from None
            raise NotADiskStore(f"{root / name} is not a directory; refusing {root}") from None
        raise
    try:
        if created:
            os.fchmod(fd, 0o700)
        check_owner_mode(os.fstat(fd), root / name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def prepare(root: Path) -> Opened:
    """Open (creating it 0700 if needed), check and lock ``root``; returns its descriptors.

    Two processes creating the same new store race safely: one gets the lock, the other is
    told the directory is busy.
    """
    root = Path(os.path.abspath(root))
    check_parents(root)
    _make_parents(root.parent)
    fd = _open_root(root)
    subs: list[int] = []
    try:
        check_owner_mode(os.fstat(fd), root)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DiskStoreBusy(
                f"disk tier directory {root} is already in use by another kvtier store "
                "(this or another process); give each instance its own directory"
            ) from None
        entries = set(os.listdir(fd))
        if "index.lmdb" not in entries:
            if entries - _OURS:
                raise NotADiskStore(
                    f"disk tier path {root} is a non-empty directory without a kvtier index "
                    "(index.lmdb); refusing to write into it. Point the disk tier at an empty "
                    "or new directory."
                )
            os.fchmod(fd, 0o700)
        for name in (index_dir(root).name, segments_dir(root).name):
            subs.append(_open_sub(fd, root, name))
    except BaseException:
        for f in subs:
            os.close(f)
        os.close(fd)  # also drops the lock if taken
        raise
    return Opened(fd, subs[0], subs[1])


def release(opened: Opened) -> None:
    """Close the descriptors (the lock goes with the root's)."""
    for fd in opened:
        try:
            os.close(fd)
        except OSError:
            pass


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
        held = v.num_blocks()
        ages = v.keys_by_age() if next_seq == 0 and held else []
    if fingerprint is None and held:  # its blocks' geometry is unknown: never adopt them
        raise DiskLayoutMismatch(
            f"disk tier directory {root} holds {held} blocks but no geometry fingerprint "
            f"(recorded geometry: [{stored_geometry}]), and this run uses "
            f"[{geometry.describe()}] (fingerprint {geometry.fingerprint()}). Its blocks cannot "
            f"be proven to match this geometry: use another directory for this model/block size,"
            f" or delete {root} to start afresh."
        )
    if fingerprint is None:  # a new (or emptied) index: record this run's geometry
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
    Anything but a regular file under a segment's name is left alone (reads of it are misses)
    and its id is never reused.
    """
    with index.read() as v:
        segs = v.segments()
    disk, strays = files.scan()  # strays: a directory or FIFO under a segment's name
    for orphan in disk.keys() - segs.keys():
        files.remove(orphan)
    next_seg = max([next_seg, 1] + [s + 1 for s in [*segs, *disk, *strays]])
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
    root = Path(os.path.abspath(root))
    try:
        root_fd = open_dir(root)
    except OSError as exc:
        raise NotADiskStore(f"{root} is not a kvtier disk-tier directory ({exc.strerror})") from None
    try:
        try:
            ix_fd = open_dir("index.lmdb", root_fd)
        except OSError:
            raise NotADiskStore(
                f"{root} is not a kvtier disk-tier directory (no index.lmdb found)"
            ) from None
        try:
            if not os.path.isfile(f"/proc/self/fd/{ix_fd}/data.mdb") and \
                    not (index_dir(root) / "data.mdb").is_file():
                raise NotADiskStore(f"{root} is not a kvtier disk-tier directory (no index)")
            return _read_stats(root, root_fd, ix_fd)
        finally:
            os.close(ix_fd)
    finally:
        os.close(root_fd)


def _read_stats(root: Path, root_fd: int, ix_fd: int) -> DiskStats:
    ix_path = index_dir(root)
    # a running store verified its index when it opened; a file at rest is verified here
    lmdb_check.check_data_file(ix_fd, ix_path, root, full=lmdb_check.idle(root_fd))
    lmdb_check.allocate_lock_file(ix_fd, ix_path, root)
    try:
        ix = BlockIndex(ix_path, map_size=1 << 20, sync=False, readonly=True, dir_fd=ix_fd)
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
            try:
                files = SegmentFiles(segments_dir(root), open_dir("segments", root_fd))
            except FileNotFoundError:
                files = SegmentFiles(segments_dir(root), -1)
            try:
                return collect(v, files)
            finally:
                files.close()
    finally:
        ix.close()
