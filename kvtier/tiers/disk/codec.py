"""Optional per-block compression.

KV blocks are float data: zstd at a low level typically saves 15-25 % on bf16 (the exponent
bytes repeat) and nothing on fp8. Each block is compressed on its own so any block can be read
alone, and a block that does not shrink by at least 1/64 is stored raw, so incompressible data
costs no decompression on the way back. Compressor objects are not thread-safe; each thread
gets its own.
"""

from __future__ import annotations

import threading

import zstandard

from kvtier.tiers.record import CODEC_NONE, CODEC_ZSTD

COMPRESSIONS = ("none", "zstd")


class BlockCodec:
    def __init__(self, compression: str, level: int) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(
                f"unknown disk compression {compression!r}; allowed: {', '.join(COMPRESSIONS)}"
            )
        if not -7 <= level <= 22:
            raise ValueError(f"zstd_level must be in [-7, 22], got {level}")
        self.compression = compression
        self.level = level
        self._local = threading.local()

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(
                level=self.level, write_content_size=True, write_checksum=False
            )
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def encode(self, payload: memoryview) -> tuple[int, bytes | memoryview]:
        """``(codec id, stored bytes)`` for one block."""
        if self.compression == "none":
            return CODEC_NONE, payload
        packed = self._compressor().compress(payload)
        if len(packed) > len(payload) - len(payload) // 64:
            return CODEC_NONE, payload
        return CODEC_ZSTD, packed

    def decode_into(self, codec: int, stored: bytes | bytearray, out: memoryview) -> bool:
        """Decompress ``stored`` into ``out``; False when it does not yield exactly len(out)."""
        if codec != CODEC_ZSTD:
            return False
        try:
            raw = self._decompressor().decompress(stored, max_output_size=len(out))
        except zstandard.ZstdError:
            return False
        if len(raw) != len(out):
            return False
        out[:] = raw
        return True
