"""The scheduler half: owns the tiered manager, plans every transfer, never touches a tensor.

Per step (vLLM calls these from ``Scheduler.schedule`` / ``update_from_output``):

* ``lookup`` (get_num_new_matched_tokens): leading run of the prompt's blocks that the CPU
  tier holds, block aligned; one that reaches the last prompt token is reported one token
  short with its last block loaded whole (:func:`claim`). Blocks held only on disk or in
  the shared tier are promoted into CPU memory first: the manager's lookup starts that and
  answers "not yet", and so does this lookup (``None``: vLLM asks again next step); requests
  after the same blocks wait for the same promotion. A hit within this step's
  ``sync_load_budget_bytes`` loads *synchronously*: vLLM schedules the request in this very
  step, the worker enqueues the copy before the forward and orders the forward after it on
  the GPU (no extra engine step, no host wait). What exceeds the budget loads
  asynchronously (the request waits in WAITING_FOR_REMOTE_KVS), and so does every hit
  where vLLM zeroes new blocks (Mamba or mixed-precision caches): it zeroes them in the
  worker after the connector's first hook, over a copy already enqueued; and every hit of a
  model with several KV cache groups, whose failed load vLLM takes only as a request still
  waiting for it (``settings.async_loads_only``, :mod:`..compat.load_failures`). Such a
  request restarts from zero computed tokens and is not loaded again (``on_failed_recving``):
  a failed load is a recompute. With Mamba/SSM state groups the hit is cut at a boundary
  whose state kvtier holds (:mod:`state_hit`).
* ``plan_load`` (update_state_after_alloc): ``prepare_load`` pins the CPU blocks; the load
  is one CPU -> GPU job (:class:`..metadata.LoadJob`).
* ``build_meta``: stores of every block that the *previous* steps completed (write-through,
  admission and per-request ``kv_transfer_params`` applied), the manager's background moves,
  and the fence: store jobs whose source blocks are written this step. Stores are planned one
  step late on purpose: planning a large store costs the scheduler milliseconds and its
  GPU -> CPU copy, queued right behind the forward, holds up the sampled tokens' own device
  -> host copy (the copy engine serves them in order), so a request that stores would pay
  both before its first token (figures: docs/design-measurements.md). One step later both
  run after its token is out, and the copy overlaps the next step's forward instead of its
  output.
  The decode trickle of running requests (a block per request every ``block_tokens``
  steps) is planned every ``store_every_steps`` steps instead (:meth:`_take_due`): one store
  copy costs the engine thread the same CUDA calls whatever its size, and a copy every
  decode step put that cost on every step past saturation (docs/design-measurements.md).
  Sliding-window and hybrid models plan in the step itself: vLLM frees a running request's
  blocks that leave the window at the next step's allocation, before a late plan could read
  them. With vLLM's async scheduling "the next step" is launched before the prompt step's
  token is returned, so a prompt's store waits one step more (``first_token_pending``).
* ``on_worker_output``: counts worker reports per job (:mod:`ledger`); a complete job settles
  the manager's prepare call (``complete_load`` with the failed keys, ``complete_store``,
  ``complete_background``, :mod:`ledger`).
* ``request_finished``: delay freeing a request's blocks while its stores are in flight or
  still to be planned (its last step's blocks), and rank its chain in the CPU tier's
  eviction order head-most-recent, once its last store is planned: a lookup walks a chain
  from its first block, so a chain evicted from the head would stay as dead weight (vLLM's
  native LRU ranks it so too).

Stores are planned by a :class:`StorePlanner`, jobs settled by a :class:`JobSettler`: both
are collaborators built here, with their own state and explicit methods.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterable

from kvtier.connectors.vllm.fast_path import FastPath, WorkerHandoff
from kvtier.connectors.vllm.compat.hints import request_hints
from kvtier.tiers.disk.catalog.inventory import restored_keys
from kvtier.tiers.remote.presence import open_remote_directory
from kvtier.connectors.vllm.scheduler.vllm_events import VllmEventConverter
from kvtier.connectors.vllm.group_keys import GroupKeyMap
from kvtier.connectors.vllm.recompute import RecomputeEstimate
from kvtier.connectors.vllm.scheduler.observability import SchedulerObservability
from kvtier.connectors.vllm.metadata import (
    BackgroundJob,
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadJob,
)
from kvtier.connectors.vllm.scheduler.requests import (KeyMap, RequestParams, RequestTrack,
                                                       drop_if_done)
from kvtier.connectors.vllm.settings import ConnectorSettings
from kvtier.connectors.vllm.scheduler.ledger import JobLedger, JobSettler
from kvtier.connectors.vllm.scheduler.state_hit import state_lookup
from kvtier.connectors.vllm.scheduler.store_plan import StorePlanner
from kvtier.connectors.vllm.stats import KVTierStats
from kvtier.observe.timeline import ms_since, timeline
from kvtier.manager.factory import build_manager
from kvtier.manager.host import open_host_tier
from kvtier.manager.retention import apply_retention_hint
from kvtier.manager.specs import BlockKey, Medium

log = logging.getLogger(__name__)

SATURATION_HOLD_STEPS = 16  # steps a saturated engine counts as such after its last sign


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, handoff: WorkerHandoff) -> None:
        self.settings = settings
        # TP 1: the worker of this engine in this thread starts a CPU hit's copy early
        self.fast = FastPath(handoff, settings.same_thread_fast_path)
        bb = settings.block_bytes
        disk_keys, partial_keys = restored_keys(settings.disk_paths(),
                                                settings.disk_geometries())
        self.remote = open_remote_directory(settings.config.remote, settings.geometry(0),
                                            settings.world_size, settings.replicated)
        # the host tier: this engine's CPU tier is its region of the host's shared pool
        self.host = (open_host_tier(settings.config, settings.geometry(0).fingerprint(), bb,
                                    settings.engine_id or f"pid-{os.getpid()}")
                     if settings.config.host is not None else None)
        # per-request kv_transfer_params limit offloading through the store's RequestContext
        self.manager = build_manager(settings.config, bb, disk_keys, partial_keys,
                                     remote=self.remote, host=self.host)
        if len(settings.groups) > 1:  # hybrid allocator: one kvtier block per (block, group)
            self.keymap: KeyMap = GroupKeyMap(
                settings.block_tokens, settings.hash_block_size, settings.block_size,
                len(settings.groups), [i for i, g in enumerate(settings.groups) if g.is_state])
        else:
            self.keymap = KeyMap(settings.block_tokens, settings.hash_block_size,
                                 settings.block_size)
        self.ledger = JobLedger(settings.world_size)
        self.tracks: dict[str, RequestTrack] = {}
        self.kv_cache_manager: Any = None  # vLLM's KVCacheManager, bound after construction
        self._step_loads: list[LoadJob] = []
        self._store_due: list[str] = []  # their completed blocks are planned (_take_due)
        self._steps_since_stores = 0  # build_meta calls since every due store was planned
        # plan stores one step late unless vLLM frees blocks of running requests (windows)
        self.late_stores = settings.sliding_window is None and len(settings.groups) <= 1
        self._step_watch: list[str] = []
        self._step_untaint: list[str] = []
        self._step_background: list[BackgroundJob] = []
        self._step_sync_bytes = 0  # CPU hits promised as synchronous loads this step
        # requests looked up this step and not allocated (yet): at build_meta, left waiting
        self._step_unadmitted: set[str] = set()
        self._saturated_steps = 0  # steps the engine still counts as saturated
        self._recompute = RecomputeEstimate()
        # claim()'s bound on a hit whose last block is loaded whole
        self._whole_tail_max_bytes = settings.whole_tail_layer_bytes * max(1, settings.num_layers)
        self._tl = timeline()
        # token ids are needed until a block's last event (its demotion to disk at the latest,
        # which happens while it still sits in CPU): a few CPU tiers' worth is plenty
        self._events = VllmEventConverter(settings.block_tokens,
                                          2 * settings.config.cpu_slots(bb) + 1024,
                                          settings.groups)
        # Token ids and parents are only kept when some event stream publishes them
        self._describe = settings.vllm_kv_events or settings.config.events is not None
        self._stats = KVTierStats()
        self.stores = StorePlanner(settings, self.keymap, self.manager, self.ledger, self._stats,
                                   self._remember if self._describe else None)
        self.settler = JobSettler(self.manager, self.tracks, self.stores.released, self._stats)
        self.observability = SchedulerObservability(
            settings.config, self.manager, block_tokens=settings.block_tokens, block_bytes=bb,
            metadata=self._events.metadata, wire_hash=self._events.wire_hash)
        log.info("kvtier: scheduler side ready: %d CPU blocks, %d disk blocks (%d restored), "
                 "%d B per block", settings.config.cpu_slots(bb),
                 settings.config.disk_blocks(bb), len(disk_keys), bb)

    # ------------------------------------------------------------------ requests
    def track(self, request: Any) -> RequestTrack:
        t = self.tracks.get(request.request_id)
        if t is None:
            t = RequestTrack(request, RequestParams.parse(request.kv_transfer_params),
                             hints=request_hints(request))
            self.tracks[request.request_id] = t
            apply_retention_hint(self.manager, t.req_id, request.kv_transfer_params, t.hints)
        return t

    def _drop_if_done(self, t: RequestTrack) -> None:
        drop_if_done(self.tracks, t)

    def _remember(self, request: Any, index: int, key: BlockKey) -> None:
        """Keep what block ``index`` of ``request`` holds, for the event streams."""
        before = self.keymap.parent_index(index)
        parent = self.keymap.key(request, before) if before >= 0 else None
        lora = getattr(request, "lora_request", None)
        self._events.remember(key, self.keymap.tokens(request, index), parent,
                              getattr(lora, "lora_name", None))

    # ------------------------------------------------------------------ loads
    def lookup(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        answer = self._lookup(request, num_computed_tokens)
        if answer[0] is not None and not answer[1]:  # vLLM may allocate it in this step
            self._step_unadmitted.add(request.request_id)
        return answer

    def _lookup(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        began = time.perf_counter() if self._tl.enabled else 0.0  # the marks' "ms"
        self.fast.drop()  # one lookup -> plan pass at a time (fast_path)
        t = self.track(request)
        if t.load_job is not None:  # our previous load of it has not settled yet
            return None, False
        bt, per = self.settings.block_tokens, self.keymap.per_block
        if t.params.skip_load or t.load_failed or num_computed_tokens % bt:
            return 0, False
        start = num_computed_tokens // bt * per
        # the block holding the last token counts too (claim(): it is loaded whole), but
        # not with state groups: a state hit ends short of the last token (state_hit.py)
        state = bool(getattr(self.keymap, "state_groups", ()))
        last = (request.num_tokens - 1 if state else request.num_tokens) // bt * per
        stop = min(last, self.keymap.num_keyed(request))
        if stop <= start:
            return 0, False
        keys: list[BlockKey] = []
        if state:
            found_state = state_lookup(self.manager, self.keymap, request, start, stop,
                                       sighting=not t.sighted)
            pending, hits = found_state.pending, found_state.units
        else:
            keys = self.keymap.keys(request, start, stop)
            # all of them loaded, the step computes the last token only (claim())
            ends = stop // per * bt >= request.num_tokens - 1
            found = self.manager.lookup(keys, sighting=not t.sighted, ends_prompt=ends)
            hits = found.num_hits - found.num_hits % per  # whole token blocks (every group)
            pending = found.pending
        if pending:  # a promotion or the shared tier's answer is on its way: asked again
            if self._tl.enabled and not t.sighted:  # when the wait began (the answer: "lookup")
                self._tl.mark("sched", "lookup_pending", req=t.req_id, blocks=stop - start,
                              ms=ms_since(began))
            t.sighted = True
            return None, False
        t.sighted = True
        self._stats.add("lookup_tokens", (stop - start) // per * bt)
        room = request.num_tokens - 1 - num_computed_tokens
        hits, claimed = claim(hits, per, bt, room, self.settings.block_bytes,
                              self._whole_tail_max_bytes)
        if hits == 0:
            if self._tl.enabled:
                self._tl.mark("sched", "lookup", req=t.req_id, blocks=stop - start, hits=0,
                              ms=ms_since(began))
            return 0, False
        t.lookup_start = num_computed_tokens
        nbytes = hits * self.settings.block_bytes
        t.sync_load = (not self.settings.async_loads_only
                       and self._step_sync_bytes + nbytes <= self.settings.sync_load_budget_bytes)
        if t.sync_load:
            self._step_sync_bytes += nbytes
            # its copy may start now, while vLLM allocates (fast_path); not again for a
            # request whose last hit vLLM found no room for: on a full engine the head of
            # the queue is looked up every step, and each prefetch would be dropped unused
            if per == 1 and not t.hit_unplanned:
                self.fast.prefetch(self.manager, keys[:hits], nbytes, whole=claimed == room)
        t.hit_unplanned = True  # until plan_load
        if self._tl.enabled:
            self._tl.mark("sched", "lookup", req=t.req_id, blocks=stop - start, hits=hits,
                          sync=t.sync_load, ms=ms_since(began))
        return claimed, not t.sync_load

    def plan_load(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._step_unadmitted.discard(request.request_id)  # allocated: vLLM admitted it
        if num_external_tokens <= 0:
            return
        t = self.track(request)
        t.hit_unplanned = False
        bt, bs, per = self.settings.block_tokens, self.settings.block_size, self.keymap.per_block
        start, n = t.lookup_start // bt * per, num_external_tokens // bt * per
        # A hit ending one token short of the prompt's end, off a block boundary, is a whole
        # tail (claim(): a block-aligned claim never ends there unless the end is aligned):
        # its last block is loaded whole; it ends at the prompt's end, so every engine block
        # of it is allocated
        whole_tail = (num_external_tokens % bt != 0
                      and t.lookup_start + num_external_tokens == request.num_tokens - 1)
        if whole_tail:
            n += per
        block_ids = self.keymap.table(blocks.get_block_ids())
        epb = self.keymap.engine_per_block
        # one group (per == 1): the units' engine ids are one flat slice of the block table
        flat = self.keymap.engine_ids(block_ids, start, n) if per == 1 else None
        # vLLM may trim a hit to its own block size; engine blocks of a partial kvtier block
        # were claimed but cannot be loaded: they are reported as load errors (recomputed)
        partial = ([] if whole_tail else
                   self.keymap.gpu_ids(block_ids, start + n)[:(num_external_tokens % bt) // bs])
        keys = self.keymap.keys(request, start, start + n)
        # Blocks left outside a sliding window are null (id 0): nothing to load into them.
        # Without any (the common case) everything below is slices, not per-block loops.
        wanted: Any = range(n)
        if flat is None or 0 in flat:
            gpu = ([flat[i * epb:(i + 1) * epb] for i in range(n)] if flat is not None
                   else [self.keymap.gpu_ids(block_ids, start + i) for i in range(n)])
            wanted = [i for i in range(n) if 0 not in gpu[i]]
            keys = [keys[i] for i in wanted]
            gpu = [gpu[i] for i in wanted]
        plan = self.manager.prepare_load(keys)
        sync = t.sync_load
        # the step computes the prompt's last token only: it waits for the whole load
        whole = sync and t.lookup_start + num_external_tokens == request.num_tokens - 1
        got = len(plan.keys)
        loaded = wanted[:got]
        if isinstance(wanted, range):
            gpu_ids, unloaded = flat[:got * epb], flat[got * epb:] + partial
        else:
            gpu_ids = [b for ids in gpu[:got] for b in ids]
            unloaded = [b for ids in gpu[got:] for b in ids] + partial
        job_id = self.ledger.next_id()
        self._step_loads.append(self.ledger.add(LoadJob(
            job_id=job_id, req_id=t.req_id, keys=tuple(plan.keys),
            cpu_slots=tuple(plan.cpu_slots), gpu_ids=tuple(gpu_ids),
            unloaded_gpu_ids=tuple(unloaded), sync=sync, whole=whole,
        )))
        if sync:  # a worker in this thread starts it now (fast_path)
            self.fast.submit(self._step_loads[-1], tuple(self.stores.reading(gpu_ids)))
        self.fast.drop()  # used by the load submitted ahead, if its slots matched
        t.load_job = job_id
        t.load_first_index = start
        if self._tl.enabled:
            self._tl.mark("sched", "plan_load", req=t.req_id, job=job_id, blocks=len(plan.keys),
                          sync=sync)
        t.hit_tokens = self._hit_sources(plan.sources, len(plan.keys), num_external_tokens)
        self._stats.add("unloadable_tokens", len(unloaded) * bs)
        t.next_store = max(t.next_store, start + (loaded[-1] + 1 if loaded else 0))
        if self._describe:
            known = self._events.metadata  # a lookup refreshes a known block's entry: cheaper
            promoted = plan.sources or (Medium.CPU,) * len(plan.keys)
            for i, key, source in zip(loaded, plan.keys, promoted):  # than remembering
                if source is not Medium.CPU or known(key) is None:
                    self._remember(request, start + i, key)

    def _hit_sources(self, sources: tuple[Medium, ...], blocks: int,
                     num_external_tokens: int) -> dict[str, int]:
        """Tokens of a planned load per tier it came from (``LoadPlan.sources``), counted,
        adding up to ``num_external_tokens`` as vLLM checks (a whole tail's last token is
        computed, not loaded)."""
        bt, per = self.settings.block_tokens, self.keymap.per_block
        if sources:
            disk = sum(1 for m in sources if m is Medium.DISK)
            remote = sum(1 for m in sources if m is Medium.REMOTE)
        else:
            disk = remote = 0
        hit = {"CPU": (blocks - disk - remote) * bt // per, "DISK": disk * bt // per}
        self._stats.add("hit_tokens_cpu", hit["CPU"])
        self._stats.add("hit_tokens_disk", hit["DISK"])
        if remote:
            hit["REMOTE"] = remote * bt // per
            self._stats.add("hit_tokens_remote", hit["REMOTE"])
        over = sum(hit.values()) - num_external_tokens
        if over > 0:
            last = sources[-1].value if sources else "CPU"
            hit[last] -= over
        return hit

    def hit_sources(self, request: Any) -> dict[str, int]:
        t = self.tracks.get(request.request_id)
        return dict(t.hit_tokens) if t is not None else {}

    # ------------------------------------------------------------------ per step
    def build_meta(self, so: Any) -> KVTierConnectorMetadata:
        began = time.perf_counter() if self._tl.enabled else 0.0
        self.fast.drop()
        written = self.stores.written_blocks(so, self._step_loads)
        flush = self.stores.reading(written)
        stores = []
        for req_id in self._take_due():  # blocks earlier steps completed (preempted: none)
            t = self.tracks.get(req_id)
            if t is None:
                continue
            if self.stores.first_token_pending(t):
                self._store_due.append(req_id)  # after its first token is out
                continue
            last = t.finished and t.store_due  # its last store: then its chain is ranked
            t.store_due = False
            job = self.stores.plan(t, self.kv_cache_manager)
            if job is not None:
                stores.append(job)
            if last:
                self._rank_chain(t)
            self._drop_if_done(t)
        bt, per_block = self.settings.block_tokens, self.keymap.per_block
        for req_id, num_scheduled in so.num_scheduled_tokens.items():
            t = self.tracks.get(req_id)
            if t is None or t.params.skip_store:
                continue
            # no block of it completes in this step (most decode steps): first the bound that
            # ``store_stop`` can pass ``next_store`` only at, two attribute reads per request
            if t.request.num_computed_tokens + num_scheduled < (t.next_store // per_block + 1) * bt:
                continue
            if self.stores.store_stop(t, num_scheduled) <= t.next_store:
                continue
            if not self.late_stores:
                job = self.stores.plan(t, self.kv_cache_manager, num_scheduled)
                if job is not None:
                    stores.append(job)
            elif not t.store_due:
                t.store_due = True
                self._store_due.append(req_id)
        self._take_background()
        saturated = self._saturated(len(so.num_scheduled_tokens))
        background, self._step_background = self._step_background, []
        self._step_sync_bytes = 0
        if self._tl.enabled and (self._step_loads or stores or background):
            self._tl.mark("sched", "build_meta", loads=[j.job_id for j in self._step_loads],
                          stores=len(stores), background=len(background), ms=ms_since(began))
        meta = KVTierConnectorMetadata(
            loads=self._step_loads, stores=stores, background=background, flush=tuple(flush),
            watch=tuple(self._step_watch),
            step_tokens=int(getattr(so, "total_num_scheduled_tokens", 0) or 0),
            untaint=tuple(self._step_untaint),
            engine_saturated=saturated,
        )
        self._step_loads, self._step_watch = [], []
        self._step_untaint = []
        return meta

    def _saturated(self, running: int) -> bool:
        """Whether the engine is saturated: in this step or one of the last
        ``SATURATION_HOLD_STEPS`` vLLM left a request it looked up waiting (no room for it),
        or ran as many requests as it may. Between such steps a saturated engine spends its
        token budget on running requests and looks nothing up, hence the hold."""
        cap = self.settings.max_num_seqs
        if self._step_unadmitted or (cap and running >= cap):
            self._step_unadmitted.clear()
            self._saturated_steps = SATURATION_HOLD_STEPS
        elif self._saturated_steps:
            self._saturated_steps -= 1
        if self._saturated_steps:
            self._stats.add("saturated_steps", 1)  # vLLM's "KV Transfer metrics" line
        return self._saturated_steps > 0

    def _take_due(self) -> list[str]:
        """The requests whose completed blocks are planned in this step: every due one each
        ``store_every_steps`` steps, in between only those whose store cannot wait: a
        finished request's (vLLM holds its blocks until the store is done) and a prompt's
        (a fresh request is the first that vLLM preempts, freeing its blocks). What waits is
        the decode trickle, a block per request every ``block_tokens`` steps: a store copy
        costs the engine thread a fixed amount of CUDA calls whatever its size."""
        self._steps_since_stores += 1
        if self._steps_since_stores >= self.settings.store_every_steps:
            self._steps_since_stores = 0
            due, self._store_due = self._store_due, []
            return due
        now, wait = [], []
        for req_id in self._store_due:
            t = self.tracks.get(req_id)
            (wait if t is not None and self.stores.can_wait(t) else now).append(req_id)
        self._store_due = wait
        return now

    def _take_background(self) -> None:
        """Turn the manager's queued moves (demotions, deletions) into jobs for the workers."""
        for bg in self.manager.take_background_transfers():
            self._step_background.append(self.ledger.add(BackgroundJob(self.ledger.next_id(), bg)))

    def on_worker_output(self, meta: Any) -> None:
        if not isinstance(meta, KVTierWorkerMetadata):
            return
        for medium, nbytes, seconds in meta.load_hops:  # the cost model learns real loads
            self.manager.record_load(Medium(medium), nbytes, seconds)
        for tokens, seconds in meta.forwards:  # ... and what recomputing costs here
            per_token = self._recompute.add(tokens, seconds)
            if per_token is not None:
                self.manager.measured_recompute(per_token, self.settings.block_tokens,
                                                self.settings.block_bytes)
        for reports in self.ledger.record(meta):
            self.settler.settle(reports)
        self._step_untaint.extend(meta.tainted)  # seen, with vLLM's rewind (load_taint)
        self._take_background()  # settling may plan demotions: they count as pending work

    def on_failed_recving(self, req_ids: Iterable[str]) -> None:
        """Requests whose asynchronous load failed on some worker (reported by request:
        ``settings.fails_per_request``): vLLM restarts each from zero computed tokens, its
        blocks freed, and asks for a hit again. It gets none: the request recomputes what
        its local prefix cache does not hold, so a load that keeps failing (a CPU -> GPU
        copy that errors every time) is never retried in a loop."""
        for req_id in req_ids:
            t = self.tracks.get(req_id)
            if t is not None and not t.load_failed:
                t.load_failed = True
                self._stats.add("failed_load_requests", 1)
                log.warning("kvtier: the load of %s failed: vLLM recomputes it", req_id)

    def request_finished(self, request: Any) -> bool:
        """True: vLLM keeps the blocks until workers report the request's stores done."""
        t = self.tracks.get(request.request_id)
        if t is None:
            return False
        t.finished = True
        if t.store_due and self.kv_cache_manager is not None \
                and self.stores.store_stop(t) <= t.next_store:
            t.store_due = False  # nothing new to store: free the blocks now
        if not t.store_due:  # else once its last store is planned (build_meta)
            self._rank_chain(t)
        if t.store_jobs or t.store_due:
            self._step_watch.append(t.req_id)
            return True
        self._drop_if_done(t)
        return False

    def _rank_chain(self, t: RequestTrack) -> None:
        """Rank finished ``t``'s chain in the CPU tier's eviction order head-most-recent, as
        a whole (prompt, hits and decoded blocks went in at different steps): evictions take
        a finished chain from its tail. Called once its last store is planned: a store puts
        its blocks in the order as most recent, and one planned after the ranking would
        outrank the chain's head."""
        if t.next_store > 0:
            self.manager.touch(self.keymap.keys(t.request, 0, t.next_store)[::-1])

    def has_delayed_frees(self) -> bool:
        return any(t.finished and (t.store_jobs or t.store_due) for t in self.tracks.values())

    # ------------------------------------------------------------------ reporting
    def has_pending_work(self) -> bool:
        return bool(len(self.ledger) or self._step_loads
                    or self._step_watch or self._step_background
                    or self._store_due or self._step_untaint)

    def take_events(self) -> Iterable[Any]:
        events = list(self.manager.take_events())
        self.observability.publish(events)
        return self._events.convert(events) if self.settings.vllm_kv_events else []

    def shutdown(self) -> None:
        self.observability.close()
        if self.remote is not None:
            self.remote.close()
            self.remote.store.close()
        if self.host is not None:
            self.host.close()

    def take_stats(self) -> KVTierStats | None:
        return self._stats.take()


def claim(hits: int, per: int, block_tokens: int, room: int, block_bytes: int,
          whole_max_bytes: float) -> tuple[int, int]:
    """(kvtier blocks to load, tokens to report to vLLM) for a run of ``hits`` kvtier blocks
    (``per`` per token block) when vLLM may take ``room`` more tokens before the last one.

    vLLM computes at least the prompt's last token. A hit that reaches it is reported one
    token short and its last block is still loaded whole (the forward then rewrites that one
    token's KV, ordered after the copy): the step computes one token, a batch vLLM runs as one
    full CUDA graph. A hit cut at the block before would leave a block of tokens to a
    piecewise forward, whose host time per layer exceeds a small hit's whole copy. Above
    ``whole_max_bytes`` (from ``whole_tail_layer_bytes`` per layer, a
    ``kv_connector_extra_config`` key) the cut is at the block before instead, which lets the
    forward's layers follow a long copy layer by layer (:mod:`..worker.layer_fences`). The
    default is where the two meet (figures: docs/design-measurements.md).
    """
    tokens = hits // per * block_tokens
    if tokens <= room:
        return hits, tokens
    if hits * block_bytes <= whole_max_bytes:
        return hits, room
    hits -= per * -(-(tokens - room) // block_tokens)
    return hits, hits // per * block_tokens
