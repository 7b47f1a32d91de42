"""Submitting the worker's copy jobs and taking their results (a mixin of
:class:`~kvtier.connectors.vllm.worker.side.WorkerSide`, whose state it uses: ``settings``,
``runtime``, ``asleep``, ``_running``, ``_stores_of``, ``_deferred``, ``_promotions``,
``_taint``, ``_done``, ``_errors``, ``_failed``, ``_transient``, ``_load_errors``,
``_load_hops``, ``_recving``, ``_tl``).

A refused submission fails its job visibly (a result with the error, as if it had run); a
store refused for a tainted or sleeping request fails without touching the CPU tier; a load's
result names the keys that failed (transiently or not) and the engine blocks that must not be
trusted, and what its hops measured feeds the scheduler's cost model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvtier.connectors.vllm.metadata import LoadJob, StoreJob
from kvtier.manager.specs import BlockKey, LoadStoreSpec, Medium
from kvtier.runtime.load_job import (failed_load_keys, gpu_untrusted, load_hops, measured_hops,
                                     transient_load_keys)
from kvtier.runtime.worker import WorkerRuntime
from kvtier.transfer import JobResult

# the worker half's logger: operators filter on it, whichever module logs
log = logging.getLogger("kvtier.connectors.vllm.worker.side")


@dataclass
class Running:
    kind: str  # "load" | "store" | "background"
    req_id: str | None = None
    load: LoadJob | None = None
    excluded: frozenset[BlockKey] = frozenset()  # joined keys whose promotion failed


class WorkerJobs:
    def _submit(self, fn, job_id: int, first_hop: tuple[Medium, Medium] = (Medium.GPU, Medium.CPU)
                ) -> None:
        """Submit; a refused submission (bad addresses, closed engine) fails the job visibly."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported to the scheduler as a job error
            log.error("kvtier: job %d could not be submitted: %s", job_id, exc)
            self._on_result(JobResult(job_id, False, str(exc), (), 0, 0.0, first_hop))

    def _submit_stores(self, stores: tuple[StoreJob, ...] | list[StoreJob], *,
                       this_step: bool) -> None:
        """Submit the step's stores whose ``this_step`` is ``this_step`` (``bind``: blocks of
        earlier steps; ``wait_for_save``: blocks this forward computes)."""
        jobs = [job for job in stores if job.this_step == this_step]
        if jobs:
            rt = self._rt()
            for job in jobs:
                self._submit_store(rt, job)

    def _submit_store(self, rt: WorkerRuntime, job: StoreJob) -> None:
        self._running[job.job_id] = Running("store", job.req_id)
        self._stores_of.setdefault(job.req_id, set()).add(job.job_id)
        refused = ("KV caches unregistered (sleep)" if self.asleep  # pages suspended
                   else "computed over a failed synchronous load (load_taint)"
                   if self._taint.refuses(job.req_id) else None)
        if refused:  # the store fails: a future miss, never untrusted bytes in the CPU tier
            self._on_result(JobResult(job.job_id, False, refused, (), 0, 0.0,
                                      (Medium.GPU, Medium.CPU)))
            return
        self._submit(lambda: rt.engine.submit(LoadStoreSpec.gpu(job.gpu_ids),
                                              LoadStoreSpec.cpu(job.cpu_slots),
                                              job_id=job.job_id), job.job_id)

    def _submit_ready_loads(self) -> None:
        """Submit deferred loads whose promoting loads finished here (in arrival order)."""
        waiting: list[LoadJob] = []
        for job in self._deferred:
            if all(d in self._promotions for d in job.after):
                self._submit_load(job)
            else:
                waiting.append(job)
        self._deferred = waiting

    def _submit_load(self, job: LoadJob) -> None:
        k = self.settings.engine_blocks_per_block
        excluded: set[BlockKey] = set()
        for dep in job.after:
            excluded |= self._promotions.get(dep, frozenset())
        if excluded:
            excluded &= {key for key, j in zip(job.keys, job.joined or ()) if j}
        self._running[job.job_id] = Running("load", job.req_id, job, frozenset(excluded))
        hops = load_hops(job.keys, job.cpu_slots, job.from_disk, job.gpu_ids, k, excluded,
                         from_remote=job.from_remote, whole=job.whole)
        if not hops:  # nothing left to move (all truncated or all joined promotions failed)
            self._on_result(JobResult(job.job_id, True, None, (), 0, 0.0,
                                      (Medium.CPU, Medium.GPU)))
            return
        if self.asleep:  # the GPU pages are suspended: recompute (reported as load errors)
            first = hops[0][0].medium, hops[0][1].medium
            self._on_result(JobResult(job.job_id, False, "KV caches unregistered (sleep)", (),
                                      0, 0.0, first))  # a promotion never ran: keys failed
            return
        rt = self._rt()
        self._submit(lambda: rt.engine.submit_chain(hops, job_id=job.job_id), job.job_id,
                     (hops[0][0].medium, hops[0][1].medium))

    # ------------------------------------------------------------------ results
    def _poll(self) -> None:
        if self.runtime is None:
            return
        results = self.runtime.poll()
        for result in results:
            self._on_result(result)
        if results and self._deferred:
            self._submit_ready_loads()

    def _on_result(self, r: JobResult) -> None:
        running = self._running.pop(r.job_id, None)
        if running is None:
            log.warning("kvtier: result for unknown job %d ignored", r.job_id)
            return
        self._done[r.job_id] = 1
        if running.kind == "load":
            self._on_load(r, running)
        elif running.kind == "store":
            if not r.ok:
                self._errors[r.job_id] = 1
                log.warning("kvtier: store job %d failed: %s", r.job_id, r.error)
            jobs = self._stores_of.get(running.req_id)
            if jobs is not None:
                jobs.discard(r.job_id)
                if not jobs:
                    del self._stores_of[running.req_id]
        else:
            if not r.ok:
                self._errors[r.job_id] = 1

    def _on_load(self, r: JobResult, running: Running) -> None:
        job = running.load
        assert job is not None
        disk_keys = ({key for key, d in zip(job.keys, job.from_disk) if d}
                     if any(job.from_disk) else set())
        remote_keys = ({key for key, d in zip(job.keys, job.from_remote) if d}
                       if any(job.from_remote) else set())
        failed = failed_load_keys(r, disk_keys, running.excluded, remote_keys)
        bad_gpu: set[int] = set(job.unloaded_gpu_ids)
        if gpu_untrusted(r):
            log.warning("kvtier: load job %d failed: %s", r.job_id, r.error)
            bad_gpu.update(job.gpu_ids)  # whatever reached the GPU is not trusted
        if failed:
            k = self.settings.engine_blocks_per_block
            for i, key in enumerate(job.keys):
                if key in failed:
                    bad_gpu.update(job.gpu_ids[i * k:(i + 1) * k])
        if failed:
            self._failed[r.job_id] = tuple(k for k in job.keys if k in failed)
            if transient := transient_load_keys(r, failed):
                self._transient[r.job_id] = tuple(k for k in job.keys if k in transient)
        if disk_keys:  # loads that joined its promotions need to know what it could not read
            self._promotions[r.job_id] = frozenset(failed & disk_keys)
        self._load_errors |= bad_gpu
        if bad_gpu and job.sync:  # its forward ran on them (load_taint)
            self._taint.taint(job.req_id)
        # what a load measured teaches the scheduler's cost model
        self._load_hops.extend((src.value, n, sec) for src, n, sec in measured_hops(r))
        if self._tl.enabled:
            self._tl.mark("worker", "load_done", job=r.job_id, req=job.req_id, sync=job.sync,
                          hops=[(f"{a.value}->{b.value}", n, round(sec * 1e3, 3))
                                for (a, b), n, sec in r.hops])
        if not job.sync:  # a synchronous load's request is running already
            self._recving.add(job.req_id)
