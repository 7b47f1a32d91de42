"""The worker's jobs in flight: submitting its copies, reading their results, reporting them.

:class:`WorkerJobs` is the worker side's collaborator that owns every job a worker submitted
and has not reported yet: loads (one CPU -> GPU copy each, read through
:mod:`kvtier.transfer.jobs`), stores, background moves (promotions into CPU memory among
them), and this step's report for the scheduler. A refused submission fails its job visibly (a
result with the error, as if it had run); a store refused for a tainted or sleeping request
fails without touching the CPU tier; a load's result names the engine blocks that must not be
trusted, a promotion's the keys it could not read (transiently or not), and what both
measured feeds the scheduler's cost model. Engine blocks of a failed load are reported as load errors, or, with
several KV cache groups (``settings.fails_per_request``), the asynchronous load's request
as a failed receive (:mod:`..compat.load_failures`): vLLM cannot map such blocks back.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Iterable

from kvtier.connectors.vllm.metadata import (BackgroundJob, HandedJob, KVTierWorkerMetadata,
                                             LoadJob, StoreJob)
from kvtier.connectors.vllm.settings import ConnectorSettings
from kvtier.connectors.vllm.worker.load_taint import LoadTaint
from kvtier.manager.specs import BlockKey, LoadStoreSpec, Medium
from kvtier.observe.timeline import timeline
from kvtier.transfer.jobs import (gpu_untrusted, is_promotion, measured_hops, promotion_outcome,
                                  untrusted_gpu_ids)
from kvtier.runtime.worker import WorkerRuntime
from kvtier.transfer import JobResult

# the worker half's logger: operators filter on it, whichever module logs
log = logging.getLogger("kvtier.connectors.vllm.worker.side")

ASLEEP_STORE = "KV caches unregistered (sleep)"


class WorkerJobs:
    def __init__(self, settings: ConnectorSettings, taint: LoadTaint) -> None:
        self._per_block = settings.engine_blocks_per_block
        self._per_request = settings.fails_per_request  # a failed load: its request, no ids
        self._taint = taint  # refuses stores of tainted requests; taints failed sync loads
        self._runtime: WorkerRuntime | None = None
        self.asleep = False  # sleep mode: every GPU copy fails until restored
        self.running: dict[int, HandedJob] = {}  # submitted here, result not read yet
        self._stores_of: dict[str, set[int]] = {}  # request -> its stores in flight
        self._recving: set[str] = set()  # requests whose asynchronous load finished
        self._load_errors: set[int] = set()  # engine blocks to report as not loaded
        self._failed_recving: dict[str, set[int]] = {}  # per request: its blocks not loaded
        self._done: dict[int, int] = {}
        self._failed: dict[int, tuple[BlockKey, ...]] = {}
        self._transient: dict[int, tuple[BlockKey, ...]] = {}  # of _failed: EIO, EMFILE ...
        self._errors: dict[int, int] = {}
        self._load_hops: list[tuple[str, int, float]] = []
        self._members: dict[int, tuple[int, ...]] = {}  # a step's one store copy -> its jobs
        self._copy_of: dict[int, int] = {}  # a store job -> the copy that carries it
        self._tl = timeline()

    def bind_runtime(self, runtime: WorkerRuntime | None) -> None:
        """The runtime jobs are submitted to (None: closed; polling does nothing)."""
        self._runtime = runtime

    def _rt(self) -> WorkerRuntime:
        if self._runtime is None:
            raise RuntimeError("kvtier: register_kv_caches was not called before transfers")
        return self._runtime

    # ------------------------------------------------------------------ submitting
    def _submit(self, fn: Callable[[], object], job_id: int,
                first_hop: tuple[Medium, Medium] = (Medium.GPU, Medium.CPU)) -> None:
        """Submit; a refused submission (bad addresses, closed engine) fails the job visibly."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported to the scheduler as a job error
            log.error("kvtier: job %d could not be submitted: %s", job_id, exc)
            self._on_result(JobResult(job_id, False, str(exc), (), 0, 0.0, first_hop))

    def submit_stores(self, stores: Iterable[StoreJob], *, this_step: bool) -> None:
        """Submit the step's stores whose ``this_step`` is ``this_step`` (``bind``: blocks of
        earlier steps; ``wait_for_save``: blocks this forward computes), all of them as one
        GPU -> CPU copy: a store's host cost is mostly fixed per copy (CUDA calls that cost 2-5x
        more while the forward runs), and a saturated engine completes blocks of several
        requests at every step. Each job still reports on its own; the copy's result is each
        of theirs."""
        jobs = [job for job in stores if job.this_step == this_step]
        if not jobs:
            return
        rt = self._rt()
        runnable = [job for job in jobs if self._admit_store(job)]
        if not runnable:
            return
        engine_id = runnable[0].job_id
        if len(runnable) > 1:
            self._members[engine_id] = tuple(job.job_id for job in runnable)
            for job in runnable[1:]:
                self._copy_of[job.job_id] = engine_id
        src = LoadStoreSpec.gpu([b for job in runnable for b in job.gpu_ids])
        dst = LoadStoreSpec.cpu([slot for job in runnable for slot in job.cpu_slots])
        self._submit(lambda: rt.engine.submit(src, dst, job_id=engine_id), engine_id)

    def _admit_store(self, job: StoreJob) -> bool:
        """Track ``job``; False when it is refused (it fails at once: a future miss, never
        untrusted bytes in the CPU tier)."""
        self.running[job.job_id] = job
        self._stores_of.setdefault(job.req_id, set()).add(job.job_id)
        refused = (ASLEEP_STORE if self.asleep  # pages suspended
                   else "computed over a failed synchronous load (load_taint)"
                   if self._taint.refuses(job.req_id) else None)
        if refused:
            self._on_result(JobResult(job.job_id, False, refused, (), 0, 0.0,
                                      (Medium.GPU, Medium.CPU)))
        return refused is None

    def submit_background(self, jobs: Iterable[BackgroundJob]) -> None:
        """The manager's own moves (promotions, demotions, deletions, shared-tier writes)."""
        rt = self._rt()
        for bg in jobs:
            self.running[bg.job_id] = bg
            self._submit(lambda bg=bg: rt.engine.submit(bg.src, bg.dst, job_id=bg.job_id),
                         bg.job_id, (bg.src.medium, bg.dst.medium))

    def submit_load(self, job: LoadJob) -> None:
        """One CPU -> GPU copy (before the forward for a synchronous load, after otherwise)."""
        self.running[job.job_id] = job
        if not job.cpu_slots:  # nothing left to move (the plan came out empty)
            self._on_result(JobResult(job.job_id, True, None, (), 0, 0.0,
                                      (Medium.CPU, Medium.GPU)))
            return
        if self.asleep:  # the GPU pages are suspended: recompute (reported as load errors)
            self._on_result(JobResult(job.job_id, False, ASLEEP_STORE, (), 0, 0.0,
                                      (Medium.CPU, Medium.GPU)))
            return
        rt = self._rt()
        self._submit(lambda: rt.engine.submit(job.src, job.dst, job_id=job.job_id), job.job_id,
                     (Medium.CPU, Medium.GPU))

    def quiesce(self, reason: str) -> None:
        """Wait (on the host) for every GPU copy submitted: none may touch the GPU after this
        (sleep mode). ``reason``: why, for the log."""
        if self._runtime is None:
            return
        self.poll()
        gpu_jobs = self.copies_of(j for j, r in self.running.items()
                                  if not isinstance(r, BackgroundJob))
        for result in self._runtime.engine.wait(gpu_jobs) if gpu_jobs else ():
            self._on_result(result)
        log.debug("kvtier: GPU copies quiesced: %s", reason)

    # ------------------------------------------------------------------ state
    def stores_in_flight(self, job_ids: Iterable[int]) -> list[int]:
        """The engine's ids of the copies carrying those of ``job_ids`` that are stores still
        in flight here (what to fence)."""
        return self.copies_of(j for j in job_ids if isinstance(self.running.get(j), StoreJob))

    def copies_of(self, job_ids: Iterable[int]) -> list[int]:
        """The engine's job ids of the copies carrying ``job_ids`` (a store submitted with
        others rides its step's one copy), each once."""
        return list(dict.fromkeys(self._copy_of.get(j, j) for j in job_ids))

    def has_stores(self, req_id: str) -> bool:
        return bool(self._stores_of.get(req_id))

    def take_recving(self) -> set[str]:
        out, self._recving = self._recving, set()
        return out

    def add_load_errors(self, gpu_ids: Iterable[int]) -> None:
        self._load_errors.update(gpu_ids)

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def take_failed_recving(self) -> dict[str, set[int]]:
        """Requests whose asynchronous load failed here (``fails_per_request``), each with
        the engine blocks it did not load; their requests are in ``take_recving`` too."""
        out, self._failed_recving = self._failed_recving, {}
        return out

    def take_report(self) -> KVTierWorkerMetadata | None:
        """The step's per-job report (None: nothing to say), counting on from empty."""
        if not (self._done or self._failed or self._errors or self._load_hops):
            return None
        out = KVTierWorkerMetadata(self._done, self._failed, self._errors,
                                   tuple(self._load_hops), transient=self._transient)
        self._done, self._failed, self._errors, self._load_hops = {}, {}, {}, []
        self._transient = {}
        return out

    # ------------------------------------------------------------------ results
    def poll(self) -> None:
        if self._runtime is None:
            return
        for result in self._runtime.poll():
            self._on_result(result)

    def _on_result(self, r: JobResult) -> None:
        members = self._members.pop(r.job_id, None)
        if members is not None:  # a step's stores copied together: each gets the result
            for job_id in members:
                self._copy_of.pop(job_id, None)
                self._on_job_result(replace(r, job_id=job_id))
            return
        self._on_job_result(r)

    def _on_job_result(self, r: JobResult) -> None:
        running = self.running.pop(r.job_id, None)
        if running is None:
            log.warning("kvtier: result for unknown job %d ignored", r.job_id)
            return
        self._done[r.job_id] = 1
        if isinstance(running, LoadJob):
            self._on_load(r, running)
        elif isinstance(running, StoreJob):
            if not r.ok:
                self._errors[r.job_id] = 1
                log.warning("kvtier: store job %d failed: %s", r.job_id, r.error)
            jobs = self._stores_of.get(running.req_id)
            if jobs is not None:
                jobs.discard(r.job_id)
                if not jobs:
                    del self._stores_of[running.req_id]
        else:
            if is_promotion(running.src.medium, running.dst.medium):
                self._on_promotion(r, running.src.keys)
            elif not r.ok:
                self._errors[r.job_id] = 1

    def _on_promotion(self, r: JobResult, keys: tuple[BlockKey, ...]) -> None:
        """A promotion's keys that could not be read fail (the manager forgets them); a read
        that raised is an error too, so nothing of it is published."""
        out = promotion_outcome(r, keys)
        if r.error is not None:
            self._errors[r.job_id] = 1
            log.warning("kvtier: promotion job %d failed: %s", r.job_id, r.error)
        if out.failed:
            self._failed[r.job_id] = out.failed
            if out.transient:
                self._transient[r.job_id] = out.transient
        self._load_hops.extend((src.value, n, sec) for src, n, sec in out.measured)

    def _on_load(self, r: JobResult, job: LoadJob) -> None:
        if gpu_untrusted(r):
            log.warning("kvtier: load job %d failed: %s", r.job_id, r.error)
        untrusted = untrusted_gpu_ids(r, job.gpu_ids, job.unloaded_gpu_ids)
        if untrusted and self._per_request and not job.sync:
            self._failed_recving.setdefault(job.req_id, set()).update(untrusted)
        else:  # a synchronous load never is one (async_loads_only): vLLM fails loudly
            self._load_errors |= untrusted
        if untrusted and job.sync:  # its forward ran on them (load_taint)
            self._taint.taint(job.req_id)
        # what a load measured teaches the scheduler's cost model
        self._load_hops.extend((src.value, n, sec) for src, n, sec in measured_hops(r))
        if self._tl.enabled:
            self._tl.mark("worker", "load_done", job=r.job_id, req=job.req_id, sync=job.sync,
                          bytes=r.bytes, copy_ms=round(r.seconds * 1e3, 3))
        if not job.sync:  # a synchronous load's request is running already
            self._recving.add(job.req_id)
