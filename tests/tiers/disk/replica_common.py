"""Shared by tests/tiers/disk/test_disk_replicated.py and its rank-1 child process (replica_child.py):
the ranks' geometries and configs, and the bytes each block holds (the same on every rank, as
in an MLA cache)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from kvtier.config import KvtierConfig, load_config
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.tiers.layout import BlockGeometry

LAYERS = 2
PAGE = 1024
BLOCK = LAYERS * PAGE
CPU_BLOCKS = 8
DISK_BLOCKS = 6


def geometry(rank: int) -> BlockGeometry:
    """As the connector names a rank's blocks (the rank is part of the identity)."""
    return BlockGeometry(num_layers=LAYERS, kv_parts=1, engine_blocks_per_block=1,
                         page_bytes=PAGE, dtype="uint8", model=f"mla-test;tp={rank}/2")


def rank_config(root: Path, rank: int, **disk) -> KvtierConfig:
    """Rank ``rank``'s config, as ConnectorSettings.rank_config gives it (``<root>/rank<r>``)."""
    extra = "".join(f", {k}: {v}" for k, v in disk.items())
    return load_config(text=f"tiers:\n  cpu: {{capacity: {CPU_BLOCKS * BLOCK}}}\n"
                            f"  disk: {{path: {root / f'rank{rank}'}, "
                            f"capacity: {DISK_BLOCKS * BLOCK}, fsync: false, "
                            f"compression: none{extra}}}\n", env={})


def view_for(geo: BlockGeometry) -> GpuKvView:
    """A CPU stand-in for the engine's KV pages (4 engine blocks)."""
    return GpuKvView({f"layer.{i}": torch.zeros((1, 4, geo.page_bytes), dtype=torch.uint8)
                      for i in range(geo.num_layers)}, layout="kv_first")


def pattern(key: bytes) -> bytes:
    """The block's bytes: derived from the key alone, so every rank holds the same."""
    seed = hashlib.sha256(key).digest()
    return (seed * (BLOCK // len(seed) + 1))[:BLOCK]
