"""Which Cluster primary holds a key: Redis Cluster's hash slots.

A key's slot is CRC16 (XMODEM) of the key, or of its hash tag (the text between the first
``{`` and the next ``}``, when not empty), modulo 16384. ``CLUSTER SLOTS`` maps slot ranges to
primaries; a ``MOVED`` answer means the map changed, and the caller asks for it again.
"""

from __future__ import annotations

import bisect

SLOTS = 16384


def _table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        table.append(crc & 0xFFFF)
    return table


_CRC = _table()


def crc16(data: bytes) -> int:
    crc = 0
    for b in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC[((crc >> 8) ^ b) & 0xFF]
    return crc


def key_slot(key: bytes) -> int:
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return crc16(key) % SLOTS


class SlotMap:
    """Slot ranges -> primary ``(host, port)``, from a ``CLUSTER SLOTS`` reply."""

    def __init__(self, reply: object) -> None:
        if not isinstance(reply, list) or not reply:
            raise ValueError("CLUSTER SLOTS gave no slot ranges (is this a Cluster?)")
        ranges = []
        for entry in reply:
            try:
                first, last, primary = int(entry[0]), int(entry[1]), entry[2]
                host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
                ranges.append((first, last, (host, int(primary[1]))))
            except (TypeError, ValueError, IndexError, AttributeError):
                raise ValueError(f"CLUSTER SLOTS entry does not parse: {entry!r:.200}") from None
        ranges.sort()
        self._firsts = [r[0] for r in ranges]
        self._ranges = ranges

    @property
    def primaries(self) -> list[tuple[str, int]]:
        return sorted({r[2] for r in self._ranges})

    def node_of(self, key: bytes) -> tuple[str, int] | None:
        """The primary serving ``key``'s slot; None for a slot no primary serves."""
        slot = key_slot(key)
        i = bisect.bisect_right(self._firsts, slot) - 1
        if i < 0:
            return None
        first, last, node = self._ranges[i]
        return node if first <= slot <= last else None
