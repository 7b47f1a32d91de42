"""Manager events -> vLLM's ``BlockStored`` / ``BlockRemoved``, published by vLLM itself.

The scheduler calls ``take_events`` every step and appends what it gets to the GPU cache's
events, so indexers (llm-d style) see kvtier's tiers on vLLM's own stream: ``medium`` "CPU" or
"STORAGE" (the disk tier), block hashes converted exactly as vLLM converts its GPU events
(``maybe_convert_block_hash``), and the full payload (token ids, block size, parent hash)
for blocks the connector saw in a request. Chains are grouped by kvtier's converter; blocks
whose tokens are unknown (restored from disk after a restart) go out as hash-only events.
Hit events have no vLLM counterpart and are dropped here.
"""

from __future__ import annotations

from typing import Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvtier.events import wire
from kvtier.events.convert import EventConverter
from kvtier.events.metadata import MetadataCache
from kvtier.manager.events import Event
from kvtier.manager.specs import BlockKey


class VllmEventConverter:
    """Remembers what each block holds (bounded) and turns manager events into vLLM events."""

    def __init__(self, block_tokens: int, capacity_blocks: int) -> None:
        self.metadata = MetadataCache(max(1024, capacity_blocks))
        self._convert = EventConverter(block_tokens, self.metadata, wire_hash=self.wire_hash)

    @staticmethod
    def wire_hash(key: BlockKey):
        """A block key as vLLM puts it on the wire (int or bytes, per vLLM's setting)."""
        return maybe_convert_block_hash(key)

    def remember(self, key: BlockKey, token_ids: Sequence[int], parent: BlockKey | None,
                 lora_name: str | None) -> None:
        self.metadata.remember(key, token_ids, parent, lora_name)

    def convert(self, events: Sequence[Event]) -> list[KVCacheEvent]:
        state, _ = self._convert.convert(events, access=False)
        out: list[KVCacheEvent] = []
        for ev in state:
            if isinstance(ev, wire.BlockStored):
                out.append(BlockStored(
                    block_hashes=list(ev.block_hashes),
                    parent_block_hash=ev.parent_block_hash,
                    token_ids=list(ev.token_ids),
                    block_size=ev.block_size,
                    lora_id=ev.lora_id,
                    medium=ev.medium,
                    lora_name=ev.lora_name,
                    extra_keys=ev.extra_keys,
                ))
            elif isinstance(ev, wire.BlockRemoved):
                out.append(BlockRemoved(block_hashes=list(ev.block_hashes), medium=ev.medium))
        return out
