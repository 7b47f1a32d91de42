"""The worker half: owns CPU pool, disk store and transfer engine; executes, decides nothing.

Per step (vLLM's model runner calls these in this order):

0. (``submit_ahead``, from the scheduler in this same thread, :mod:`..fast_path`): a
   synchronous load is submitted when planned, before vLLM prepares the step.
1. ``handle_preemptions(meta)``: before the forward, fence the store jobs the scheduler
   flagged (their source blocks are rewritten this step): on CUDA the forward's stream waits
   for those copies on the GPU; elsewhere the host waits. Then the step's synchronous loads
   not submitted yet are: it is the step's first hook (the copy is ordered after the device
   work enqueued so far, as at ``start_load``; it needs only its pages, the request's now).
2. ``bind(meta)``: the step's stores and the manager's background moves (demotions,
   deletions) are submitted here, every step, forward or not. A store copies blocks that
   earlier steps computed (the scheduler plans them one step late), so it is ordered on the
   GPU after the work enqueued so far and its device -> host copy runs beside this step's
   forward, not between the last forward and its sampled tokens' copy to the host. The
   step's stores go as one copy (:meth:`WorkerJobs.submit_stores`).
3. ``start_load``: submit this step's other loads (before the forward for a synchronous
   load, after it otherwise) and fence the synchronous ones: the forward reading their blocks
   is ordered after the copy on the GPU, per layer when vLLM runs the per-layer hooks
   (:mod:`layer_fences`), else whole. Every load is one CPU -> GPU copy (blocks held below
   the CPU tier were promoted into it by background moves before the load was planned).
4. ``wait_for_save``: the forward is enqueued: per-layer fences are checked, and stores of
   blocks this very forward computes (sliding-window models, whose windows free blocks
   before a late plan) are submitted, their copy ordered after the forward on the GPU.
5. ``transfer_results``: collect finished jobs; asynchronous loads report their request in
   ``finished_recving`` (and the engine blocks that could not be filled as load errors, in
   the same step; with several KV cache groups the request in ``failed_recving`` instead),
   watched finished requests with no store left in ``finished_sending``.
6. ``build_worker_meta``: per-job reports for the scheduler (done, the keys a promotion
   could not read and which of them failed transiently, errors, and what loads and
   promotions measured for its cost model).

Before the first step: ``register_kv_caches`` builds the runtime with a CPU pool that pins
only its first chunk; the rest is pinned in the background once vLLM's start-up is over
(``start_up_over``), since page-locking holds up vLLM's profiling and CUDA graph capture.

The jobs in flight and their results are a collaborator's own state (:class:`WorkerJobs`);
this class decides when each hook submits, fences and reports.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping

import torch

from kvtier.connectors.vllm.fast_path import WorkerHandoff
from kvtier.connectors.vllm.worker.forward_timer import ForwardTimer
from kvtier.connectors.vllm.worker.kv_view import engine_view
from kvtier.connectors.vllm.worker.layer_fences import LayerFences
from kvtier.connectors.vllm.worker.load_taint import LoadTaint
from kvtier.observe.timeline import timeline
from kvtier.connectors.vllm.worker.jobs import WorkerJobs
from kvtier.tiers.disk.catalog.inventory import register_open_store, unregister_open_store
from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata, KVTierWorkerMetadata, LoadJob
from kvtier.connectors.vllm.settings import ConnectorSettings
from kvtier.connectors.vllm.stats import KVTierStats, WorkerStatsTaker
from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.runtime.worker import WorkerRuntime
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.gpu_view import GpuKvView

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, tp_rank: int,
                 handoff: WorkerHandoff | None = None) -> None:
        self.settings = settings
        self.tp_rank = tp_rank
        self.handoff = handoff or WorkerHandoff()  # the scheduler of this engine, if in-process
        self.runtime: WorkerRuntime | None = None
        self.view: GpuKvView | None = None
        self._watch: set[str] = set()
        self._meta: KVTierConnectorMetadata | None = None
        self._loads_taken = self._saves_taken = True
        self._forward: ForwardTimer | None = None
        self._stats: WorkerStatsTaker | None = None
        self._tl = timeline()
        self._fences = LayerFences(settings.layer_names)
        self._sync_reqs: dict[int, str] = {}  # this step's synchronous loads: job -> request
        self._taint = LoadTaint()
        self.jobs = WorkerJobs(settings, self._taint)  # every job in flight, and the report
        self._ahead: set[int] = set()  # sync loads submitted before start_load
        self.hook_thread: int | None = None  # the thread vLLM runs this worker's hooks on
        self.sleep_addresses: tuple[int, ...] = ()  # KV pages at unregister (compat/sleep.py)
        self._pin_wait_s = 0.0  # tiers.cpu.pin_wait_s, once registered (start_up_over)

    @property
    def asleep(self) -> bool:
        """Sleep mode: no GPU copies between unregister and restore (compat/sleep.py)."""
        return self.jobs.asleep

    @asleep.setter
    def asleep(self, value: bool) -> None:
        self.jobs.asleep = value

    # ------------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        view = engine_view(self.settings, kv_caches)
        self._forward = ForwardTimer(view.device)
        self.view = view  # the engine's pages as kvtier sees them (tests and checks read it)
        geometry = self.settings.geometry(self.tp_rank)
        config = self.settings.rank_config(self.tp_rank)
        replicated = self.settings.replicated  # MLA: rank 0 writes the disk and shared tiers
        # vLLM profiles, warms up and captures its CUDA graphs right after this call: the CPU
        # pool pins beyond its first chunk only once that is over (start_up_over)
        self.runtime = WorkerRuntime.create(
            config, view, geometry, rank=self.tp_rank, world_size=self.settings.world_size,
            rank0_geometry=self.settings.geometry(0) if replicated else None,
            replicated=replicated, rank0_disk=(self.settings.disk_paths() or [None])[0],
            fill="on_start", instance=self.settings.engine_id,
            host_fingerprint=self.settings.geometry(0).fingerprint())
        self.jobs.bind_runtime(self.runtime)
        self._pin_wait_s = config.cpu.pin_wait_s
        if isinstance(self.runtime.store, DiskStore):  # a child's store: LMDB opens it here too
            register_open_store(config.disk.path, self.runtime.store)
        if self.settings.world_size == 1:
            self.handoff.attach(self)
        self._stats = WorkerStatsTaker(self.runtime)
        log.info("kvtier: worker rank %d: %d layers, %s, %d CPU slots%s", self.tp_rank,
                 view.num_layers, geometry.describe(), self.runtime.pool.num_slots,
                 f", disk {config.disk.path}" if config.disk is not None else "")

    def shutdown(self) -> None:
        self.handoff.detach(self)
        rt, self.runtime = self.runtime, None
        self.jobs.bind_runtime(None)
        if rt is None:
            return
        store = rt.store
        try:
            rt.close()
        finally:
            if isinstance(store, DiskStore):
                unregister_open_store(store.root, store)

    def start_up_over(self, why: str) -> None:
        """vLLM's start-up (profiling, warm-up, CUDA graph capture) is over: the CPU pool's
        pinning starts, which would have held up that CUDA work (cpu_pool.py). Called when
        vLLM asks for the handshake metadata, its last call into the worker before it serves,
        and at every step (the first one starts it if nothing did).

        The first of those calls waits up to ``tiers.cpu.pin_wait_s`` for the pinning to
        finish: page-locking while the engine serves holds up the engine's own CUDA calls,
        so the first requests of a fresh server would wait for most of it (seconds for tens
        of GiB) instead of the start-up, which is where vLLM pins its own CPU buffers."""
        rt = self.runtime
        if rt is None or rt.pool.filling:
            return
        pool = rt.pool
        pool.start_filling(why)
        if self._pin_wait_s <= 0 or pool.allocated_bytes >= pool.capacity_bytes:
            return
        t0 = time.monotonic()
        try:
            done = pool.wait_ready(self._pin_wait_s)
        except RuntimeError as exc:  # the pool logged it; its copies fail (recomputed)
            log.error("kvtier: CPU pool allocation failed before serving: %s", exc)
            return
        took = time.monotonic() - t0
        if done:
            log.info("kvtier: CPU pool ready before serving: %.1f GiB %s in %.1f s",
                     pool.capacity_bytes / 2**30, "pinned" if pool.pin else "allocated", took)
        else:
            log.warning("kvtier: CPU pool: %.1f of %.1f GiB pinned after %.1f s "
                        "(tiers.cpu.pin_wait_s); the rest pins while serving, which holds up "
                        "the engine's CUDA calls until it is done",
                        pool.allocated_bytes / 2**30, pool.capacity_bytes / 2**30, took)

    def _rt(self) -> WorkerRuntime:
        if self.runtime is None:
            raise RuntimeError("kvtier: register_kv_caches was not called before transfers")
        return self.runtime

    # ------------------------------------------------------------------ step hooks
    def handle_preemptions(self, meta: Any) -> None:
        self.hook_thread = threading.get_ident()
        if not isinstance(meta, KVTierConnectorMetadata):
            return
        self.start_up_over("first step")
        if meta.flush:
            self.jobs.poll()
            self._fence_stores(meta.flush)
        sync = [job for job in meta.loads if job.sync and job.job_id not in self._ahead]
        self._start_ahead(sync, "early_load")

    def submit_ahead(self, job: LoadJob, flush: tuple[int, ...]) -> None:
        """A synchronous load handed over by the scheduler when it planned it (step 0)."""
        self._fence_stores(flush)
        self._start_ahead([job], "load_ahead")

    def _fence_stores(self, job_ids: Any) -> None:
        ids = self.jobs.stores_in_flight(job_ids)
        if ids:
            self._rt().engine.fence(ids)

    def _start_ahead(self, sync: list[LoadJob], ev: str) -> None:
        """Submit synchronous loads before ``start_load``, which decides how the forward
        waits for them (it knows the forward)."""
        if not sync or self.runtime is None:
            return
        if self._tl.enabled:  # marked before: the copy starts with the first submit
            self._tl.mark("worker", ev, sync=[j.job_id for j in sync])
        for job in sync:
            self.jobs.submit_load(job)
            self._ahead.add(job.job_id)
        if self._tl.enabled:
            self._tl.mark("worker", ev + "_enqueued", prefetches=self._rt().engine.prefetch_counts())

    def prefetch_min_bytes(self) -> int | None:
        """The smallest synchronous CPU hit whose copy may start at the lookup; None: none."""
        if self.runtime is None or self.asleep:
            return None
        return self.runtime.engine.prefetch_min_bytes(Medium.CPU, Medium.GPU)

    def prefetch_load(self, slots: list[int], whole: bool = False) -> bool:
        """The scheduler's lookup found a synchronous CPU hit in these slots (step 0, before
        vLLM allocates its blocks): the copy's first pieces start now
        (:class:`kvtier.transfer.cuda.direct.Prefetch`); its load, submitted ahead, uses them.
        ``whole``: the load will be ``LoadJob.whole``."""
        if self.runtime is None or self.asleep:
            return False
        started = self.runtime.engine.prefetch(LoadStoreSpec.cpu(slots), Medium.GPU, whole)
        if self._tl.enabled:
            self._tl.mark("worker", "prefetch", blocks=len(slots), started=started, whole=whole)
        return started

    def drop_prefetch(self) -> None:
        """An unused prefetch is dropped before its slots could be reassigned."""
        if self.runtime is not None:
            self.runtime.engine.drop_prefetches()

    def bind(self, meta: Any) -> None:
        self.hook_thread = threading.get_ident()
        if not isinstance(meta, KVTierConnectorMetadata):
            raise TypeError(f"kvtier: unexpected connector metadata {type(meta).__name__}")
        self.start_up_over("first step")
        self._meta = meta
        self._loads_taken = self._saves_taken = False
        if self.runtime is not None and self.runtime.switch is not None:
            self.runtime.switch.engine_saturated(meta.engine_saturated)
        self._fences.begin_step()
        if self._forward is not None and not any(j.sync for j in meta.loads):
            self._forward.begin(meta.step_tokens)  # a fenced load would inflate the time
        self._watch.update(meta.watch)
        self._taint.acknowledged(meta.untaint)  # planned after the scheduler saw the failure
        self.jobs.submit_stores(meta.stores, this_step=False)
        if meta.background:
            self.jobs.submit_background(meta.background)

    def start_load(self, per_layer: bool = False) -> None:
        """``per_layer``: this step's forward runs vLLM's per-layer hooks (not a full graph)."""
        meta = self._meta
        if meta is None or self._loads_taken:
            return
        self._loads_taken = True  # the metadata object is shared: never modify it
        if not meta.loads:
            return
        self.jobs.poll()
        sync = [job for job in meta.loads if job.sync]
        early = 0
        for job in sync:  # their forward runs in this step
            if job.job_id in self._ahead:
                self._ahead.discard(job.job_id)
                early += 1
            else:
                self.jobs.submit_load(job)
        self._sync_reqs = {job.job_id: job.req_id for job in sync}
        per_layer = bool(sync) and per_layer and self._fences.arm(
            {job.job_id: job.gpu_ids for job in sync})
        if sync and not per_layer:
            self._rt().engine.fence([job.job_id for job in sync])
        if self._tl.enabled:
            self._tl.mark("worker", "start_load", sync=[j.job_id for j in sync],
                          jobs=[j.job_id for j in meta.loads], per_layer=per_layer,
                          early=early)
        for job in meta.loads:  # the rest wait for no forward: after it
            if not job.sync:
                self.jobs.submit_load(job)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._fences.on_layer(layer_name, lambda ids, l: self._rt().engine.fence_layer(ids, l))

    def _end_layer_fences(self) -> None:
        """After the forward: learn whether vLLM runs the hooks; catch a layer it skipped."""
        seen = self._fences.hooks_seen
        for job_id, gpu_ids in self._fences.end_step(self._rt().engine.fence).items():
            self.jobs.add_load_errors(gpu_ids)
            if job_id in self._sync_reqs:
                self._taint.taint(self._sync_reqs[job_id])
        self._sync_reqs = {}
        if self._fences.hooks_seen and not seen and self._tl.enabled:
            self._tl.mark("worker", "layer_hooks_seen")

    def wait_for_save(self) -> None:
        self.start_load()  # in case vLLM skipped start_load_kv this step
        meta = self._meta
        if meta is None or self._saves_taken:
            return
        self._saves_taken = True
        self._end_layer_fences()
        if self._forward is not None:
            self._forward.end()
        # stores of blocks this forward computes (sliding-window models): ordered after it on
        # the GPU (the copy waits for the submitting stream's position), no host sync
        self.jobs.submit_stores(meta.stores, this_step=True)

    def clear(self) -> None:
        self._meta = None

    def transfer_results(self) -> tuple[set[str], set[str], dict[str, set[int]]]:
        """(finished sending, finished receiving, failed receiving): watched finished
        requests with no store left; requests whose asynchronous load finished, failed or
        not; those whose load failed here (``settings.fails_per_request``), each with the
        engine blocks it did not load."""
        self.jobs.poll()
        recving = self.jobs.take_recving()
        failed = self.jobs.take_failed_recving()
        if self._tl.enabled and recving:
            self._tl.mark("worker", "finished_recving", reqs=sorted(recving),
                          failed=sorted(failed))
        sending = {r for r in self._watch if not self.jobs.has_stores(r)}
        self._watch -= sending
        return sending, recving, failed

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """``transfer_results`` for a caller that takes no failed receives: their engine
        blocks are load errors instead."""
        sending, recving, failed = self.transfer_results()
        for gpu_ids in failed.values():
            self.jobs.add_load_errors(gpu_ids)
        return sending or None, recving or None

    def take_load_errors(self) -> set[int]:
        return self.jobs.take_load_errors()

    def build_worker_meta(self) -> KVTierWorkerMetadata | None:
        forwards = self._forward.take() if self._forward is not None else ()
        tainted = self._taint.take_report()
        meta = self.jobs.take_report() or KVTierWorkerMetadata()
        meta.forwards, meta.tainted = forwards, tainted
        return None if meta.is_empty() else meta

    def take_stats(self) -> KVTierStats | None:
        """Transfer counters since the last call, or None (:class:`WorkerStatsTaker`)."""
        return self._stats.take() if self._stats is not None and self.runtime else None
