"""The tiered manager: GPU -> CPU -> disk placement decisions, no bytes touched.

* New blocks go to CPU slots. A CPU block is *dirty* until a copy of it is on disk.
* Write-back demotion: the coldest ``flush_reserve`` CPU blocks are copied to disk ahead of
  need (when the disk tier admits them), so that evicting them later costs nothing and a
  store never waits on the disk. At most ``max_demotions_in_flight`` blocks are being copied
  at once. Eviction takes clean blocks first and drops dirty ones only when write-back is
  behind (see ``_evict_cpu``); a block being read (a load, a demotion) or written is never
  evicted. A store that finds no unpinned slot is cut short (counted) instead of blocking.
* A block held only below the CPU tier (disk, shared tier) is promoted before it is loaded:
  the ``lookup`` that finds it reserves a CPU slot (WRITING, ``promoted``), queues the
  DISK -> CPU (or REMOTE -> CPU) read as a background transfer and answers "not yet"
  (``LookupResult.pending``); ``complete_background`` publishes the block, and the next
  lookup finds it in CPU memory. Every load is then one CPU -> GPU copy of READY slots, and
  requests after the same blocks wait for the same promotion (vLLM's secondary-tier model).
* The shared tier (Redis/Valkey; ``RemoteTier`` in ``remote/tier.py``): lookups ask a presence
  directory without waiting (``LookupResult.pending``), a hit is promoted like a disk hit,
  stored CPU blocks are written back behind the tier's admission.
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

import time
from collections import deque
from typing import Collection, Iterable, Sequence

from kvtier.manager.abstract import OffloadingManager
from kvtier.manager.admission import AdmissionPolicy, AdmitAll, OffloadLimit
from kvtier.manager.background import BackgroundQueue
from kvtier.manager.cost import LoadCostModel
from kvtier.manager.disk_health import DiskHealth
from kvtier.manager.eviction import CpuEviction
from kvtier.manager.events import BlockAccessed, BlockRemoved, BlockStored, Event, EventBus
from kvtier.manager.policies import make_policy
from kvtier.manager.remote.tier import RemoteTier
from kvtier.manager.hints import HintBook, RetentionHint
from kvtier.manager.host import HostTier
from kvtier.manager.retention import RetentionHints
from kvtier.manager.specs import (
    BackgroundTransfer,
    BlockKey,
    LoadPlan,
    LoadStoreSpec,
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
        block_bytes: int = 0,
        host: HostTier | None = None,
        offload_limit: OffloadLimit | None = None,
    ) -> None:
        base = host.base if host is not None else 0  # the region's slots in the host's pool
        self.host = host
        self.cpu = TierIndex(Medium.CPU, cpu_blocks,
                             make_policy(cpu_eviction, cpu_blocks, handle_limit=base + cpu_blocks),
                             True, first_handle=base)
        self.disk = (
            TierIndex(Medium.DISK, disk_blocks, make_policy(disk_eviction, disk_blocks), False)
            if disk_blocks > 0
            else None
        )
        self.cpu_admission = cpu_admission or AdmitAll()
        self.offload_limit = offload_limit or OffloadLimit()  # how much of a prompt is stored
        self.disk_admission = disk_admission or AdmitAll()
        self.disk_health = disk_health or DiskHealth()  # stops demotions to a failing disk
        self.cost = cost  # None: every hit is loaded; else only while loading beats recompute
        self._cost_measured = False  # the cost model was made from measured recompute times
        # loads timed before the first recompute measurement made the model: replayed into it
        # (a fresh instance's first REMOTE promotion can come before any large forward;
        # forgetting it would let the next REMOTE hit load at the optimistic prior)
        self._early_loads: deque[tuple[bool, Medium, int, float]] = deque(maxlen=EARLY_LOADS)
        self.stats = ManagerStats()
        if host is not None:
            host.stats = self.stats
        self.events = EventBus()
        self.block_bytes = block_bytes  # sizes a promotion for the cost model
        self._promotions: dict[int, float] = {}  # promotion transfer id -> when it started
        self._clock = time.monotonic  # times promotions for the cost model (tests set it)
        self._promoted_from: dict[BlockKey, Medium] = {}  # promoted, not loaded yet: origin
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
            declines_test=self.writeback.declines_test,
            retire=host.retire if host is not None else None)
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
        if n < len(keys) and (self.disk is not None or self.remote is not None
                              or self.host is not None):
            self._extend_local(keys, tiers)
        if self.remote_tier.extend_lookup(keys, tiers):  # the server's answer is on its way
            return LookupResult(tuple(tiers[:self._cpu_run(tiers, n)]), pending=True)
        if self.cost is not None and tiers:
            keep = self.cost.worth_loading(tiers, ends_prompt and len(tiers) == len(keys))
            for medium in tiers[keep:]:  # resident, but recomputing them is faster
                self.stats.skipped_slower_than_recompute[medium.value] += 1
            del tiers[keep:]
        first = self._cpu_run(tiers, n)
        if first == len(tiers):
            return LookupResult(tuple(tiers))
        # Blocks below the CPU tier: promoted into it first; the hit is "not yet" until then
        # (every load is then one CPU -> GPU copy, and requests after the same blocks wait
        # for the same promotion)
        if self._promote(keys, tiers, first):
            return LookupResult(tuple(tiers[:first]), pending=True)
        return LookupResult(tuple(tiers[:first]))

    @staticmethod
    def _cpu_run(tiers: Sequence[Medium], known: int) -> int:
        """Length of the leading run of CPU hits in ``tiers``, whose first ``known`` are CPU
        hits already (the READY prefix): a plain CPU hit walks no list here."""
        if len(tiers) <= known:
            return len(tiers)
        for i in range(known, len(tiers)):
            if tiers[i] is not Medium.CPU:
                return i
        return len(tiers)

    def _extend_local(self, keys: Sequence[BlockKey], tiers: list[Medium]) -> None:
        """Extend ``tiers`` past the READY CPU prefix: READY CPU blocks, other instances'
        blocks in the host tier (CPU hits too), blocks being promoted (their source tier) and
        disk blocks, up to the first key none of those holds."""
        cpu, disk, promotions = self.cpu, self.disk, self.remote_tier.promotions
        rest = keys[len(tiers):]
        elsewhere = self.host.held(rest) if self.host is not None else None
        for i, key in enumerate(rest):
            entry = cpu.get(key)
            if (entry is not None and entry.state is BlockState.READY
                    or elsewhere is not None and elsewhere[i]):
                tiers.append(Medium.CPU)
            elif entry is not None:
                if entry.promoted:
                    tiers.append(Medium.REMOTE if key in promotions else Medium.DISK)
                else:  # being stored: not readable yet
                    break
            elif disk is not None and disk.is_ready(key):
                tiers.append(Medium.DISK)
            else:
                break

    def _promote(self, keys: Sequence[BlockKey], tiers: Sequence[Medium], first: int) -> bool:
        """Start the promotion into the CPU tier of every block of ``keys[first:len(tiers)]``
        held below it (``tiers``) and not being promoted yet, in key order, up to the first
        one no CPU slot can be made for. One background transfer per source tier. True when
        some block of the hit is being promoted now (the lookup answers "not yet")."""
        wanted = [i for i in range(first, len(tiers))
                  if tiers[i] is not Medium.CPU and keys[i] not in self.cpu]
        promoting = len(wanted) < sum(1 for m in tiers[first:] if m is not Medium.CPU)
        if not wanted:
            return promoting
        # the hit's READY blocks must not make room for the rest of it
        held = [k for k, m in zip(keys, tiers) if m is Medium.CPU and self.cpu.is_ready(k)]
        for key in held:
            self.cpu.ready(key).readers += 1
        try:
            room = self._room_for(len(wanted))
        finally:
            for key in held:
                self.cpu.ready(key).readers -= 1
        if room < len(wanted):
            self.stats.load_truncated_no_space += 1
            wanted = wanted[:room]
        disk_keys: list[BlockKey] = []
        disk_slots: list[int] = []
        remote_keys: list[BlockKey] = []
        remote_slots: list[int] = []
        for i in wanted:
            key = keys[i]
            if tiers[i] is Medium.DISK:
                d = self.disk.ready(key)
                d.readers += 1
                self.disk.policy.access(key)
                self.disk_admission.on_hit(key)
                entry = self.cpu.add(key, BlockState.WRITING)
                entry.promoted = entry.on_disk = True
                disk_keys.append(key), disk_slots.append(entry.slot)
            else:
                entry = self.remote_tier.promote(key)
                if entry is None:  # the directory forgot it meanwhile
                    break
                remote_keys.append(key), remote_slots.append(entry.slot)
        now = self._clock()
        if disk_keys:  # (their BlockAccessed(DISK) comes with the load: prepare_load)
            t = self.background.queue(LoadStoreSpec.disk(disk_keys),
                                      LoadStoreSpec.cpu(disk_slots), disk_keys)
            self._promotions[t.id] = now
        if remote_keys:
            t = self.background.queue(LoadStoreSpec.remote(remote_keys),
                                      LoadStoreSpec.cpu(remote_slots), remote_keys)
            self._promotions[t.id] = now
        return promoting or bool(disk_keys or remote_keys)

    def _room_for(self, n: int) -> int:
        """Free CPU slots for up to ``n`` promotions (one eviction pass, not one per block)."""
        self.eviction.make_room(n)
        return min(n, self.cpu.free_count)

    def record_load(self, medium: Medium, nbytes: int, seconds: float) -> None:
        """A hop out of ``medium`` moved ``nbytes`` in ``seconds`` (DISK, REMOTE: the read of
        a promotion; CPU: a CPU -> GPU load). Feeds the cost model; a no-op without one."""
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
        slots = self.cpu.pin_ready_prefix(keys)  # CPU handles are slot ids
        theirs: list[BlockKey] = []  # other instances' blocks (host tier): no local state
        if len(slots) < len(keys) and self.host is not None:
            rest = keys[len(slots):]
            more, theirs = self.host.pin(rest, [self.cpu.is_ready(k) for k in rest],
                                         lambda k: self.cpu.pin_ready_prefix((k,))[0])
            slots += more
        planned = tuple(keys[:len(slots)])
        sources: tuple[Medium, ...] = ()  # of every planned block
        if self._promoted_from:  # blocks promoted for this load: counted as their tier's hits
            pop = self._promoted_from.pop
            origin = tuple(pop(key, Medium.CPU) for key in planned)
            if any(m is not Medium.CPU for m in origin):
                sources = origin
        plan = LoadPlan(planned, tuple(slots), sources)
        got = list(planned)  # this instance's blocks: ordered, counted and announced below
        if theirs:  # counted here, announced and ordered by the instance that holds them
            self.stats.hit_blocks["CPU"] += len(theirs)
            theirs_set = set(theirs)
            mine = [i for i, k in enumerate(planned) if k not in theirs_set]
            got, slots = [planned[i] for i in mine], [slots[i] for i in mine]
            sources = tuple(sources[i] for i in mine) if sources else ()
        self.cpu_admission.on_hits(got)
        # Last-to-first, so the prefix's first block ends up the most recent: it is needed
        # whenever any block after it is (vLLM's touch does the same; policy_sim assumes it).
        self.cpu.policy.access_at(got[::-1], slots[::-1])
        # hits are counted, and announced (BlockAccessed), by the tier each came from, as
        # ``hit_blocks``: an events consumer's hit counts agree with the stats
        if sources:
            cpu_hits = [k for k, m in zip(got, sources) if m is Medium.CPU]
            disk_hits = [k for k, m in zip(got, sources) if m is Medium.DISK]
            remote_hits = [k for k, m in zip(got, sources) if m is Medium.REMOTE]
            self.stats.hit_blocks["CPU"] += len(cpu_hits)
            self.stats.hit_blocks["DISK"] += len(disk_hits)
            self.events.emit(BlockAccessed(Medium.CPU, tuple(cpu_hits)))
            self.events.emit(BlockAccessed(Medium.DISK, tuple(disk_hits)))
            if remote_hits:
                self.remote_tier.count_hits(remote_hits)
        else:
            self.stats.hit_blocks["CPU"] += len(got)
            self.events.emit(BlockAccessed(Medium.CPU, tuple(got)))
        return plan

    def peek_cpu_slots(self, keys: Sequence[BlockKey]) -> tuple[int, ...]:
        return tuple(self.cpu.ready_handles(keys))

    def touch(self, keys: Sequence[BlockKey]) -> None:
        rest = self.cpu.access(keys)
        if rest and self.disk is not None:
            self.disk.access(rest)

    def complete_load(self, keys: Sequence[BlockKey], failed: Collection[BlockKey] = (),
                      transient: Collection[BlockKey] = ()) -> None:
        # A load only read its CPU slots: the pins drop, failed or not. A key whose read
        # failed is forgotten once nothing else reads it (a CPU -> GPU copy that failed is not
        # a failed key: the caller reports only keys whose tier could not be read).
        own = self.host.unpin(keys) if self.host is not None else keys
        self.stats.protocol_errors += len(self.cpu.unpin_ready(own))
        failed = set(failed)
        forgotten: list[BlockKey] = []
        for key in failed:
            entry = self.cpu.get(key)
            # a demotion handed out still reads the slot (``flushing`` is its pin): freeing it
            # let the next store overwrite it and the demotion wrote that block's bytes to
            # disk under this key (issue 14.1)
            if (entry is not None and entry.readers == 0 and not entry.flushing
                    and entry.state is BlockState.READY):
                forgotten.append(key)
        if forgotten and self.host is not None:  # another instance may be reading it
            busy = self.host.retire(forgotten)
            forgotten = [k for k in forgotten if k not in busy]
        self.cpu.remove_many(forgotten)
        self.events.emit(BlockRemoved(Medium.CPU, tuple(forgotten)))  # it was announced
        self.stats.failed_loads += len(failed)
        self.stats.failed_loads_transient += len(failed.intersection(transient))
        self.writeback.plan(completion=True)

    def _promotion_done(self, t: BackgroundTransfer, success: bool,
                        failed: Collection[BlockKey], transient: Collection[BlockKey]) -> None:
        """Settle a promotion (DISK or REMOTE -> CPU): the blocks read become READY CPU
        blocks; those that could not be read free their slot and are forgotten below."""
        started = self._promotions.pop(t.id, None)
        bad_keys = set(t.keys) if not success else set(failed)
        published: list[BlockKey] = []
        unreadable: list[BlockKey] = []  # disk blocks forgotten: deleted on every rank
        medium = t.src.medium
        for key in t.keys:
            bad = key in bad_keys
            entry = self.cpu.get(key)
            if entry is None or not entry.promoted:
                self.stats.protocol_errors += 1
                continue
            if medium is Medium.REMOTE:
                self.remote_tier.settle_promotion(key, bad=bad)
            elif self._release_disk_reader(key, bad=bad):
                unreadable.append(key)
            if bad:
                self.cpu.remove(key)
                continue
            entry.state, entry.promoted = BlockState.READY, False
            published.append(key)
            self._promoted_from[key] = medium
        if len(self._promoted_from) > self.cpu.capacity:  # origins never loaded: only stats
            self._promoted_from.clear()
        self.stats.failed_loads += len(bad_keys)
        self.stats.failed_loads_transient += len(bad_keys.intersection(transient))
        if published and started is not None:  # what a request waits for a promotion
            self.record_promotion(medium, len(published) * self.block_bytes,
                                  self._clock() - started)
        self.writeback.drop_everywhere(unreadable)
        self.events.emit(BlockStored(Medium.CPU, tuple(published)))
        self._publish(published)
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
        if ctx is not None:
            keys = self.offload_limit.cap(keys, ctx)
        self.retention.note(keys, ctx)
        if self.cpu_admission.admits_everything:  # the usual case, one pass in the tier
            resident, wanted = self.cpu.partition(keys)
            # resident behind a gap: keep it, it becomes reachable again
            self.cpu.access(resident)
        else:
            wanted = self._admitted(keys)
        if self.host is not None:  # another instance holds it: one copy per host
            held, touched = self.host.held_and_touched(wanted)
            if touched:  # other instances' hits on this region's blocks, before it evicts
                self.cpu.access(touched)
            if any(held):
                self.stats.host_store_skipped_held += sum(held)
                wanted = [k for k, h in zip(wanted, held) if not h]
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
            self._publish(stored)
        else:
            self.cpu.remove_many(stored)
            self.stats.failed_stores["CPU"] += len(stored)
        self.writeback.plan(completion=True)

    def _publish(self, keys: Sequence[BlockKey]) -> None:
        """Blocks whose bytes are complete on every rank: readable by the host's other
        instances (host tier)."""
        if self.host is not None and keys:
            get = self.cpu.get
            self.host.publish(keys, [get(k).slot for k in keys])

    # ------------------------------------------------------------------ background work
    def take_background_transfers(self) -> list[BackgroundTransfer]:
        return self.background.take()

    def complete_background(self, transfer_id: int, success: bool = True,
                            failed: Collection[BlockKey] = (),
                            transient: Collection[BlockKey] = ()) -> None:
        t = self.background.settle(transfer_id)
        if t is None:
            self.stats.protocol_errors += 1
            return
        if t.id in self._promotions:
            self._promotion_done(t, success, failed, transient)
        elif t.dst.medium is Medium.REMOTE:
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
        if self.host is not None:
            out["HOST"] = self.host.usage()
        return out

    def pins(self) -> int:
        """Outstanding pins across tiers (0 when nothing is in flight; tests check leaks)."""
        n = self.cpu.pins() + (self.disk.pins() if self.disk is not None else 0)
        n += self.host.pins() if self.host is not None else 0
        return n + len(self.background)
