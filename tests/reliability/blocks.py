"""Block contents that name themselves: any byte served for the wrong key or version is caught.

A block is ``key | version | filler`` where the filler is derived from (key, version), so a
reader holding only the bytes can tell which block (and which write of it) they are, and any
other bytes, including another block's, fail ``identify``.
"""

from __future__ import annotations

import hashlib
import struct

from kvtier.tiers.layout import BlockGeometry

GEO = BlockGeometry(num_layers=2, kv_parts=2, engine_blocks_per_block=1, page_bytes=512,
                    model="kvtier-reliability")
BLOCK_BYTES = GEO.block_bytes  # 2 KiB: small, so many blocks and segment rotations are cheap
KEY_BYTES = 16
_VERSION = struct.Struct("<Q")


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=KEY_BYTES).digest()


def block(k: bytes, version: int = 0, size: int = BLOCK_BYTES, compressible: bool = False) -> bytes:
    """The bytes of write ``version`` of block ``k``.

    ``compressible``: the filler repeats a short pattern (zstd stores it compressed), otherwise
    it is pseudo-random (stored raw), so both codec paths are exercised.
    """
    head = k + _VERSION.pack(version)
    seed = hashlib.blake2b(head, digest_size=32).digest()
    n = size - len(head)
    if compressible:
        filler = (seed * (n // len(seed) + 1))[:n]
    else:
        filler = hashlib.shake_256(seed).digest(n)
    return head + filler


def identify(k: bytes, data: bytes | bytearray | memoryview, size: int = BLOCK_BYTES) -> int | None:
    """The version of ``k`` that ``data`` holds, or None if it is not exactly such a block."""
    data = bytes(data)
    if len(data) != size or data[:KEY_BYTES] != k:
        return None
    (version,) = _VERSION.unpack_from(data, KEY_BYTES)
    for compressible in (False, True):
        if data == block(k, version, size, compressible):
            return version
    return None
