"""The disk tier: verified block records in append-only segment files behind an LMDB index."""

from kvtier.tiers.disk.errors import (DiskFull, DiskIndexUnreadable, DiskLayoutMismatch,
                                     DiskStoreBusy, DiskWriteError, NotADiskStore,
                                     UnsafeDiskDirectory)
from kvtier.tiers.disk.reader import ReadStatus
from kvtier.tiers.disk.stats import DiskStats
from kvtier.tiers.disk.store import DiskStore

__all__ = ["DiskFull", "DiskIndexUnreadable", "DiskLayoutMismatch", "DiskStats", "DiskStore",
           "DiskStoreBusy", "DiskWriteError", "NotADiskStore", "ReadStatus", "UnsafeDiskDirectory"]
