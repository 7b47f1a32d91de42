"""Blocks in and out of the shared tier: key naming, encoding and verification around the store.

The CPU work of a write (checksums, optional zstd, the record's copy) runs on the caller's
threads. A read verifies each value where it lands, on the store's loop (``verify_into``: the
checksum and the copy into its CPU slot release the GIL), so a promotion hops no further thread. Every value read back is verified against the record key it
should hold (``value.decode_value_into``); a value that fails is a miss, and counted.
"""

from __future__ import annotations

import logging
from typing import Sequence

from kvtier.tiers.disk.codec import BlockCodec
from kvtier.tiers.remote.buffers import RecordBuffers
from kvtier.tiers.remote.store import RemoteStore
from kvtier.tiers.remote.value import decode_value_into, encode_value

log = logging.getLogger(__name__)
HIT, ABSENT, REJECTED = "hit", "absent", "rejected"  # verify_into's verdicts


class RemoteBlocks:
    def __init__(self, store: RemoteStore) -> None:
        self.store = store
        self.keys = store.keys
        self.codec = BlockCodec(store.cfg.compression, store.cfg.zstd_level)
        self.buffers = RecordBuffers()  # encode's values; ``release`` them once stored

    def server_keys(self, block_keys: Sequence[bytes]) -> list[bytes]:
        return [self.keys.server_key(k) for k in block_keys]

    def encode(self, block_keys: Sequence[bytes],
               payloads: Sequence[memoryview]) -> list[bytes | memoryview]:
        """Self-verifying values of the blocks (CPU work: call it off the event loops)."""
        out = []
        for key, payload in zip(block_keys, payloads):
            skey = self.keys.server_key(key)
            out.append(encode_value(self.keys.record_key(skey), payload, self.codec,
                                    self.buffers))
        return out

    def release(self, values: Sequence[bytes | memoryview]) -> None:
        """``encode``'s values the server acknowledged (no socket reads them any more)."""
        self.buffers.give(values)

    def decode_into(self, block_keys: Sequence[bytes], values: Sequence[bytes | None],
                    outs: Sequence[memoryview]) -> list[int]:
        """Verify and copy each value into its buffer; the positions that are misses."""
        verdicts = [self.verify_into(k, v, o) for k, v, o in zip(block_keys, values, outs)]
        return self.count(verdicts)

    def verify_into(self, block_key: bytes, value: bytes | None, out: memoryview) -> str:
        """Verify one value and copy it into ``out``: ``HIT``, ``ABSENT`` (no value), or
        ``REJECTED`` (a value that failed verification: logged; a miss all the same)."""
        why = decode_value_into(value, self.keys.record_key(self.keys.server_key(block_key)),
                                out, self.codec)
        if why is None:
            return HIT
        if value is None:
            return ABSENT
        log.warning("kvtier: remote block %s rejected (%s): a miss", block_key.hex()[:16], why)
        return REJECTED

    def count(self, verdicts: Sequence[str]) -> list[int]:
        """Count a batch's ``verify_into`` verdicts; the positions that are misses."""
        missed = [i for i, v in enumerate(verdicts) if v != HIT]
        self.store.count_verified(len(verdicts) - len(missed),
                                  sum(1 for v in verdicts if v == REJECTED))
        return missed

    # -- blocking helpers (tools, tests, the raw-client comparison) ----------------------------
    def put(self, block_keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        values = self.encode(block_keys, payloads)
        ok = self.store.run(self.store.set_values(self.server_keys(block_keys), values))
        self.release([v for v, good in zip(values, ok) if good])
        return ok

    def get_into(self, block_keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int]:
        values = self.store.run(self.store.get_values(self.server_keys(block_keys)))
        return self.decode_into(block_keys, values, outs)
