"""The tiered manager: GPU -> CPU -> disk placement decisions, no bytes touched.

* New blocks go to CPU slots. A CPU block is *dirty* until a copy of it is on disk.
* Write-back demotion: the coldest ``flush_reserve`` CPU blocks are copied to disk ahead of
  need (when the disk tier admits them), so that evicting them later costs nothing and a
  store never waits on the disk. At most ``max_demotions_in_flight`` blocks are being copied
  at once. Eviction takes clean blocks first and drops dirty ones only when write-back is
  behind (see ``_evict_cpu``); a block being read (a load, a demotion) or written is never
  evicted. A store that finds no unpinned slot is cut short (counted) instead of blocking.
* A disk hit is promoted: ``prepare_load`` reserves a CPU slot for it; the worker runs
  DISK -> CPU then CPU -> GPU; ``complete_load`` publishes the CPU copy.
* The shared tier (Redis/Valkey; ``RemoteTier`` in ``remote_tier.py``): lookups ask a presence
  directory without waiting (``LookupResult.pending``), a hit is promoted REMOTE -> CPU like a
  disk hit, stored CPU blocks are written back behind the tier's admission.
* Moves the manager wants on its own account (demotions, deletions of evicted disk blocks)
  come out of ``take_background_transfers`` and are reported back through
  ``complete_background``.

The manager decides loads and stores itself and composes collaborators for the rest, each
given what it works on at construction: ``background`` (:class:`BackgroundQueue`: the own
moves in flight), ``writeback`` (:class:`WriteBack`: demotions, disk evictions, deletions),
``eviction`` (:class:`CpuEviction`), ``remote_tier`` (:class:`RemoteTier`) and ``retention``
(:class:`RetentionHints`). None of them reads the manager.
"""

from __future__ import annotations

from collections import deque
from typing import Collection, Iterable, Sequence

from kvtier.manager.abstract import OffloadingManager
from kvtier.manager.admission import AdmissionPolicy, AdmitAll
from kvtier.manager.background import BackgroundQueue
from kvtier.manager.cost import LoadCostModel
from kvtier.manager.disk_health import DiskHealth
from kvtier.manager.eviction import CpuEviction
from kvtier.manager.events import BlockAccessed, BlockRemoved, BlockStored, Event, EventBus
from kvtier.manager.policies import make_policy
from kvtier.manager.remote_tier import RemoteTier
from kvtier.manager.hints import HintBook, RetentionHint
from kvtier.manager.retention import RetentionHints
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
from kvtier.manager.index.tier_index import BlockState, TierIndex
from kvtier.manager.writeback import WriteBack


EARLY_LOADS = 64  # load samples kept until the cost model exists


class TieredOffloadingManager(OffloadingManager):
    def __init__(
        self,
        *,
        cpu_blocks: int,
        cpu_eviction: str = "lru",
        disk_blocks: int = 0,
        disk_eviction: str = "lru",
        cpu_admission: AdmissionPolicy | None = None,
        disk_admission: AdmissionPolicy | None = None,
        initial_disk_keys: Iterable[BlockKey] = (),
        stale_disk_keys: Iterable[BlockKey] = (),
        flush_reserve: int | None = None,
        disk_health: DiskHealth | None = None,
        cost: LoadCostModel | None = None,
        max_demotions_in_flight: int | None = None,
        remote=None,  # a RemoteDirectory: the shared tier (kvtier.tiers.remote)
        remote_admission: AdmissionPolicy | None = None,
        remote_max_writes: int = 256,
        remote_capacity_blocks: int | None = None,
    ) -> None:
        self.cpu = TierIndex(Medium.CPU, cpu_blocks, make_policy(cpu_eviction, cpu_blocks), True)
        self.disk = (
            TierIndex(Medium.DISK, disk_blocks, make_policy(disk_eviction, disk_blocks), False)
            if disk_blocks > 0
            else None
        )
        self.cpu_admission = cpu_admission or AdmitAll()
        self.disk_admission = disk_admission or AdmitAll()
        self.disk_health = disk_health or DiskHealth()  # stops demotions to a failing disk
        self.cost = cost  # None: every hit is loaded; else only while loading beats recompute
        self._cost_measured = False  # the cost model was made from measured recompute times
        # loads timed before the first recompute measurement made the model: replayed into it
        # (a fresh instance's first REMOTE promotion can come before any large forward;
        # forgetting it would let the next REMOTE hit load at the optimistic prior)
        self._early_loads: deque[tuple[bool, Medium, int, float]] = deque(maxlen=EARLY_LOADS)
        self.stats = ManagerStats()
        self.events = EventBus()
        self._failed_promotions: set[BlockKey] = set()  # failed, still pinned by joined loads
        self.background = BackgroundQueue()
        self.writeback = WriteBack(
            cpu=self.cpu, disk=self.disk, admission=self.disk_admission,
            health=self.disk_health, stats=self.stats, events=self.events,
            background=self.background, flush_reserve=flush_reserve,
            max_demotions_in_flight=max_demotions_in_flight)
        self.eviction = CpuEviction(
            cpu=self.cpu, admission=self.cpu_admission, disk_backed=self.disk is not None,
            health=self.disk_health, stats=self.stats, events=self.events,
            # how far past the batch an eviction looks for a block it can drop losslessly:
            # the flush window and the demotions in flight (write-back keeps those clean), twice
            budget=2 * (self.writeback.flush_reserve + self.writeback.max_demotions_in_flight),
            declines_test=self.writeback.declines_test)
        self.remote = remote  # a RemoteDirectory, or None without a shared tier
        self.remote_tier = RemoteTier(
            remote, admission=remote_admission, max_writes=remote_max_writes,
            capacity_blocks=remote_capacity_blocks, cpu=self.cpu, stats=self.stats,
            events=self.events, background=self.background, make_room=self.eviction.make_room)
        self.retention = RetentionHints(self.cpu, self.cpu_admission)
        if self.disk is not None:
            self.writeback.restore(initial_disk_keys, stale_disk_keys)

    # ------------------------------------------------------------------ what the collaborators hold
    @property
    def flush_reserve(self) -> int:
        return self.writeback.flush_reserve

    @property
    def max_demotions_in_flight(self) -> int:
        return self.writeback.max_demotions_in_flight

    @property
    def eviction_budget(self) -> int:
        return self.eviction.budget

    @property
    def hints(self) -> HintBook | None:
        """The retention hint book; None until the first hint."""
        return self.retention.book

    # ------------------------------------------------------------------ lookups and loads
    def lookup(self, keys: Sequence[BlockKey], sighting: bool = True,
               ends_prompt: bool = False) -> LookupResult:
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(keys)
        if sighting:
            self.cpu_admission.record_lookup(keys)
            if self.disk_admission is not self.cpu_admission:
                self.disk_admission.record_lookup(keys)
        n = self.cpu.ready_prefix(keys)
        tiers: list[Medium] = [Medium.CPU] * n
        cpu_ready = self.cpu.is_ready
        disk_ready = self.disk.is_ready if self.disk is not None else (lambda _key: False)
        for key in keys[n:] if self.disk is not None else ():
            if cpu_ready(key):
                tiers.append(Medium.CPU)
            elif disk_ready(key):
                tiers.append(Medium.DISK)
            else:
                break
        if self.remote_tier.extend_lookup(keys, tiers):  # the server's answer is on its way
            return LookupResult(tuple(tiers), pending=True)
        if self.cost is not None and tiers:
            keep = self.cost.worth_loading(tiers, ends_prompt and len(tiers) == len(keys))
            for medium in tiers[keep:]:  # resident, but recomputing them is faster
                self.stats.skipped_slower_than_recompute[medium.value] += 1
            del tiers[keep:]
        return LookupResult(tuple(tiers))

    def record_load(self, medium: Medium, nbytes: int, seconds: float) -> None:
        """A load hop out of ``medium`` moved ``nbytes`` in ``seconds`` (DISK: the DISK -> CPU
        hop of a promotion; CPU: CPU -> GPU). Feeds the cost model; a no-op without one."""
        if self.cost is not None:
            self.cost.record_load(medium, nbytes, seconds)
        else:
            self._early_loads.append((False, medium, nbytes, seconds))

    def record_promotion(self, medium: Medium, nbytes: int, seconds: float) -> None:
        if self.cost is not None:
            self.cost.record_promotion(medium, nbytes, seconds)
        else:
            self._early_loads.append((True, medium, nbytes, seconds))

    def measured_recompute(self, s_per_token: float, block_tokens: int, block_bytes: int) -> None:
        """The engine's measured prefill time per token. Without a configured ``cost:``
        section, the first measurement turns cost-aware loading on (bandwidth priors as
        configured, else the default); with one, the configured time stays."""
        if self.cost is None:
            self.cost = LoadCostModel(block_bytes=block_bytes, block_tokens=block_tokens,
                                      recompute_s_per_token=s_per_token)
            self._cost_measured = True
            while self._early_loads:
                promotion, medium, nbytes, seconds = self._early_loads.popleft()
                if promotion:
                    self.cost.record_promotion(medium, nbytes, seconds)
                else:
                    self.cost.record_load(medium, nbytes, seconds)
        elif self._cost_measured:
            self.cost.set_recompute(s_per_token, block_tokens)

    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadPlan:
        return self._prepare_load(keys, join=False)

    def prepare_shared_load(self, keys: Sequence[BlockKey]) -> LoadPlan:
        """``prepare_load`` that shares in-flight promotions instead of stopping at them.

        Many requests often hit one popular prefix at once (vLLM #44294). When a key's DISK ->
        CPU promotion is already in flight for another load, this load joins it (``joined[i]``):
        it pins the same CPU slot and reads it once the promotion is done, so the disk is read
        once and the second request neither recomputes nor waits for the first one's whole load.
        The caller must (1) run a joined key's CPU -> GPU copy only after the promoting load's
        DISK -> CPU hop finished, treating keys that hop failed as failed, and (2) call
        ``complete_load`` for the joined keys only after the promoting load's ``complete_load``.
        """
        return self._prepare_load(keys, join=True)

    def _prepare_load(self, keys: Sequence[BlockKey], join: bool) -> LoadPlan:
        # The leading CPU hits (nearly every load) in one tight pass, then the rest
        slots: list[int] = self.cpu.pin_ready_prefix(keys)  # CPU handles are slot ids
        m = len(slots)
        prefix = list(keys[:m])
        out_keys: list[BlockKey] = list(prefix)
        from_disk: list[bool] = [False] * m
        joined: list[bool] = [False] * m
        cpu_hits: list[BlockKey] = list(prefix)
        disk_hits: list[BlockKey] = []
        touched: list[tuple] = []  # (policy, key) after the prefix, applied last-to-first
        from_remote: list[bool] = [False] * m
        remote_hits: list[BlockKey] = []
        self.cpu_admission.on_hits(prefix)
        make_room, remote = self.eviction.make_room, self.remote_tier
        if m < len(keys):
            make_room(self._promotions_ahead(keys, m))  # one eviction, not one each
        for key in keys[m:]:
            entry = self.cpu.ready(key)
            if entry is not None:
                entry.readers += 1
                touched.append((self.cpu.policy, key))
                self.cpu_admission.on_hit(key)
                cpu_hits.append(key)
                out_keys.append(key), slots.append(entry.slot), from_disk.append(False)
                joined.append(False), from_remote.append(False)
                continue
            entry = self.cpu.get(key)
            if (join and entry is not None and entry.promoted and entry.state is BlockState.WRITING
                    and key not in remote.promotions):
                entry.readers += 1  # pins the slot past the promotion's own completion
                touched.append((self.disk.policy, key))
                disk_hits.append(key)
                out_keys.append(key), slots.append(entry.slot), from_disk.append(False)
                joined.append(True), from_remote.append(False)
                continue
            d = self.disk.ready(key) if self.disk is not None else None
            if key in self.cpu:  # a promotion of it already in flight
                break
            if d is None:  # held by the shared tier, or a miss
                entry = remote.promote(key)
                if entry is None:
                    break
                remote_hits.append(key)
                out_keys.append(key), slots.append(entry.slot), from_disk.append(False)
                joined.append(False), from_remote.append(True)
                continue
            if not make_room(1):
                self.stats.load_truncated_no_space += 1
                break
            d.readers += 1
            touched.append((self.disk.policy, key))
            self.disk_admission.on_hit(key)
            entry = self.cpu.add(key, BlockState.WRITING)
            entry.promoted = entry.on_disk = True
            disk_hits.append(key)
            out_keys.append(key), slots.append(entry.slot), from_disk.append(True)
            joined.append(False), from_remote.append(False)
        # Last-to-first, so the prefix's first block ends up the most recent: it is needed
        # whenever any block after it is (vLLM's touch does the same; policy_sim assumes it).
        for policy, key in reversed(touched):
            policy.access(key)
        self.cpu.policy.access_at(prefix[::-1], slots[m - 1::-1] if m else ())
        self.stats.hit_blocks["CPU"] += len(cpu_hits)
        self.stats.hit_blocks["DISK"] += len(disk_hits)
        self.events.emit(BlockAccessed(Medium.CPU, tuple(cpu_hits)))
        self.events.emit(BlockAccessed(Medium.DISK, tuple(disk_hits)))
        if remote_hits:
            remote.count_hits(remote_hits)
        return LoadPlan(tuple(out_keys), tuple(slots), tuple(from_disk),
                        tuple(joined) if join else (),
                        tuple(from_remote) if remote_hits else ())

    def _promotions_ahead(self, keys: Sequence[BlockKey], start: int) -> int:
        """How many of ``keys[start:]`` a load would promote into new CPU slots (from disk, or
        from the shared tier), up to the first key it could not serve that way (absent, or in
        the CPU tier but not READY). Makes room for them in one eviction: block by block, each
        eviction walked the cold end again, past every slot pinned there (a remote write pins
        its slot): quadratic in a long REMOTE hit, tens of milliseconds of the scheduler's step
        (docs/design-measurements.md), and one event per block."""
        cpu, disk, remote, n = self.cpu, self.disk, self.remote_tier, 0
        for key in keys[start:]:
            if cpu.is_ready(key):
                continue
            if key in cpu:
                break
            if (disk is not None and disk.is_ready(key)) or remote.promotable(key):
                n += 1
                continue
            break
        return n

    def touch(self, keys: Sequence[BlockKey]) -> None:
        rest = self.cpu.access(keys)
        if rest and self.disk is not None:
            self.disk.access(rest)

    def complete_load(self, keys: Sequence[BlockKey], failed: Collection[BlockKey] = (),
                      transient: Collection[BlockKey] = ()) -> None:
        failed = set(failed)
        published: list[BlockKey] = []
        unreadable: list[BlockKey] = []  # disk blocks forgotten: deleted on every rank
        # CPU hits (READY and pinned) only drop their pin, failed or not: the CPU -> GPU hop
        # reads the slot and never writes it. The rest (promotions, joins) below.
        for key in self.cpu.unpin_ready(keys):
            entry = self.cpu.get(key)
            if entry is None:
                self.stats.protocol_errors += 1
                continue
            if entry.promoted and entry.state is BlockState.WRITING:
                if not self.remote_tier.settle_promotion(key, bad=key in failed):
                    if self._release_disk_reader(key, bad=key in failed):
                        unreadable.append(key)
                if key in failed and entry.readers > 0:
                    # joined loads still pin the slot; they fail too, the last one frees it
                    entry.promoted = False
                    self._failed_promotions.add(key)
                elif key in failed:
                    self.cpu.remove(key)
                else:
                    entry.state, entry.promoted = BlockState.READY, False
                    published.append(key)
            elif key in self._failed_promotions:  # a load that joined a failed promotion
                if entry.readers <= 0:
                    self.stats.protocol_errors += 1
                    continue
                entry.readers -= 1
                if entry.readers == 0:
                    self._failed_promotions.discard(key)
                    self.cpu.remove(key)
            elif entry.readers > 0:
                # A CPU hit only had its CPU -> GPU hop, which reads the slot and never writes
                # it: whatever failed (the hop, or another hop of the same job), the CPU bytes
                # are intact, so the block stays. Freeing it here freed a slot that a queued
                # demotion or another load still read: the next store reused it and the
                # demotion wrote that store's bytes to disk under this key.
                entry.readers -= 1
            else:
                self.stats.protocol_errors += 1
        self.stats.failed_loads += len(failed)
        self.stats.failed_loads_transient += len(failed.intersection(transient))
        self.writeback.drop_everywhere(unreadable)
        self.events.emit(BlockStored(Medium.CPU, tuple(published)))
        self.writeback.plan(completion=True)

    def _release_disk_reader(self, key: BlockKey, bad: bool) -> bool:
        """Unpin ``key``'s disk entry; a ``bad`` one is forgotten (True: the caller deletes
        it on every rank). With tensor parallelism a read can fail on one rank only (a
        corrupt record, which that rank's store dropped; or a transient error, EIO or EMFILE,
        after which the store kept an intact record): the other ranks' slices, unindexed from
        now on, would sit on disk over capacity until the next start-up."""
        d = self.disk.get(key) if self.disk is not None else None
        if d is None or d.readers <= 0:
            self.stats.protocol_errors += 1
            return False
        d.readers -= 1
        if not bad:
            return False
        self.disk.remove(key)
        self.events.emit(BlockRemoved(Medium.DISK, (key,)))
        cpu = self.cpu.get(key)
        if cpu is not None:
            cpu.on_disk = False
        return True

    # ------------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[BlockKey], ctx: RequestContext | None = None) -> StorePlan:
        self.retention.note(keys, ctx)
        if self.cpu_admission.admits_everything:  # the usual case, one pass in the tier
            resident, wanted = self.cpu.partition(keys)
            # resident behind a gap: keep it, it becomes reachable again
            self.cpu.access(resident)
        else:
            wanted = self._admitted(keys)
        evicted: list[BlockKey] = []
        need = len(wanted) - self.cpu.free_count
        if need > 0:
            evicted = self.eviction.evict(need)
        room = self.cpu.free_count
        if room < len(wanted):
            self.stats.store_skipped_no_space += len(wanted) - room
            wanted = wanted[:room]
        parents = self._parents(keys, ctx, wanted) if self.cpu.policy.wants_parents else None
        slots = self.cpu.add_many(wanted, BlockState.WRITING, parents)
        if self.disk is not None:
            for key, slot in zip(wanted, slots):
                if self.disk.is_ready(key):
                    self.cpu.entry_at(slot).on_disk = True
        self.writeback.plan(window=len(wanted))
        return StorePlan(tuple(wanted), tuple(slots), {Medium.CPU: tuple(evicted)} if evicted else {})

    def _admitted(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """The new ``keys`` the CPU admission lets in, up to the first refused one that the
        disk does not hold either (prefix semantics); resident ones are accessed instead."""
        wanted: list[BlockKey] = []
        seen: set[BlockKey] = set()
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            if key in self.cpu:  # resident behind a gap: keep it, it becomes reachable again
                self.cpu.policy.access(key)
                continue
            if not self.cpu_admission.admit(key):
                self.stats.admission_rejected["CPU"] += 1
                if self.disk is None or self.disk.ready(key) is None:
                    break  # prefix semantics: nothing after an unstored block can be hit
                continue
            wanted.append(key)
        return wanted

    @staticmethod
    def _parents(keys, ctx: RequestContext | None, wanted: Sequence[BlockKey]) -> list:
        """Each of ``wanted``'s previous block in ``keys`` (the first's: ``ctx.parent_key``)."""
        known = dict(zip(keys, [ctx.parent_key if ctx is not None else None, *keys]))
        return [known.get(k) for k in wanted]

    def complete_store(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        # WRITING by a store (not a promotion); on success they become READY
        stored = (self.cpu.publish_stored_writes if success else self.cpu.stored_writes)(keys)
        self.stats.protocol_errors += len(keys) - len(stored)
        if success:
            self.stats.stored_blocks["CPU"] += len(stored)
            self.events.emit(BlockStored(Medium.CPU, tuple(stored)))
            self.remote_tier.queue_writes(stored)
        else:
            self.cpu.remove_many(stored)
            self.stats.failed_stores["CPU"] += len(stored)
        self.writeback.plan(completion=True)

    # ------------------------------------------------------------------ background work
    def take_background_transfers(self) -> list[BackgroundTransfer]:
        return self.background.take()

    def complete_background(self, transfer_id: int, success: bool = True) -> None:
        t = self.background.settle(transfer_id)
        if t is None:
            self.stats.protocol_errors += 1
            return
        if t.dst.medium is Medium.REMOTE:
            self.remote_tier.write_done(t, success)
        elif t.dst.medium is Medium.DROP:
            self.writeback.drop_done(t)
        else:
            self.eviction.note_cleaned(len(t.keys))  # turned clean (or failed): worth a search
            self.writeback.demotion_done(t, success)

    # ------------------------------------------------------------------ hints
    def set_retention(self, request_id: str, hint: RetentionHint | None) -> None:
        self.retention.set(request_id, hint)

    # ------------------------------------------------------------------ events and state
    def take_events(self) -> list[Event]:
        return self.events.take_events()

    def events_dropped(self) -> int:
        return self.events.dropped

    def tier(self, medium: Medium) -> TierIndex | None:
        return {Medium.CPU: self.cpu, Medium.DISK: self.disk}.get(medium)

    def usage(self) -> dict[str, dict[str, int]]:
        out = {"CPU": {"used_blocks": len(self.cpu), "capacity_blocks": self.cpu.capacity}}
        if self.disk is not None:
            out["DISK"] = {"used_blocks": len(self.disk), "capacity_blocks": self.disk.capacity}
        if self.remote is not None:
            out["REMOTE"] = self.remote_tier.usage()
        return out

    def pins(self) -> int:
        """Outstanding pins across tiers (0 when nothing is in flight; tests check leaks)."""
        n = self.cpu.pins() + (self.disk.pins() if self.disk is not None else 0)
        return n + len(self.background)
