"""The ``OffloadingManager`` contract (scheduler side), the same shape vLLM users know.

Every data movement is prepare -> complete: ``prepare_*`` reserves slots and pins the blocks
involved so that nothing in flight can be evicted; ``complete_*`` releases exactly what the
matching prepare took. The manager never touches a tensor; it returns addresses
(:mod:`kvtier.manager.specs`) that the worker side moves bytes between.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Collection, Iterable, Sequence

from kvtier.manager.events import Event
from kvtier.manager.specs import BlockKey, LoadPlan, LookupResult, RequestContext, StorePlan


class OffloadingManager(ABC):
    @abstractmethod
    def lookup(self, keys: Sequence[BlockKey], sighting: bool = True) -> LookupResult:
        """Leading run of ``keys`` that is ready to load, and the tier of each hit.

        ``sighting``: count this as one sighting of the keys for admission. A caller asking
        again about the same request (vLLM does, every step it waits) passes False."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadPlan:
        """Pin the (looked-up) ``keys`` for reading; may cover a shorter prefix than asked."""

    @abstractmethod
    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` as recently used (eviction order)."""

    @abstractmethod
    def complete_load(self, keys: Sequence[BlockKey], failed: Collection[BlockKey] = ()) -> None:
        """Release the pins of a ``prepare_load``. ``failed`` keys could not be read (corrupt
        or missing): they are removed so they are never offered again."""

    @abstractmethod
    def prepare_store(
        self, keys: Sequence[BlockKey], ctx: RequestContext | None = None
    ) -> StorePlan:
        """Reserve room for the ``keys`` worth storing (not already stored, admitted)."""

    @abstractmethod
    def complete_store(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        """Publish (success) or roll back (failure, slots freed) a ``prepare_store``."""

    @abstractmethod
    def take_events(self) -> Iterable[Event]:
        """Drain the events produced since the last call."""
