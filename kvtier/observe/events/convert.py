"""Manager events -> wire events, with the metadata the caller can attach.

vLLM publishes one ``BlockStored`` per chain of blocks: ``parent_block_hash`` names the block
before the first, ``token_ids`` is every block's tokens concatenated and consumers cut it into
``block_size`` pieces. The manager's ``BlockStored`` carries arbitrary keys, so they are grouped
here into runs that really are chains (each block's recorded parent is the previous key, every
block but the last is full); anything else starts a new event. Blocks without usable metadata
are grouped into hash-only placeholders.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Sequence

from kvtier.observe.events.metadata import BlockMeta, MetadataLookup
from kvtier.observe.events.wire import (
    WIRE_MEDIUM,
    BlockAccessed,
    BlockRemoved,
    BlockStored,
    HashValue,
    StateEvent,
)
from kvtier.manager import events as mgr
from kvtier.manager.specs import BlockKey, Medium

log = logging.getLogger(__name__)

WireHash = Callable[[BlockKey], HashValue]


def wire_medium(medium: Medium) -> str:
    return WIRE_MEDIUM.get(medium, str(getattr(medium, "value", medium)))


def wire_locality(medium: Medium) -> str | None:
    """vLLM 0.32+'s ``locality``: ``REMOTE`` for the shared tier (off-host, every instance's);
    unset for this host's tiers, whose events stay byte for byte what they were."""
    return "REMOTE" if medium is Medium.REMOTE else None


class EventConverter:
    """Stateless apart from counters; runs on the publisher thread."""

    def __init__(self, block_tokens: int, metadata: MetadataLookup | None = None,
                 wire_hash: WireHash | None = None) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.block_tokens = block_tokens
        self._metadata = metadata
        self._hash: WireHash = wire_hash or (lambda key: key)
        self.metadata_errors = 0  # lookups that raised or returned unusable metadata

    def _meta(self, key: BlockKey) -> BlockMeta | None:
        if self._metadata is None:
            return None
        try:
            meta = self._metadata(key)
        except Exception:  # noqa: BLE001 - a caller's bug costs a placeholder, not the stream
            self.metadata_errors += 1
            log.debug("kvtier events: metadata lookup failed", exc_info=True)
            return None
        if meta is None:
            return None
        if not isinstance(meta, BlockMeta) or not 0 < len(meta.token_ids) <= self.block_tokens:
            self.metadata_errors += 1
            return None
        return meta

    def stored(self, medium: Medium, keys: Sequence[BlockKey]) -> list[BlockStored]:
        out: list[BlockStored] = []
        run: list[tuple[BlockKey, BlockMeta | None]] = []
        for key in keys:
            meta = self._meta(key)
            if run and not self._continues(run[-1], key, meta):
                out.append(self._event(medium, run))
                run = []
            run.append((key, meta))
        if run:
            out.append(self._event(medium, run))
        return out

    def _continues(self, last: tuple[BlockKey, BlockMeta | None], key: BlockKey,
                   meta: BlockMeta | None) -> bool:
        last_key, last_meta = last
        if last_meta is None or meta is None:
            return last_meta is None and meta is None  # placeholders group with placeholders
        return (meta.parent == last_key and meta.lora_name == last_meta.lora_name
                and len(last_meta.token_ids) == self.block_tokens)

    def _event(self, medium: Medium, run: list[tuple[BlockKey, BlockMeta | None]]) -> BlockStored:
        hashes = [self._hash(k) for k, _ in run]
        first = run[0][1]
        if first is None:
            return BlockStored(hashes, None, [], self.block_tokens, None, wire_medium(medium), None,
                               locality=wire_locality(medium))
        tokens: list[int] = []
        for _, meta in run:
            tokens.extend(int(t) for t in meta.token_ids)
        extra = [m.extra_keys for _, m in run]
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=self._hash(first.parent) if first.parent is not None else None,
            token_ids=tokens,
            block_size=self.block_tokens,
            lora_id=None,
            medium=wire_medium(medium),
            lora_name=first.lora_name,
            extra_keys=extra if any(e is not None for e in extra) else None,
            locality=wire_locality(medium),
        )

    def removed(self, medium: Medium, keys: Sequence[BlockKey]) -> BlockRemoved:
        return BlockRemoved([self._hash(k) for k in keys], wire_medium(medium),
                            locality=wire_locality(medium))

    def accessed(self, medium: Medium, keys: Sequence[BlockKey]) -> BlockAccessed:
        tokens = 0
        for key in keys:
            meta = self._meta(key)
            tokens += len(meta.token_ids) if meta is not None else self.block_tokens
        return BlockAccessed([self._hash(k) for k in keys], wire_medium(medium), tokens)

    def convert(self, events: Iterable[mgr.Event], access: bool = True
                ) -> tuple[list[StateEvent], list[BlockAccessed]]:
        """Wire events for manager events, in order; access events kept apart (and not built
        at all with ``access=False``: vLLM's stream has no hit events, and building one costs
        a metadata lookup and a wire hash per block of every hit)."""
        state: list[StateEvent] = []
        hits: list[BlockAccessed] = []
        for ev in events:
            if not ev.keys:
                continue
            if isinstance(ev, mgr.BlockStored):
                state.extend(self.stored(ev.medium, ev.keys))
            elif isinstance(ev, mgr.BlockRemoved):
                state.append(self.removed(ev.medium, ev.keys))
            elif access and isinstance(ev, mgr.BlockAccessed):
                hits.append(self.accessed(ev.medium, ev.keys))
        return state, hits
