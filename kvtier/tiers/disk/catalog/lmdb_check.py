"""Checks made before the LMDB index is memory-mapped, and clear errors for what LMDB reports.

LMDB maps ``data.mdb`` and ``lock.mdb`` into memory and trusts them: a page it touches past the
end of a truncated file, or a page it must first allocate on a full file system, kills the
process with SIGBUS (or SIGSEGV for a damaged page) - no exception, no message. So before
``lmdb.open``:

- ``lock.mdb`` (the reader table LMDB writes through its map) is fully allocated with
  ``posix_fallocate``: a full file system is an ENOSPC here, i.e. :class:`DiskFull`;
- at least MIN_FREE_BYTES must be free to create a new index;
- ``data.mdb``'s meta pages are parsed and the file must hold every page the newest meta
  names (a truncated index is caught here, in microseconds);
- unless the index was closed cleanly (a marker written after the last close that matches the
  file's size, mtime and inode), the whole file is verified with py-lmdb's offline structural
  verifier (pure Python, never maps the file): a damaged page is an exception, not a signal.

The writer never writes through the map (``writemap`` off), so a full disk during a commit is
an error LMDB returns, never a fault.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
from pathlib import Path

import lmdb
from lmdb import verify as lmdb_verify  # with the rest: not first imported mid-check

from kvtier.tiers.disk.errors import DiskFull, DiskIndexUnreadable, describe_os_error
from kvtier.tiers.disk.catalog.index import MAX_READERS

LOCK_BYTES = (MAX_READERS - 1) * 64 + 192  # LMDB 0.9's reader table: 64-byte slots + header
MIN_FREE_BYTES = 64 << 10  # a new index's first commits
CLEAN_MARK = "clean-close"
_P_META = 0x08
_MAGIC = 0xBEEFC0DE
_P_INVALID = (1 << 64) - 1
_RO_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NOT_DAMAGE = (errno.ENOMEM, errno.EPERM, errno.EACCES, errno.EMFILE, errno.ENFILE, errno.EROFS)


def lmdb_errno(exc: BaseException) -> int | None:
    """The errno behind an ``lmdb.Error`` (None for LMDB's own codes: corruption etc.)."""
    code = getattr(exc, "code", None)
    if isinstance(code, int) and code > 0:
        return code
    text = str(exc).rsplit(": ", 1)[-1]
    return next((c for c in errno.errorcode if os.strerror(c) == text), None)


# LMDB errors of a read that say nothing about the index's pages (a full reader table, a map
# another process grew, no memory): the read is retried later. Any other error from an open
# index (CorruptedError, PageNotFoundError, BadTxnError, BadDbiError ...) means its pages are
# not what LMDB wrote.
_READ_NOT_DAMAGE = (lmdb.ReadersFullError, lmdb.MapResizedError, lmdb.TlsFullError,
                    lmdb.MemoryError)


def is_live_damage(exc: lmdb.Error) -> bool:
    """Whether an LMDB error from a read of the open index means the index is damaged."""
    if isinstance(exc, _READ_NOT_DAMAGE):
        return False
    return lmdb_errno(exc) not in _NOT_DAMAGE


def open_error(exc: BaseException, ix_path: Path, root: Path) -> DiskIndexUnreadable:
    """What to raise for an error opening the index: say what really happened."""
    code = exc.errno if isinstance(exc, OSError) else lmdb_errno(exc)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(
            f"disk tier index {ix_path}: the file system is full ({describe_os_error(OSError(code, ''))}); "
            f"free some space or point the disk tier elsewhere."
        )
    if code in _NOT_DAMAGE:
        what = f"{errno.errorcode[code]}: {os.strerror(code)}"
        hint = {
            errno.ENOMEM: "out of memory or address space for the index map",
            errno.EPERM: "the operating system refused the operation",
            errno.EACCES: "permission denied: check the owner and mode of the files",
            errno.EROFS: "the file system is read-only",
        }.get(code, "out of file descriptors")
        return DiskIndexUnreadable(
            f"cannot open the disk tier index {ix_path}: {what} ({hint}). The index is not "
            "known to be damaged; fix the cause and start again."
        )
    detail = describe_os_error(exc) if code is not None else str(exc)
    return DiskIndexUnreadable(
        f"disk tier index {ix_path} is damaged or unreadable ({detail}). This happens after a "
        f"power loss with fsync=False or when the file was truncated or overwritten: delete "
        f"{root} (it is a cache) and start again."
    )


def check_free_space(ix_fd: int, ix_path: Path) -> None:
    """A new index needs room for its first pages (an existing one may start on a full disk:
    it can still serve reads, and its writes fail cleanly)."""
    try:
        if os.stat("data.mdb", dir_fd=ix_fd, follow_symlinks=False).st_size > 0:
            return
    except FileNotFoundError:
        pass
    st = os.statvfs(ix_fd)
    free = st.f_bavail * st.f_frsize
    if free < MIN_FREE_BYTES:
        raise DiskFull(
            f"disk tier index {ix_path}: only {free} bytes free on its file system (need at "
            f"least {MIN_FREE_BYTES}); free some space or point the disk tier elsewhere."
        )


def allocate_lock_file(ix_fd: int, ix_path: Path, root: Path) -> None:
    """Give ``lock.mdb`` real blocks, so LMDB's writes through its map cannot fault."""
    try:
        fd = os.open("lock.mdb", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC, 0o600, dir_fd=ix_fd)
    except OSError as exc:
        raise open_error(exc, ix_path / "lock.mdb", root) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DiskIndexUnreadable(f"{ix_path / 'lock.mdb'} is not a regular file")
        os.posix_fallocate(fd, 0, max(st.st_size, LOCK_BYTES))
    except OSError as exc:
        raise open_error(exc, ix_path / "lock.mdb", root) from exc
    finally:
        os.close(fd)


def _metas(fd: int, size: int) -> list[tuple[int, int, int, int, int]]:
    """(psize, last_pg, txnid, free root, main root) of both meta pages; [] if either is bad
    (LMDB 0.9 layout: page header of 16 bytes, then magic, version, address, mapsize, two
    48-byte DB records, last page, txn id; the page size is the first record's pad)."""
    head = os.pread(fd, 160, 0)
    if len(head) < 160:
        return []
    psize = struct.unpack_from("=I", head, 40)[0]
    if psize < 512 or psize > 65536 or psize & (psize - 1) or size < 2 * psize:
        return []
    out = []
    for page in (head, os.pread(fd, 160, psize)):
        if len(page) < 160:
            return []
        flags = struct.unpack_from("=H", page, 10)[0]
        magic, version = struct.unpack_from("=II", page, 16)
        if not flags & _P_META or magic != _MAGIC or version != 1:
            return []
        free_root = struct.unpack_from("=Q", page, 40 + 40)[0]
        main_root = struct.unpack_from("=Q", page, 88 + 40)[0]
        last_pg, txnid = struct.unpack_from("=QQ", page, 136)
        out.append((psize, last_pg, txnid, free_root, main_root))
    return out


def _stamp(st: os.stat_result) -> str:
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ino}"


def take_clean_mark(ix_fd: int, data: os.stat_result) -> bool:
    """Whether the last close was clean and nothing touched ``data.mdb`` since; the mark is
    consumed (a crash from here on leaves none)."""
    try:
        fd = os.open(CLEAN_MARK, _RO_FLAGS, dir_fd=ix_fd)
    except OSError:
        return False
    try:
        mark = os.read(fd, 128).decode("ascii", "replace")
    finally:
        os.close(fd)
    try:
        os.unlink(CLEAN_MARK, dir_fd=ix_fd)
    except OSError:
        pass
    return mark == _stamp(data)


def mark_clean(ix_fd: int) -> None:
    """After the environment is closed: record that ``data.mdb`` was left consistent."""
    try:
        st = os.stat("data.mdb", dir_fd=ix_fd, follow_symlinks=False)
        fd = os.open(CLEAN_MARK + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600, dir_fd=ix_fd)
        try:
            os.write(fd, _stamp(st).encode())
        finally:
            os.close(fd)
        os.replace(CLEAN_MARK + ".tmp", CLEAN_MARK, src_dir_fd=ix_fd, dst_dir_fd=ix_fd)
    except OSError:
        pass  # no mark: the next open verifies the whole file


def check_data_file(ix_fd: int, ix_path: Path, root: Path, *, full: bool) -> None:
    """Refuse a ``data.mdb`` LMDB would fault on. ``full``: run the whole-file verifier
    unless a clean-close mark vouches for the file (never on a file another process may be
    writing: the verifier wants a file at rest)."""
    path = ix_path / "data.mdb"
    try:
        fd = os.open("data.mdb", _RO_FLAGS, dir_fd=ix_fd)
    except FileNotFoundError:
        return  # a new index
    except OSError as exc:
        raise open_error(exc, path, root) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DiskIndexUnreadable(f"disk tier index {path} is not a regular file")
        clean = take_clean_mark(ix_fd, st) if full else True
        if st.st_size == 0:
            return
        metas = _metas(fd, st.st_size)
    except OSError as exc:
        raise open_error(exc, path, root) from exc
    finally:
        os.close(fd)
    if not metas:
        raise open_error(lmdb.InvalidError("no valid LMDB meta pages"), path, root)
    psize, last_pg, _txn, free_root, main_root = max(metas, key=lambda m: m[2])
    if st.st_size < (last_pg + 1) * psize or any(
        r != _P_INVALID and r > last_pg for r in (free_root, main_root)
    ):
        raise open_error(lmdb.CorruptedError(
            f"file holds {st.st_size} bytes, its last commit needs {(last_pg + 1) * psize}"
        ), path, root)
    if not clean:
        _verify(ix_fd, path, root)


def _verify(ix_fd: int, path: Path, root: Path) -> None:
    try:
        problems = lmdb_verify.verify(f"/proc/self/fd/{ix_fd}/data.mdb", subdir=False) \
            if os.path.isdir("/proc/self/fd") else lmdb_verify.verify(str(path), subdir=False)
    except (lmdb_verify.VerifyError, ValueError, struct.error) as exc:
        problems = [str(exc)]
    except OSError as exc:
        raise open_error(exc, path, root) from exc
    if problems:
        raise open_error(lmdb.CorruptedError(f"{problems[0]} (+{len(problems) - 1} more)"),
                         path, root)


def idle(root_fd: int) -> bool:
    """True if no DiskStore holds the directory (its file is at rest right now)."""
    try:
        fcntl.flock(root_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(root_fd, fcntl.LOCK_UN)
    return True
