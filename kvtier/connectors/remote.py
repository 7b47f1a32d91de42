"""The scheduler's handle on the shared tier: a presence directory over every rank's shard.

The scheduler process asks which blocks the server holds (EXISTS, batched, asynchronous); the
workers move the bytes. With tensor parallelism each rank writes its own shard, and the server
may evict one shard and keep another: a block is a hit only when every rank's shard key exists
(a replicated MLA cache has one key per block, rank 0's).
"""

from __future__ import annotations

from kvtier.connectors.settings import ConnectorSettings
from kvtier.tiers.remote.connect import connect_remote
from kvtier.tiers.remote.directory import RemoteDirectory


def open_remote_directory(settings: ConnectorSettings) -> RemoteDirectory | None:
    cfg = settings.config.remote
    if cfg is None:
        return None
    replicated = settings.replicated
    store = connect_remote(cfg, settings.geometry(0), rank=0, world_size=settings.world_size,
                           replicated=replicated)
    return RemoteDirectory(store, shards=1 if replicated else settings.world_size)
