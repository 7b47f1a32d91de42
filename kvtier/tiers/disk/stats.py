"""What a disk-tier directory holds, for logs, ``kvtier stats --dir`` and benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.tiers.disk.catalog.index import IndexView
from kvtier.tiers.disk.segments import SegmentFiles


@dataclass(frozen=True)
class DiskStats:
    num_blocks: int
    logical_bytes: int  # block bytes as the CPU tier sees them
    stored_bytes: int  # live record bytes on disk (headers + keys + possibly compressed payloads)
    file_bytes: int  # size of all segment files, dead records included
    compression_ratio: float  # logical / stored (1.0 when empty)
    checksum_failures: int  # cumulative over the directory's life
    read_errors: int
    write_errors: int
    segments: int
    oldest_ts: float | None
    newest_ts: float | None
    reclaimed_bytes: int  # dead bytes given back to the file system by compaction/unlink
    geometry: str = ""
    fingerprint: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def collect(view: IndexView, files: SegmentFiles) -> DiskStats:
    """Stats from one index snapshot plus the segment files' real sizes."""
    segs = view.segments()
    n = view.num_blocks()
    block_bytes = view.meta_int("block_bytes")
    stored = sum(s.live_bytes for s in segs.values())
    on_disk = files.on_disk()
    oldest, newest = view.oldest_newest()
    logical = n * block_bytes
    return DiskStats(
        num_blocks=n,
        logical_bytes=logical,
        stored_bytes=stored,
        file_bytes=sum(on_disk.values()),
        compression_ratio=(logical / stored) if stored else 1.0,
        checksum_failures=view.meta_int("checksum_failures"),
        read_errors=view.meta_int("read_errors"),
        write_errors=view.meta_int("write_errors"),
        segments=len(on_disk),
        oldest_ts=oldest.ts if oldest else None,
        newest_ts=newest.ts if newest else None,
        reclaimed_bytes=view.meta_int("reclaimed_bytes"),
        geometry=(view.meta("geometry") or b"").decode(errors="replace"),
        fingerprint=(view.meta("fingerprint") or b"").decode(errors="replace"),
    )


def segments_dir(root: Path) -> Path:
    return root / "segments"


def index_dir(root: Path) -> Path:
    return root / "index.lmdb"
