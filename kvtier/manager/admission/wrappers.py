"""Admission added by wrapping a manager (the way vLLM composes it).

Wrappers filter what reaches ``prepare_store``; every other call passes straight through, so a
wrapper stack behaves exactly like the manager underneath for loads, events and completions.
"""

from __future__ import annotations

import math
from typing import Collection, Iterable, Sequence

from kvtier.manager.abstract import OffloadingManager
from kvtier.manager.admission.base import SightingThreshold
from kvtier.manager.events import Event
from kvtier.manager.specs import BlockKey, LoadPlan, LookupResult, RequestContext, StorePlan


class ManagerWrapper(OffloadingManager):
    """Delegates everything to ``inner``; subclasses override what they filter."""

    def __init__(self, inner: OffloadingManager) -> None:
        self.inner = inner

    def lookup(self, keys: Sequence[BlockKey], sighting: bool = True) -> LookupResult:
        return self.inner.lookup(keys, sighting)

    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadPlan:
        return self.inner.prepare_load(keys)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        self.inner.touch(keys)

    def complete_load(self, keys: Sequence[BlockKey], failed: Collection[BlockKey] = ()) -> None:
        self.inner.complete_load(keys, failed)

    def prepare_store(self, keys: Sequence[BlockKey], ctx: RequestContext | None = None) -> StorePlan:
        return self.inner.prepare_store(keys, ctx)

    def complete_store(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        self.inner.complete_store(keys, success)

    def take_events(self) -> Iterable[Event]:
        return self.inner.take_events()

    def __getattr__(self, name: str):  # extras of the wrapped manager (stats, background work)
        return getattr(self.inner, name)


class StoreThresholdAdmission(ManagerWrapper):
    """Store a block only after it was seen in ``threshold`` lookups."""

    def __init__(self, inner: OffloadingManager, threshold: int, max_tracked: int) -> None:
        super().__init__(inner)
        self.policy = SightingThreshold(threshold, max_tracked)
        self.rejected = 0

    def lookup(self, keys: Sequence[BlockKey], sighting: bool = True) -> LookupResult:
        if sighting:
            self.policy.record_lookup(keys)
        return self.inner.lookup(keys, sighting)

    def prepare_store(self, keys: Sequence[BlockKey], ctx: RequestContext | None = None) -> StorePlan:
        # Prefix semantics: blocks behind a refused one cannot be hit until it is stored, so
        # passing stops there, unless a tier below already holds the refused block.
        admitted: list[BlockKey] = []
        for k in keys:
            if self.policy.admit(k):
                admitted.append(k)
            elif not self._held_below(k):
                break
        self.rejected += len(keys) - len(admitted)
        return self.inner.prepare_store(admitted, ctx)

    def _held_below(self, key: BlockKey) -> bool:
        for tier in (getattr(self.inner, "cpu", None), getattr(self.inner, "disk", None)):
            if tier is not None and key in tier:
                return True
        return False


class OffloadRatioAdmission(ManagerWrapper):
    """Offload only the front of each prompt: ``offload_ratio`` of its blocks and at most
    ``max_offload_tokens`` tokens. A request's ``RequestContext`` may override both."""

    def __init__(self, inner: OffloadingManager, offload_ratio: float = 1.0,
                 max_offload_tokens: int | None = None) -> None:
        super().__init__(inner)
        if not 0.0 < offload_ratio <= 1.0:
            raise ValueError(f"offload_ratio must be in (0, 1], got {offload_ratio}")
        self.offload_ratio = offload_ratio
        self.max_offload_tokens = max_offload_tokens
        self.rejected = 0

    def limit_blocks(self, ctx: RequestContext) -> int | None:
        """How many leading prompt blocks may be offloaded (None: no limit)."""
        ratio = ctx.offload_ratio if ctx.offload_ratio is not None else self.offload_ratio
        max_tokens = ctx.max_offload_tokens if ctx.max_offload_tokens is not None else self.max_offload_tokens
        limit: int | None = None
        if ratio < 1.0 and ctx.num_prompt_blocks > 0:
            limit = math.ceil(ratio * ctx.num_prompt_blocks)
        if max_tokens is not None and ctx.block_tokens > 0:
            by_tokens = max_tokens // ctx.block_tokens
            limit = by_tokens if limit is None else min(limit, by_tokens)
        return limit

    def prepare_store(self, keys: Sequence[BlockKey], ctx: RequestContext | None = None) -> StorePlan:
        if ctx is not None:
            limit = self.limit_blocks(ctx)
            if limit is not None:
                allowed = max(0, limit - ctx.first_block_index)
                self.rejected += max(0, len(keys) - allowed)
                keys = list(keys)[:allowed]
        return self.inner.prepare_store(keys, ctx)
