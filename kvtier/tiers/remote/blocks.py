"""Blocks in and out of the shared tier: key naming, encoding and verification around the store.

The CPU work (checksums, optional zstd, copies) runs on the caller's threads; only the network
I/O runs on the store's loop. Every value read back is verified against the record key it
should hold (``value.decode_value_into``); a value that fails is a miss, and counted.
"""

from __future__ import annotations

import logging
from typing import Sequence

from kvtier.tiers.disk.codec import BlockCodec
from kvtier.tiers.remote.store import RemoteStore
from kvtier.tiers.remote.value import decode_value_into, encode_value

log = logging.getLogger(__name__)


class RemoteBlocks:
    def __init__(self, store: RemoteStore) -> None:
        self.store = store
        self.keys = store.keys
        self.codec = BlockCodec(store.cfg.compression, store.cfg.zstd_level)

    def server_keys(self, block_keys: Sequence[bytes]) -> list[bytes]:
        return [self.keys.server_key(k) for k in block_keys]

    def encode(self, block_keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bytes]:
        """Self-verifying values of the blocks (CPU work: call it off the event loops)."""
        out = []
        for key, payload in zip(block_keys, payloads):
            skey = self.keys.server_key(key)
            out.append(encode_value(self.keys.record_key(skey), payload, self.codec))
        return out

    def decode_into(self, block_keys: Sequence[bytes], values: Sequence[bytes | None],
                    outs: Sequence[memoryview]) -> list[int]:
        """Verify and copy each value into its buffer; the positions that are misses."""
        missed, rejected = [], 0
        for i, (key, value, out) in enumerate(zip(block_keys, values, outs)):
            skey = self.keys.server_key(key)
            why = decode_value_into(value, self.keys.record_key(skey), out, self.codec)
            if why is not None:
                missed.append(i)
                if value is not None:
                    rejected += 1
                    log.warning("kvtier: remote block %s rejected (%s): a miss",
                                key.hex()[:16], why)
        self.store.count_verified(len(block_keys) - len(missed), rejected)
        return missed

    # -- blocking helpers (tools, tests, the raw-client comparison) ----------------------------
    def put(self, block_keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        values = self.encode(block_keys, payloads)
        return self.store.run(self.store.set_values(self.server_keys(block_keys), values))

    def get_into(self, block_keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int]:
        values = self.store.run(self.store.get_values(self.server_keys(block_keys)))
        return self.decode_into(block_keys, values, outs)
