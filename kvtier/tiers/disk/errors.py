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
    """The LMDB index cannot be opened (damaged, e.g. by a power loss with fsync=False)."""
