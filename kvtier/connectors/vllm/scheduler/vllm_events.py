"""Manager events -> vLLM's ``BlockStored`` / ``BlockRemoved``, published by vLLM itself.

The scheduler calls ``take_events`` every step and appends what it gets to the GPU cache's
events, so indexers (llm-d style) see kvtier's tiers on vLLM's own stream: ``medium`` "CPU" or
"STORAGE" (the disk tier), block hashes converted exactly as vLLM converts its GPU events
(``maybe_convert_block_hash``), and the full payload (token ids, block size, parent hash)
for blocks the connector saw in a request. Chains are grouped by kvtier's converter; blocks
whose tokens are unknown (restored from disk after a restart) go out as hash-only events.
Hit events have no vLLM counterpart and are dropped here. With hybrid KV cache groups each
group's blocks go out in their own events, with vLLM's hash and the group's index and kind.
The structs are built by :mod:`compat.kv_events` (fields differ between vLLM releases).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvtier.connectors.vllm.compat.kv_events import block_removed, block_stored
from kvtier.connectors.vllm.group_keys import split_group_key
from kvtier.connectors.vllm.settings import GroupInfo
from kvtier.observe.events import wire
from kvtier.observe.events.convert import EventConverter
from kvtier.observe.events.metadata import MetadataCache
from kvtier.manager.events import Event
from kvtier.manager.specs import BlockKey


class VllmEventConverter:
    """Remembers what each block holds (bounded) and turns manager events into vLLM events."""

    def __init__(self, block_tokens: int, capacity_blocks: int,
                 groups: Sequence[GroupInfo] = ()) -> None:
        self.metadata = MetadataCache(max(1024, capacity_blocks))
        self._convert = EventConverter(block_tokens, self.metadata, wire_hash=self.wire_hash)
        self._groups = tuple(groups) if len(groups) > 1 else ()  # only hybrid events say it

    @staticmethod
    def wire_hash(key: BlockKey):
        """A block key as vLLM puts it on the wire (int or bytes, per vLLM's setting); a
        hybrid group's key goes out as vLLM's hash of the block (the group is a field)."""
        return maybe_convert_block_hash(split_group_key(key)[0])

    def remember(self, key: BlockKey, token_ids: Sequence[int], parent: BlockKey | None,
                 lora_name: str | None) -> None:
        self.metadata.remember(key, token_ids, parent, lora_name)

    def _by_group(self, events: Sequence[Event]) -> list[tuple[int | None, Event]]:
        if not self._groups:
            return [(None, ev) for ev in events]
        out: list[tuple[int | None, Event]] = []
        for ev in events:
            keys: dict[int, list[BlockKey]] = {}
            for key in ev.keys:
                keys.setdefault(split_group_key(key)[1], []).append(key)
            out.extend((g, replace(ev, keys=tuple(ks))) for g, ks in sorted(keys.items()))
        return out

    def convert(self, events: Sequence[Event]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for group, event in self._by_group(events):
            info = self._groups[group] if group is not None and group < len(self._groups) else None
            state, _ = self._convert.convert([event], access=False)
            for ev in state:
                if isinstance(ev, wire.BlockStored):
                    out.append(block_stored(
                        block_hashes=list(ev.block_hashes),
                        parent_block_hash=ev.parent_block_hash,
                        token_ids=list(ev.token_ids),
                        block_size=ev.block_size,
                        lora_id=ev.lora_id,
                        medium=ev.medium,
                        lora_name=ev.lora_name,
                        extra_keys=ev.extra_keys,
                        group_idx=group,
                        spec_kind=info.kind if info is not None else None,
                        sliding_window=info.sliding_window if info is not None else None,
                    ))
                elif isinstance(ev, wire.BlockRemoved):
                    out.append(block_removed(block_hashes=list(ev.block_hashes),
                                             medium=ev.medium, group_idx=group))
        return out
