"""Admission added by wrapping a manager (the way vLLM composes it).

Wrappers filter what reaches ``prepare_store``; every other call of the ``OffloadingManager``
contract passes straight through, method by method (no attribute forwarding: what a wrapper
stack offers is exactly the contract), so it behaves like the manager underneath for loads,
events, completions, background work, the cost model and stats.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Collection, Iterable, Sequence

from kvtier.manager.abstract import OffloadingManager
from kvtier.manager.admission.base import SightingThreshold
from kvtier.manager.events import Event
from kvtier.manager.specs import (
    BackgroundTransfer,
    BlockKey,
    LoadPlan,
    LookupResult,
    Medium,
    RequestContext,
    StorePlan,
)
from kvtier.manager.stats import ManagerStats

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtier.manager.cost import LoadCostModel
    from kvtier.manager.index.tier_index import TierIndex


class ManagerWrapper(OffloadingManager):
    """Delegates everything to ``inner``; subclasses override what they filter."""

    def __init__(self, inner: OffloadingManager) -> None:
        self.inner = inner

    def lookup(self, keys: Sequence[BlockKey], sighting: bool = True,
               ends_prompt: bool = False) -> LookupResult:
        return self.inner.lookup(keys, sighting, ends_prompt)

    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadPlan:
        return self.inner.prepare_load(keys)

    def peek_cpu_slots(self, keys: Sequence[BlockKey]) -> tuple[int, ...]:
        return self.inner.peek_cpu_slots(keys)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        self.inner.touch(keys)

    def complete_load(self, keys: Sequence[BlockKey], failed: Collection[BlockKey] = (),
                      transient: Collection[BlockKey] = ()) -> None:
        self.inner.complete_load(keys, failed, transient)

    def prepare_store(self, keys: Sequence[BlockKey], ctx: RequestContext | None = None) -> StorePlan:
        return self.inner.prepare_store(keys, ctx)

    def complete_store(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        self.inner.complete_store(keys, success)

    def take_background_transfers(self) -> list[BackgroundTransfer]:
        return self.inner.take_background_transfers()

    def complete_background(self, transfer_id: int, success: bool = True,
                            failed: Collection[BlockKey] = (),
                            transient: Collection[BlockKey] = ()) -> None:
        self.inner.complete_background(transfer_id, success, failed, transient)

    def record_load(self, medium: Medium, nbytes: int, seconds: float) -> None:
        self.inner.record_load(medium, nbytes, seconds)

    def record_promotion(self, medium: Medium, nbytes: int, seconds: float) -> None:
        self.inner.record_promotion(medium, nbytes, seconds)

    def measured_recompute(self, s_per_token: float, block_tokens: int, block_bytes: int) -> None:
        self.inner.measured_recompute(s_per_token, block_tokens, block_bytes)

    def set_retention(self, request_id: str, hint: Any) -> None:
        self.inner.set_retention(request_id, hint)

    def take_events(self) -> Iterable[Event]:
        return self.inner.take_events()

    def events_dropped(self) -> int:
        return self.inner.events_dropped()

    def usage(self) -> dict[str, dict[str, int]]:
        return self.inner.usage()

    def pins(self) -> int:
        return self.inner.pins()

    def tier(self, medium: Medium) -> "TierIndex | None":
        return self.inner.tier(medium)

    @property
    def stats(self) -> ManagerStats:  # type: ignore[override]
        return self.inner.stats

    @property
    def cost(self) -> "LoadCostModel | None":  # type: ignore[override]
        return self.inner.cost


class StoreThresholdAdmission(ManagerWrapper):
    """Store a block only after it was seen in ``threshold`` lookups."""

    def __init__(self, inner: OffloadingManager, threshold: int, max_tracked: int) -> None:
        super().__init__(inner)
        self.policy = SightingThreshold(threshold, max_tracked)
        self.rejected = 0

    def lookup(self, keys: Sequence[BlockKey], sighting: bool = True,
               ends_prompt: bool = False) -> LookupResult:
        if sighting:
            self.policy.record_lookup(keys)
        return self.inner.lookup(keys, sighting, ends_prompt)

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
        for tier in (self.inner.tier(Medium.CPU), self.inner.tier(Medium.DISK)):
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
