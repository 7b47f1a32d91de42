"""A block as a server value: the disk tier's record (``header | key | payload``), whole.

Reusing the disk record means one format and one verifier: magic and header checksum catch a
truncated or foreign value, the stored key catches a value written under another namespace or
geometry, the payload checksum catches corruption, the codec id says how to decode. Anything
that fails is a miss (``None``/``False``); bytes are never handed back unverified, and nothing
read from the server is ever unpickled or evaluated.
"""

from __future__ import annotations

import numpy as np

from kvtier.tiers.disk.codec import BlockCodec
from kvtier.tiers.disk.record import (
    CODEC_NONE,
    HEADER_BYTES,
    CorruptRecord,
    data_checksum,
    decode_head,
    encode_head,
)
from kvtier.tiers.layout import LAYOUT_VERSION
from kvtier.tiers.remote.buffers import RecordBuffers


def copy_released(src: memoryview, out: memoryview) -> None:
    """``out[:] = src`` with the GIL released (numpy's copy releases it; a memoryview slice
    assignment holds it for the whole copy, ~0.2 ms per MiB here, during which the store's
    loop and a scheduler thread in the same process cannot run)."""
    np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(src, np.uint8))


def encode_value(record_key: bytes, payload: memoryview, codec: BlockCodec,
                 buffers: RecordBuffers | None = None) -> bytes | memoryview:
    """One self-verifying value for ``payload`` (compressed if the codec says so and it pays).
    An uncompressed record is built in a buffer from ``buffers`` when given (return it there
    once the server has it)."""
    codec_id, stored = codec.encode(payload)
    head = encode_head(record_key, codec=codec_id, layout_version=LAYOUT_VERSION, seq=0,
                       raw_len=len(payload), stored_len=len(stored),
                       checksum=data_checksum(record_key, stored))
    if buffers is None or codec_id != CODEC_NONE:
        return b"".join((head, stored))
    out = buffers.take(len(head) + len(stored))
    out[:len(head)] = head
    copy_released(stored, out[len(head):])
    return out


def decode_value_into(value: bytes | None, record_key: bytes, out: memoryview,
                      codec: BlockCodec) -> str | None:
    """Verify ``value`` and fill ``out``; returns None on success, else why it is a miss."""
    if value is None:
        return "absent"
    try:
        head = decode_head(value, record_key)
    except CorruptRecord as exc:
        return f"corrupt: {exc}"
    start = HEADER_BYTES + head.key_len
    if head.layout_version != LAYOUT_VERSION:
        return f"layout version {head.layout_version}"
    if head.raw_len != len(out):
        return f"holds {head.raw_len} bytes, expected {len(out)}"
    if len(value) != start + head.stored_len:
        return "truncated"
    stored = memoryview(value)[start:]
    if data_checksum(record_key, stored) != head.data_checksum:
        return "corrupt: payload checksum mismatch"
    if head.codec == CODEC_NONE:
        if head.stored_len != len(out):
            return "corrupt: stored length"
        copy_released(stored, out)
        return None
    return None if codec.decode_into(head.codec, bytes(stored), out) else "corrupt: codec"
