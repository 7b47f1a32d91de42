"""Admission added by wrapping a manager (the way vLLM composes it).

Wrappers filter what reaches ``prepare_store``; every other call of the ``OffloadingManager``
contract passes straight through, one method per method of the contract (no attribute
forwarding: what a wrapper stack offers is exactly the contract), so it behaves like the
manager underneath for loads, events, completions, background work, the cost model and stats.
"""

from __future__ import annotations

import abc
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
