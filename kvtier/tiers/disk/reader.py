"""Reading one record back and proving it is the block the index promised.

A failure is returned, not raised: the store turns it into a miss, counts it and (if the index
still points at the same place) drops the entry. ``read_errors`` are I/O problems (missing
segment, short read, a FIFO or directory in a segment's place); ``checksum_failures`` are bytes
that are there but wrong. A *transient* failure (out of descriptors or memory, EIO, EAGAIN, a
permission problem: see segments.is_transient) says nothing about the record: it is a miss for
this read only, and must never drop the entry or the segment.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from kvtier.tiers.disk.codec import BlockCodec
from kvtier.tiers.disk.catalog.index import IndexEntry
from kvtier.tiers.record import (
    CODEC_NONE,
    HEADER_BYTES,
    CorruptRecord,
    data_checksum,
    decode_head,
)
from kvtier.tiers.disk.segments import SegmentFiles, is_transient

READ_ERROR = "read_errors"
CHECKSUM_FAILURE = "checksum_failures"


class ReadStatus(Enum):
    """How a read of one block ended (``DiskStore.fetch_into``)."""

    HIT = "hit"  # ``out`` holds the verified block
    MISS = "miss"  # not stored, or the record was bad (then dropped and counted)
    TRANSIENT = "transient"  # the read failed (EIO, EMFILE, ENOMEM ...): the record is kept


class ReadFailure(NamedTuple):
    kind: str  # READ_ERROR or CHECKSUM_FAILURE (also the name of the counter it bumps)
    reason: str
    transient: bool = False  # the record may well be intact: keep it


def _io_failure(seg: int, exc: OSError) -> ReadFailure:
    return ReadFailure(READ_ERROR, f"segment {seg}: {exc.strerror or exc}", is_transient(exc))


def _bad(reason: str) -> ReadFailure:
    return ReadFailure(CHECKSUM_FAILURE, reason)


def verify(
    key: bytes, entry: IndexEntry, head: bytes | bytearray | memoryview, payload: memoryview
) -> ReadFailure | None:
    """Check a record's header, key and payload against the index entry."""
    try:
        h = decode_head(head, key)
    except CorruptRecord as exc:
        return _bad(str(exc))
    if (h.seq, h.codec, h.raw_len, h.data_checksum) != (
        entry.seq, entry.codec, entry.raw_len, entry.checksum
    ):
        return _bad("record header disagrees with the index")
    if h.stored_len != len(payload) or HEADER_BYTES + len(key) + h.stored_len != entry.length:
        return _bad("record length disagrees with the index")
    if h.layout_version != entry.layout_version:
        return _bad("record layout version disagrees with the index")
    if data_checksum(key, payload) != entry.checksum:
        return _bad("payload checksum mismatch")
    return None


def _stored_len(key: bytes, entry: IndexEntry) -> int:
    return entry.length - HEADER_BYTES - len(key)


def read_into(
    files: SegmentFiles, codec: BlockCodec, key: bytes, entry: IndexEntry, out: memoryview,
    layout_version: int,
) -> ReadFailure | None:
    """Fill ``out`` (block_bytes long) with the block at ``entry``; None on success.

    Uncompressed payloads are read straight into ``out`` (no copy); on failure ``out`` holds
    garbage, which the caller must not use.
    """
    if entry.raw_len != len(out):
        return _bad(f"index says {entry.raw_len} raw bytes, block is {len(out)}")
    if entry.layout_version != layout_version:
        return _bad(f"layout version {entry.layout_version}, expected {layout_version}")
    stored_len = _stored_len(key, entry)
    if stored_len < 0:
        return _bad("index record length too small")
    if stored_len > entry.raw_len:  # compressed copies are kept only when smaller
        return _bad("index record length larger than the block")
    if entry.codec == CODEC_NONE:
        if stored_len != entry.raw_len:
            return _bad("uncompressed record of the wrong length")
        payload = out
    else:
        payload = memoryview(bytearray(stored_len))
    head = bytearray(HEADER_BYTES + len(key))
    try:
        n = files.pread(entry.segment, [head, payload], entry.offset)
    except OSError as exc:
        return _io_failure(entry.segment, exc)
    except (OverflowError, ValueError):  # an offset no file can have (damaged index)
        return _bad(f"index offset {entry.offset} out of range")
    if n != entry.length:
        return ReadFailure(READ_ERROR, f"short read ({n} of {entry.length} bytes)")
    failure = verify(key, entry, head, payload)
    if failure is None and entry.codec != CODEC_NONE:
        if not codec.decode_into(entry.codec, payload, out):
            failure = _bad("decompression failed or wrong decompressed length")
    return failure


def read_record(
    files: SegmentFiles, key: bytes, entry: IndexEntry, block_bytes: int
) -> bytearray | ReadFailure:
    """The whole verified record (header + key + stored payload), for compaction's copy."""
    if entry.raw_len != block_bytes or entry.length > HEADER_BYTES + len(key) + block_bytes:
        return _bad("index record length disagrees with the block size")
    buf = bytearray(entry.length)
    try:
        n = files.pread(entry.segment, [buf], entry.offset)
    except OSError as exc:
        return _io_failure(entry.segment, exc)
    except (OverflowError, ValueError):
        return _bad(f"index offset {entry.offset} out of range")
    if n != entry.length:
        return ReadFailure(READ_ERROR, f"short read ({n} of {entry.length} bytes)")
    mv = memoryview(buf)
    split = HEADER_BYTES + len(key)
    if entry.length < split:
        return _bad("index record length too small")
    failure = verify(key, entry, mv[:split], mv[split:])
    return buf if failure is None else failure
