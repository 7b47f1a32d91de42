"""Errors the disk tier raises to its callers.

Bad *data* on disk is never an error for the caller (it reads as a miss and is counted); these
exceptions cover the cases where the caller must act: a directory that belongs to another
geometry, a directory that is not a kvtier store, one already in use, or a failed write.
"""

from __future__ import annotations

import errno as _errno
import os


class DiskLayoutMismatch(ValueError):
    """The directory holds blocks of another geometry or format; reading them would be wrong."""


class NotADiskStore(ValueError):
    """The path exists but is not a kvtier disk-tier directory (refused to avoid clobbering it)."""


class UnsafeDiskDirectory(NotADiskStore):
    """The directory (or one of its sub-directories) is owned by another user, world-writable
    or a symbolic link: someone else could read the cached KV (derived from users' prompts) or
    plant blocks in it, so the store refuses to use it."""


class DiskStoreBusy(RuntimeError):
    """Another DiskStore (this process or another) already has the directory open."""


class DiskWriteError(OSError):
    """A batch could not be made durable (ENOSPC, EIO, index full ...).

    Nothing of the failed batch is indexed: the caller treats the whole batch as not stored.
    The store stays usable for reads and later writes.
    """

    def __init__(self, err: int | None, message: str) -> None:
        super().__init__(err if err is not None else _errno.EIO, message)

    @classmethod
    def wrap(cls, exc: BaseException, what: str) -> "DiskWriteError":
        code = getattr(exc, "errno", None)
        name = _errno.errorcode.get(code, "") if isinstance(code, int) else ""
        detail = os.strerror(code) if isinstance(code, int) else str(exc)
        kind = name or type(exc).__name__
        return cls(code, f"kvtier disk tier: {what} failed ({kind}: {detail})")


class DiskIndexUnreadable(RuntimeError):
    """The LMDB index cannot be opened safely: damaged (e.g. by a power loss with
    fsync=False), truncated, or unusable for the reason the message names.

    Raised *instead of* mapping a file LMDB would fault on (SIGBUS/SIGSEGV kill the whole
    process with no message); the caller can run without the disk tier.
    """


class DiskFull(DiskIndexUnreadable):
    """The file system holding the store has no room for the index to start.

    A subclass of DiskIndexUnreadable because the caller's remedy is the same (run without the
    disk tier, tell the operator); LMDB's memory-mapped lock table would otherwise die with
    SIGBUS on its first page fault.
    """


def describe_os_error(exc: BaseException) -> str:
    """``ENOMEM: Cannot allocate memory`` style text for an OSError (else its message).

    Error messages must say what really happened: an ENOMEM or EPERM is not a damaged index.
    """
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code in _errno.errorcode:
        return f"{_errno.errorcode[code]}: {os.strerror(code)}"
    return f"{type(exc).__name__}: {exc}"
