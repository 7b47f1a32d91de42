"""One block as it sits in a segment file: ``header | key | payload``.

The header repeats everything the index knows about the record, so a read can prove that the
bytes at an index location really are the record the index promised: the magic and the
header's own checksum catch torn or stray bytes, the stored key catches a location that now
holds *another* block's record, and the payload checksum (over key + stored payload) catches
bit rot. Any doubt makes the read a miss; a block is never handed back unverified.

All integers are little-endian; the layout is fixed by ``FORMAT_VERSION``.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

MAGIC = b"KVTB"
FORMAT_VERSION = 1

CODEC_NONE = 0
CODEC_ZSTD = 1
CODEC_NAMES = {CODEC_NONE: "none", CODEC_ZSTD: "zstd"}

# magic, format version, codec, flags, key length, layout version, reserved,
# sequence, raw length, stored length, data checksum; then the header checksum.
_BODY = struct.Struct("<4sHBBHHIQQQQ")
_CSUM = struct.Struct("<Q")
HEADER_BYTES = _BODY.size + _CSUM.size  # 56

MAX_KEY_BYTES = 511  # LMDB's default key limit; the key is also the index key


class RecordHeader(NamedTuple):
    codec: int
    key_len: int
    layout_version: int
    seq: int
    raw_len: int
    stored_len: int
    data_checksum: int


class CorruptRecord(Exception):
    """Raised inside the tier (never to callers) when a record fails verification."""


def data_checksum(key: bytes, payload: bytes | bytearray | memoryview) -> int:
    """xxh3-64 over the key followed by the stored payload."""
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(payload)
    return h.intdigest()


def record_length(key_len: int, stored_len: int) -> int:
    return HEADER_BYTES + key_len + stored_len


def encode_head(
    key: bytes, *, codec: int, layout_version: int, seq: int, raw_len: int, stored_len: int,
    checksum: int,
) -> bytes:
    """Header and key of one record (the payload follows them on disk)."""
    body = _BODY.pack(
        MAGIC, FORMAT_VERSION, codec, 0, len(key), layout_version, 0, seq, raw_len, stored_len,
        checksum,
    )
    return body + _CSUM.pack(xxhash.xxh3_64_intdigest(body)) + key


def decode_head(buf: bytes | bytearray | memoryview, key: bytes) -> RecordHeader:
    """Parse and verify the header and stored key of a record that should hold ``key``."""
    if len(buf) < HEADER_BYTES:
        raise CorruptRecord(f"short header ({len(buf)} bytes)")
    mv = memoryview(buf)
    body = mv[: _BODY.size]
    (magic, version, codec, _flags, key_len, layout, _res, seq, raw, stored,
     csum) = _BODY.unpack(body)
    if magic != MAGIC:
        raise CorruptRecord("bad magic")
    (hcsum,) = _CSUM.unpack(mv[_BODY.size : HEADER_BYTES])
    if hcsum != xxhash.xxh3_64_intdigest(body):
        raise CorruptRecord("header checksum mismatch")
    if version != FORMAT_VERSION:
        raise CorruptRecord(f"record format version {version} (expected {FORMAT_VERSION})")
    if codec not in CODEC_NAMES:
        raise CorruptRecord(f"unknown codec {codec}")
    if key_len != len(key) or mv[HEADER_BYTES : HEADER_BYTES + key_len] != key:
        raise CorruptRecord("record holds another key")
    return RecordHeader(codec, key_len, layout, seq, raw, stored, csum)
