"""Server key names and record identities for the shared tier.

Many instances share one server, so a key must never let one instance read another's bytes as
its own: the default namespace hashes everything that changes the meaning of a block's bytes
(the geometry fingerprint covers model, dtype, block size, page layout and layout version; to
it are added the tensor-parallel layout and the prefix-hash algorithm). A namespace set in the
config is the operator's choice of *sharing scope*, so the record stored under a key still
carries the geometry fingerprint and a read under another geometry is a miss, not wrong bytes.

With tensor parallelism each rank stores its own shard under its own key (``r<rank>``); a
replicated layout (MLA: every rank holds the same bytes) is stored once, under rank 0.
"""

from __future__ import annotations

import hashlib

KEY_PREFIX = "kvtier"


def derive_namespace(geometry_fingerprint: str, *, world_size: int = 1,
                     hash_algorithm: str = "sha256", replicated: bool = False) -> str:
    """The default namespace: instances that could misread each other's bytes never share it."""
    text = f"{geometry_fingerprint}|tp={world_size}|replicated={replicated}|hash={hash_algorithm}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _rank_prefix(namespace: str, rank: int) -> bytes:
    return f"{KEY_PREFIX}:{namespace}:r{rank}:".encode()


class RemoteKeys:
    """Server key and record identity of a block, for one rank of one namespace."""

    def __init__(self, namespace: str, geometry_fingerprint: str, rank: int = 0,
                 replicated: bool = False) -> None:
        self.namespace = namespace
        self.fingerprint = geometry_fingerprint
        self.replicated = replicated
        self.rank = 0 if replicated else rank
        self._prefix = _rank_prefix(namespace, self.rank)
        self._identity = b"|" + geometry_fingerprint.encode()

    def server_key(self, block_key: bytes) -> bytes:
        return self._prefix + block_key.hex().encode()

    def shard_server_keys(self, block_key: bytes, world_size: int) -> list[bytes]:
        """The server keys of every rank's shard of a block (one key when replicated): a
        block is whole on the server only if all of them are there."""
        if self.replicated or world_size <= 1:
            return [self.server_key(block_key)]
        suffix = block_key.hex().encode()
        return [_rank_prefix(self.namespace, r) + suffix for r in range(world_size)]

    def record_key(self, server_key: bytes) -> bytes:
        """What the record stores and a read checks: the server key plus the geometry."""
        return server_key + self._identity

    @property
    def pattern(self) -> bytes:
        """SCAN pattern of this rank's keys (tests, tools)."""
        return self._prefix + b"*"
