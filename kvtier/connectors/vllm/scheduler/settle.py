"""Settling finished jobs on the scheduler side: the manager's prepare calls get their complete.

A load settles ``complete_load`` with the keys that could not be read; a failed load rewinds
its request's store cursor, since vLLM recomputes from its first failed block. A store
settles ``complete_store``; a background move (promotion, demotion, deletion, shared-tier
write) ``complete_background`` with the keys a promotion could not read.
"""

from __future__ import annotations

from kvtier.connectors.vllm.metadata import LoadJob, StoreJob
from kvtier.connectors.vllm.scheduler.ledger import Reports
from kvtier.connectors.vllm.scheduler.requests import RequestTrack, drop_if_done
from kvtier.connectors.vllm.scheduler.store_plan import StorePlanner
from kvtier.connectors.vllm.stats import KVTierStats
from kvtier.manager.abstract import OffloadingManager
from kvtier.observe.timeline import timeline


class JobSettler:
    def __init__(self, manager: OffloadingManager, tracks: dict[str, RequestTrack],
                 stores: StorePlanner, stats: KVTierStats) -> None:
        self._manager = manager
        self._tracks = tracks  # the scheduler's live requests (settling may drop one)
        self._stores = stores
        self._stats = stats
        self._tl = timeline()

    def settle(self, r: Reports) -> None:
        """Every worker reported ``r.job``: complete what its prepare call pinned."""
        job = r.job
        if isinstance(job, LoadJob):
            self._settle_load(job, r)
        elif isinstance(job, StoreJob):
            self._manager.complete_store(job.keys, success=r.errors == 0)
            if r.errors:
                self._stats.add("failed_store_jobs", 1)
            self._stores.released(job.job_id, job.gpu_ids)
            t = self._tracks.get(job.req_id)
            if t is not None:
                t.store_jobs.discard(job.job_id)
                drop_if_done(self._tracks, t)
        else:
            failed, transient = self._failed_in_order(job.transfer.keys, r)
            self._manager.complete_background(job.transfer.id, success=r.errors == 0,
                                              failed=failed, transient=transient)

    def _failed_in_order(self, keys: tuple, r: Reports) -> tuple[tuple, tuple]:
        """The job's failed keys and, of those, the transient ones, in ``keys``' order (as
        the manager's complete calls take them); both counted in the stats."""
        failed, transient = r.failed, r.transient
        if failed:
            self._stats.add("failed_load_blocks", len(failed))
        if transient:
            self._stats.add("transient_failed_load_blocks", len(transient))
        return (tuple(k for k in keys if k in failed) if failed else (),
                tuple(k for k in keys if k in transient) if transient else ())

    def _settle_load(self, job: LoadJob, r: Reports) -> None:
        failed, transient = self._failed_in_order(job.keys, r)
        self._manager.complete_load(job.keys, failed=failed, transient=transient)
        t = self._tracks.get(job.req_id)
        if t is not None and t.load_job == job.job_id:
            t.load_job = None
            if failed:  # vLLM recomputes from the first failed block on: store those again
                first = job.keys.index(failed[0])
                t.next_store = min(t.next_store, t.load_first_index + first)
            drop_if_done(self._tracks, t)
        if self._tl.enabled:
            self._tl.mark("sched", "load_settled", req=job.req_id, job=job.job_id,
                          failed=len(r.failed))
