"""Admission added by wrapping a manager (the way vLLM composes it).

Wrappers filter what reaches ``prepare_store``; every other call of the ``OffloadingManager``
contract passes straight through, one method per method of the contract (no attribute
forwarding: what a wrapper stack offers is exactly the contract), so it behaves like the
manager underneath for loads, events, completions, background work, the cost model and stats.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Callable, Sequence

from kvtier.manager.abstract import OffloadingManager
from kvtier.manager.admission.base import SightingThreshold
from kvtier.manager.specs import BlockKey, LookupResult, Medium, RequestContext, StorePlan


def _pass_through(name: str) -> Callable[..., Any]:
    def method(self: "ManagerWrapper", *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = getattr(OffloadingManager, name).__doc__
    return method


class ManagerWrapper(OffloadingManager):
    """Delegates every method of the contract to ``inner``; subclasses override what they
    filter."""

    def __init__(self, inner: OffloadingManager) -> None:
        self.inner = inner

    stats = property(lambda self: self.inner.stats)  # type: ignore[assignment]
    cost = property(lambda self: self.inner.cost)  # type: ignore[assignment]


for _name, _member in list(vars(OffloadingManager).items()):
    if callable(_member) and not _name.startswith("_"):
        setattr(ManagerWrapper, _name, _pass_through(_name))
abc.update_abstractmethods(ManagerWrapper)


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
