"""Open the shared tier for one process: the namespace and keys it uses, and its store.

Both sides of an instance open it: the scheduler side to ask which blocks the server holds,
each worker to move its own rank's shard. They must agree on the namespace, so both derive it
from the same inputs (the geometry of rank 0's shard describes the model for presence checks;
each worker reads and writes the keys of its own rank).
"""

from __future__ import annotations

from kvtier.config.remote import RemoteTierConfig
from kvtier.tiers.layout import BlockGeometry
from kvtier.tiers.remote.keys import RemoteKeys, derive_namespace
from kvtier.tiers.remote.store import RemoteStore


def remote_keys(cfg: RemoteTierConfig, geometry: BlockGeometry, *, rank: int = 0,
                world_size: int = 1, hash_algorithm: str = "sha256",
                replicated: bool = False) -> RemoteKeys:
    """The key names of ``rank``'s blocks: every process of every instance derives the same."""
    fingerprint = geometry.fingerprint()
    namespace = cfg.namespace or derive_namespace(fingerprint, world_size=world_size,
                                                  hash_algorithm=hash_algorithm,
                                                  replicated=replicated)
    return RemoteKeys(namespace, fingerprint, rank=rank, replicated=replicated)


def connect_remote(cfg: RemoteTierConfig, geometry: BlockGeometry, *, rank: int = 0,
                   world_size: int = 1, hash_algorithm: str = "sha256",
                   replicated: bool = False) -> RemoteStore:
    """A store for ``rank``'s blocks (no connection is made until the first command)."""
    keys = remote_keys(cfg, geometry, rank=rank, world_size=world_size,
                       hash_algorithm=hash_algorithm, replicated=replicated)
    return RemoteStore(cfg, keys, name=f"kvtier-remote-r{rank}")
