"""Settling finished jobs on the scheduler side: the manager's prepare calls get their complete.

A mixin of :class:`~kvtier.connectors.vllm.scheduler.side.SchedulerSide` (its state: ``manager``,
``ledger``, ``tracks``, ``_parked``, ``_promoting``, ``_promotions``, ``_sources``,
``_step_forget``, ``_stats``, ``_tl``). A load that joined another load's disk promotion is
parked until that load settled (the manager's ``prepare_shared_load`` contract); a settled
failed load rewinds the request's store cursor, since vLLM recomputes from its first failed
block.
"""

from __future__ import annotations

from kvtier.connectors.vllm.scheduler.ledger import Job


class JobSettling:
    def _unsettled(self, job_id: int) -> bool:
        return job_id in self.ledger or job_id in self._parked

    def _settle(self, job_id: int, job: Job) -> None:
        if job.kind == "load":
            if any(self._unsettled(d) for d in job.after):
                self._parked[job_id] = job
                return
            self._settle_load(job_id, job)
            progress = True
            while progress:  # a load may both promote some keys and join others: chains
                progress = False
                for parked_id in sorted(self._parked):
                    parked = self._parked[parked_id]
                    if not any(self._unsettled(d) for d in parked.after):
                        del self._parked[parked_id]
                        self._settle_load(parked_id, parked)
                        progress = True
        elif job.kind == "store":
            self.manager.complete_store(job.keys, success=job.errors == 0)
            if job.errors:
                self._stats.add("failed_store_jobs", 1)
            for b in job.gpu_ids:
                jobs = self._sources.get(b)
                if jobs is not None:
                    jobs.discard(job_id)
                    if not jobs:
                        del self._sources[b]
            t = self.tracks.get(job.req_id)
            if t is not None:
                t.store_jobs.discard(job_id)
                self._drop_if_done(t)
        else:
            self.manager.complete_background(job.transfer_id, success=job.errors == 0)

    def _settle_load(self, job_id: int, job: Job) -> None:
        failed, transient = set(job.failed), job.transient
        sample = self._promotions.settled(job_id, ok=not failed and job.errors == 0)
        if sample is not None:  # what the request waited for its promotion: the cost model
            self.manager.record_promotion(*sample)
        self.manager.complete_load(job.keys,
                                   failed=[k for k in job.keys if k in failed] if failed else (),
                                   transient=[k for k in job.keys if k in transient]
                                   if transient else ())
        if failed:
            self._stats.add("failed_load_blocks", len(failed))
        if transient:
            self._stats.add("transient_failed_load_blocks", len(transient))
        if any(job.from_disk):
            for key, from_disk in zip(job.keys, job.from_disk):
                if from_disk and self._promoting.get(key) == job_id:
                    del self._promoting[key]
            self._step_forget.append(job_id)
        t = self.tracks.get(job.req_id)
        if t is not None and t.load_job == job_id:
            t.load_job = None
            if failed:  # vLLM recomputes from the first failed block on: store those again
                first = min(i for i, k in enumerate(job.keys) if k in failed)
                t.next_store = min(t.next_store, t.load_first_index + first)
            self._drop_if_done(t)
        if self._tl.enabled:
            self._tl.mark("sched", "load_settled", req=job.req_id, job=job_id,
                          failed=len(failed))
