"""The ``OffloadingManager`` contract (scheduler side), the same shape vLLM users know.

Every data movement is prepare -> complete: ``prepare_*`` reserves slots and pins the blocks
involved so that nothing in flight can be evicted; ``complete_*`` releases exactly what the
matching prepare took. The manager never touches a tensor; it returns addresses
(:mod:`kvtier.manager.specs`) that the worker side moves bytes between.

This class is the whole contract: the vLLM connector, ``kvtier bench``, the reliability rig
and the events feed use nothing else of a manager (``tests/connectors/vllm/test_connector_contract.py``
runs the connector against a manager that exposes only what is declared here). Methods for
optional features (shared promotions, background work, the cost model, resident tiers) have
defaults that describe a manager without that feature, so a minimal manager implements only
the abstract ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Collection, Iterable, Sequence

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
    from kvtier.manager.hints import RetentionHint
    from kvtier.manager.index.tier_index import TierIndex


class OffloadingManager(ABC):
    stats: ManagerStats
    """Counters for operators (``kvtier stats``, Prometheus); every manager keeps them."""

    cost: "LoadCostModel | None" = None
    """The load-versus-recompute model lookups consult (None: every hit is loaded)."""

    # ------------------------------------------------------------------ loads
    @abstractmethod
    def lookup(self, keys: Sequence[BlockKey], sighting: bool = True,
               ends_prompt: bool = False) -> LookupResult:
        """Leading run of ``keys`` that is ready to load from CPU memory. Blocks held in a
        lower tier (disk, shared tier) are promoted into CPU memory first: the lookup starts
        that (a background transfer) and answers ``pending`` until they are there.

        ``sighting``: count this as one sighting of the keys for admission. A caller asking
        again about the same request (vLLM does, every step it waits) passes False.
        ``ends_prompt``: a hit on all of ``keys`` leaves the engine one token to compute (a
        one-token step instead of a prefill), which cost-aware loading counts as a saving."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadPlan:
        """Pin the (looked-up) ``keys``, READY in CPU memory, for one CPU -> GPU copy; may
        cover a shorter prefix than asked."""

    def peek_cpu_slots(self, keys: Sequence[BlockKey]) -> tuple[int, ...]:
        """The CPU slots of the leading ``keys`` READY in CPU memory, pinning nothing: what a
        ``prepare_load`` right now would pin (a hint to start reading them early). Default:
        none (no early copies)."""
        return ()

    @abstractmethod
    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` as recently used (eviction order)."""

    @abstractmethod
    def complete_load(self, keys: Sequence[BlockKey], failed: Collection[BlockKey] = (),
                      transient: Collection[BlockKey] = ()) -> None:
        """Release the pins of a ``prepare_load``. ``failed`` keys could not be read from
        their tier (corrupt or missing record, or the read itself failed): the manager
        forgets them, so they are never offered again. A key whose tier was read but whose
        copy to the GPU failed is *not* failed: its bytes are fine
        (``kvtier.transfer.jobs`` tells the two apart). ``transient``:
        those of ``failed`` whose read failed for a reason that says nothing about the
        record (EIO, EMFILE, ENOMEM ...): counted apart from corruption."""

    # ------------------------------------------------------------------ stores
    @abstractmethod
    def prepare_store(
        self, keys: Sequence[BlockKey], ctx: RequestContext | None = None
    ) -> StorePlan:
        """Reserve room for the ``keys`` worth storing (not already stored, admitted)."""

    @abstractmethod
    def complete_store(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        """Publish (success) or roll back (failure, slots freed) a ``prepare_store``."""

    # ------------------------------------------------------------------ background work
    def take_background_transfers(self) -> list[BackgroundTransfer]:
        """Moves the manager wants on its own account (promotions, demotions, deletions,
        shared-tier writes), each to be run
        on every worker and reported once with ``complete_background``. Default: none."""
        return []

    def complete_background(self, transfer_id: int, success: bool = True,
                            failed: Collection[BlockKey] = (),
                            transient: Collection[BlockKey] = ()) -> None:
        """Settle a transfer from ``take_background_transfers`` (on every worker: ``success``
        only if it worked on all of them). ``failed``: keys a promotion could not read from
        their tier (forgotten), ``transient`` those of them that failed for a reason that says
        nothing about the record. Default: there are none, so any id is unknown."""
        raise KeyError(f"unknown background transfer {transfer_id}")

    # ------------------------------------------------------------------ cost model
    def record_load(self, medium: Medium, nbytes: int, seconds: float) -> None:
        """A load hop out of ``medium`` moved ``nbytes`` in ``seconds``. Default: ignored."""

    def record_promotion(self, medium: Medium, nbytes: int, seconds: float) -> None:
        """A promotion moved ``nbytes`` out of ``medium`` (DISK, REMOTE) and took ``seconds``
        from the lookup that started it to its settling: what the hops do not see (engine
        steps) is the tier's fixed cost per load. Default: ignored."""

    def measured_recompute(self, s_per_token: float, block_tokens: int, block_bytes: int) -> None:
        """The engine's measured prefill time per token. Default: ignored."""

    # ------------------------------------------------------------------ hints
    def set_retention(self, request_id: str, hint: "RetentionHint | None") -> None:
        """A request's retention hint (``kv_transfer_params['kvtier_retention']``): its blocks
        outrank unhinted ones in eviction and admission. Default: ignored (hints are never
        needed for correctness)."""

    # ------------------------------------------------------------------ state
    @abstractmethod
    def take_events(self) -> Iterable[Event]:
        """Drain the events produced since the last call."""

    def events_dropped(self) -> int:
        """Events lost because nobody drained them in time (a feed then resyncs). Default 0."""
        return 0

    @abstractmethod
    def usage(self) -> dict[str, dict[str, int]]:
        """Per tier name: ``used_blocks`` and ``capacity_blocks``."""

    @abstractmethod
    def pins(self) -> int:
        """Outstanding pins (0 when nothing is in flight: tests check for leaks)."""

    def tier(self, medium: Medium) -> "TierIndex | None":
        """The index of the tier on ``medium`` (CPU, DISK), read by event resyncs and by
        admission asking what is held below; None when there is none. Default: none."""
        return None
