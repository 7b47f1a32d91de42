"""The scheduler's handle on the shared tier: a presence directory over every rank's shard.

The scheduler process asks which blocks the server holds (EXISTS, batched, asynchronous); the
workers move the bytes. With tensor parallelism each rank writes its own shard, and the server
may evict one shard and keep another: a block is a hit only when every rank's shard key exists
(a replicated MLA cache has one key per block, rank 0's).
"""

from __future__ import annotations

from kvtier.config.remote import RemoteTierConfig
from kvtier.tiers.layout import BlockGeometry
from kvtier.tiers.remote.wire.connect import connect_remote
from kvtier.tiers.remote.directory import RemoteDirectory


def open_remote_directory(cfg: RemoteTierConfig | None, rank0_geometry: BlockGeometry,
                          world_size: int, replicated: bool) -> RemoteDirectory | None:
    """The presence directory of the shared tier ``cfg`` (None: no shared tier configured).
    ``rank0_geometry`` names the keys; ``replicated``: one shard (rank 0's) per block."""
    if cfg is None:
        return None
    store = connect_remote(cfg, rank0_geometry, rank=0, world_size=world_size,
                           replicated=replicated)
    return RemoteDirectory(store, shards=1 if replicated else world_size)
