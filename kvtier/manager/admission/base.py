"""Admission plug-ins: whether a block is worth writing into a tier at all.

On real traces most offloaded KV is never read again; writing it costs PCIe/disk bandwidth and
SSD wear. An admission policy sees every lookup (sightings of keys), hits and evictions of its
tier, and answers ``admit(key)`` when the tier is about to write a block. It never moves data and
never evicts. Policies are chosen by name per tier (``store_threshold`` in the YAML maps to
"threshold").
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

from kvtier.manager.index.keyed_list import KeyedList
from kvtier.manager.specs import BlockKey, RequestContext


class AdmissionPolicy(ABC):
    name: str = ""
    # ``admit`` is always True and has no side effect: the manager skips the per-block call.
    admits_everything: bool = False

    def record_lookup(self, keys: Sequence[BlockKey]) -> None:
        """``keys`` of a request were looked up (one sighting each)."""

    def on_hit(self, key: BlockKey) -> None:
        """``key`` was found resident in this tier."""

    def on_evict(self, key: BlockKey) -> None:
        """``key`` left this tier."""

    def on_hits(self, keys: Sequence[BlockKey]) -> None:
        """``on_hit`` for a batch (one call per request on the load path)."""
        for key in keys:
            self.on_hit(key)

    def on_evicts(self, keys: Sequence[BlockKey]) -> None:
        """``on_evict`` for a batch (one call per eviction)."""
        for key in keys:
            self.on_evict(key)

    @abstractmethod
    def admit(self, key: BlockKey) -> bool:
        """May ``key`` be written into this tier now? Called once per actual write decision:
        a policy may count it (an admitted block awaits its outcome)."""

    def would_admit(self, key: BlockKey) -> bool:
        """``admit`` without side effects, for questions such as "is this block worth keeping
        dirty until it can be demoted?". Stateless policies need not override it."""
        return self.admit(key)


class AdmitAll(AdmissionPolicy):
    name = "all"
    admits_everything = True

    def on_hits(self, keys: Sequence[BlockKey]) -> None:
        pass

    def on_evicts(self, keys: Sequence[BlockKey]) -> None:
        pass

    def admit(self, key: BlockKey) -> bool:
        return True


@dataclass(frozen=True)
class OffloadLimit:
    """Offload only the front of each prompt: ``ratio`` of its blocks and at most
    ``max_tokens`` tokens (``admission.offload_ratio`` / ``max_offload_tokens``); a request's
    ``RequestContext`` overrides both. Applied by the manager's ``prepare_store`` itself, so
    per-request limits need no wrapper around the manager (every call would pay for one)."""

    ratio: float = 1.0
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"offload_ratio must be in (0, 1], got {self.ratio}")

    def blocks(self, ctx: RequestContext) -> int | None:
        """How many leading prompt blocks of ``ctx``'s request may be offloaded (None: all)."""
        ratio = ctx.offload_ratio if ctx.offload_ratio is not None else self.ratio
        max_tokens = ctx.max_offload_tokens if ctx.max_offload_tokens is not None else self.max_tokens
        limit: int | None = None
        if ratio < 1.0 and ctx.num_prompt_blocks > 0:
            limit = math.ceil(ratio * ctx.num_prompt_blocks)
        if max_tokens is not None and ctx.block_tokens > 0:
            by_tokens = max_tokens // ctx.block_tokens
            limit = by_tokens if limit is None else min(limit, by_tokens)
        return limit

    def cap(self, keys: Sequence[BlockKey], ctx: RequestContext) -> Sequence[BlockKey]:
        """``keys`` (starting at block ``ctx.first_block_index``) cut at the limit."""
        limit = self.blocks(ctx)
        if limit is None:
            return keys
        return keys[:max(0, limit - ctx.first_block_index)]


class SightingThreshold(AdmissionPolicy):
    """Admit a block once it has been seen in ``threshold`` lookups (vLLM's store_threshold,
    KVBM's "seen twice before it goes to disk"). Counts live in a bounded LRU map so memory
    stays proportional to the tier, not to the history."""

    name = "threshold"

    def __init__(self, threshold: int, max_tracked: int) -> None:
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold}")
        self.threshold = threshold
        self.max_tracked = max(1024, max_tracked)
        self._seen = KeyedList(self.max_tracked) if threshold > 1 else None  # key -> sightings

    def record_lookup(self, keys: Sequence[BlockKey]) -> None:
        seen = self._seen
        if seen is None:
            return
        for k in keys:
            seen.push_bounded(k, seen.get(k, 0) + 1)

    def admit(self, key: BlockKey) -> bool:
        return self._seen is None or self._seen.get(key, 0) >= self.threshold


_REGISTRY: dict[str, Callable[..., AdmissionPolicy]] = {}


def register_admission(name: str, factory: Callable[..., AdmissionPolicy]) -> None:
    """``factory(threshold=int, capacity_blocks=int) -> AdmissionPolicy``."""
    _REGISTRY[name] = factory


def make_admission(name: str, *, threshold: int = 1, capacity_blocks: int = 0) -> AdmissionPolicy:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown admission policy {name!r}; allowed: {', '.join(sorted(_REGISTRY))}"
        ) from None
    return factory(threshold=threshold, capacity_blocks=capacity_blocks)


def admission_names() -> list[str]:
    return sorted(_REGISTRY)


register_admission("all", lambda threshold=1, capacity_blocks=0: AdmitAll())
register_admission(
    "threshold",
    lambda threshold=1, capacity_blocks=0: SightingThreshold(threshold, 4 * capacity_blocks),
)
