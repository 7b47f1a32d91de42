"""The scheduler's handle on the shared tier: a presence directory over rank 0's keys.

The scheduler process asks which blocks the server holds (EXISTS, batched, asynchronous); the
workers move the bytes. Rank 0's keys stand for the block: each rank writes its own shard, so
a block whose other shards the server evicted reads as a miss on that rank and is recomputed.
"""

from __future__ import annotations

from kvtier.connectors.settings import ConnectorSettings
from kvtier.tiers.remote.connect import connect_remote
from kvtier.tiers.remote.directory import RemoteDirectory


def open_remote_directory(settings: ConnectorSettings) -> RemoteDirectory | None:
    cfg = settings.config.remote
    if cfg is None:
        return None
    store = connect_remote(cfg, settings.geometry(0), rank=0, world_size=settings.world_size,
                           replicated=settings.replicated_kv and settings.world_size > 1)
    return RemoteDirectory(store)
