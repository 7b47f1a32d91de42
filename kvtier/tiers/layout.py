"""Block geometry: how one kvtier block maps onto bytes.

A kvtier block covers ``block_tokens`` tokens of one request across *all* layers. The engine
keeps KV in pages of ``engine_block_tokens`` tokens per layer, so one kvtier block spans
``engine_blocks_per_block`` engine pages per layer and per K/V part.

Every tier stores a block in one canonical byte order, the *slot layout*::

    [layer][kv_part][engine_block_in_block][page_bytes]

so a slot can be moved between CPU and disk as one flat buffer and viewed per layer without a
copy. The geometry's fingerprint guards persisted data: a disk directory written under another
geometry (other model, dtype or block size) must never be read back as if it matched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

LAYOUT_VERSION = 1
"""Bumped whenever the slot byte order changes; part of the fingerprint and of each disk record."""


@dataclass(frozen=True)
class BlockGeometry:
    num_layers: int
    kv_parts: int  # 2 for K and V, 1 for MLA-style latent caches
    engine_blocks_per_block: int  # kvtier block_tokens / engine block size
    page_bytes: int  # bytes of one engine page of one layer and one K/V part
    dtype: str = "bfloat16"  # informational, part of the fingerprint
    model: str = ""  # model identity (name or config hash), part of the fingerprint

    def __post_init__(self) -> None:
        for name in ("num_layers", "engine_blocks_per_block", "page_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BlockGeometry.{name} must be a positive int, got {value!r}")
        if self.kv_parts not in (1, 2):
            raise ValueError(f"BlockGeometry.kv_parts must be 1 or 2, got {self.kv_parts!r}")

    @property
    def layer_bytes(self) -> int:
        """Bytes of one block in one layer (all K/V parts and sub-pages)."""
        return self.kv_parts * self.engine_blocks_per_block * self.page_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole kvtier block (one slot)."""
        return self.num_layers * self.layer_bytes

    @property
    def slot_shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.kv_parts, self.engine_blocks_per_block, self.page_bytes)

    def fingerprint(self) -> str:
        """Stable identity of the byte layout, stored next to persisted blocks."""
        payload = json.dumps({"layout_version": LAYOUT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:32]

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers x {self.kv_parts} kv x {self.engine_blocks_per_block} pages "
            f"x {self.page_bytes} B ({self.dtype}, model={self.model or '?'})"
        )
