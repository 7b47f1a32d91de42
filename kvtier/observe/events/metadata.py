"""What events say about a block beyond its key: token ids, parent hash, LoRA.

The manager only knows keys, but indexers (llm-d style) need ``token_ids``, ``block_size`` and
``parent_block_hash`` to map blocks to prompts. Whoever knows them (the vLLM connector from the
request, ``kvtier bench`` from the trace) hands the publisher a ``MetadataLookup``; blocks it
cannot describe go out as hash-only placeholders (empty ``token_ids``, no parent), which is
what vLLM's own offloading path sends.

The lookup runs on the publisher thread, so it must be thread-safe; ``MetadataCache`` is.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvtier.manager.specs import BlockKey


@dataclass(frozen=True)
class BlockMeta:
    """One block as the engine hashed it. ``token_ids`` are the block's own tokens (the last
    block of a prompt may be shorter than the block size)."""

    token_ids: Sequence[int]
    parent: BlockKey | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None


MetadataLookup = Callable[[BlockKey], "BlockMeta | None"]


class MetadataCache:
    """A bounded, thread-safe ``MetadataLookup`` the caller fills as it learns blocks.

    Token ids are kept as a compact ``array('q')`` (8 bytes a token). The least recently
    remembered or looked-up entries go first; a block whose entry is gone is published as a
    placeholder, never with someone else's tokens.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("MetadataCache capacity must be at least 1")
        self.capacity = capacity
        self._entries: OrderedDict[BlockKey, BlockMeta] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, key: BlockKey, token_ids: Sequence[int], parent: BlockKey | None = None,
                 lora_name: str | None = None, extra_keys: tuple[Any, ...] | None = None) -> None:
        tokens = token_ids if isinstance(token_ids, array) else array("q", token_ids)
        meta = BlockMeta(tokens, parent, lora_name, extra_keys)
        with self._lock:
            self._entries[key] = meta
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def __call__(self, key: BlockKey) -> BlockMeta | None:
        with self._lock:
            meta = self._entries.get(key)
            if meta is not None:
                self._entries.move_to_end(key)
            return meta

    def __len__(self) -> int:
        return len(self._entries)
