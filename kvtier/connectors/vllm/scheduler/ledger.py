"""The scheduler's ledger of jobs handed to workers, and their settling once every worker reported.

Every job (load, store, background move) is sent to all workers; each worker reports it once
when its part is done. The ledger keeps the job exactly as it was handed (the metadata's
``LoadJob``, ``StoreJob`` or ``BackgroundJob``: no second record of it) beside the workers'
reports so far, adds those reports up and releases a job when all ``world_size`` workers
reported it: only then may the manager publish or free what the job's prepare call pinned.
Failed keys and errors are unioned / counted across workers, so one bad worker fails the job
for all.

Settling (:class:`JobSettler`) gives the manager's prepare calls their complete: a load settles
``complete_load`` with the keys that could not be read, and a failed load rewinds its request's
store cursor, since vLLM recomputes from its first failed block; a store settles
``complete_store``; a background move (promotion, demotion, deletion, shared-tier write)
``complete_background`` with the keys a promotion could not read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count
from typing import Callable, Iterable

from kvtier.connectors.vllm.metadata import HandedJob, KVTierWorkerMetadata, LoadJob, StoreJob
from kvtier.connectors.vllm.scheduler.requests import RequestTrack, drop_if_done
from kvtier.connectors.vllm.stats import KVTierStats
from kvtier.manager.abstract import OffloadingManager
from kvtier.manager.specs import BlockKey
from kvtier.observe.timeline import timeline


@dataclass
class Reports:
    """The workers' reports on one handed ``job`` so far."""

    job: HandedJob
    workers: int = 0  # how many reported it done
    errors: int = 0
    failed: set[BlockKey] = field(default_factory=set)
    hard_failed: set[BlockKey] = field(default_factory=set)  # failed other than transiently

    @property
    def transient(self) -> set[BlockKey]:
        """Failed keys whose read failed only transiently (EIO, EMFILE ...), on every worker
        that failed them: counted apart from corruption."""
        return self.failed - self.hard_failed


class JobLedger:
    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._ids = count(1)
        self.pending: dict[int, Reports] = {}
        self.unknown_reports = 0  # reports for ids never issued (ignored, counted)

    def next_id(self) -> int:
        """The id of the next job to hand over (the job carries it to the workers)."""
        return next(self._ids)

    def add(self, job: HandedJob) -> HandedJob:
        """Await the workers' reports on ``job`` (its ``job_id`` from :meth:`next_id`)."""
        self.pending[job.job_id] = Reports(job)
        return job

    def record(self, meta: KVTierWorkerMetadata) -> list[Reports]:
        """Apply one step's aggregated reports; returns the jobs now complete, by id."""
        for job_id, keys in meta.failed.items():
            r = self.pending.get(job_id)
            if r is not None:
                r.failed.update(keys)
                r.hard_failed |= meta.hard_failures(job_id)
        for job_id, n in meta.errors.items():
            r = self.pending.get(job_id)
            if r is not None:
                r.errors += n
        complete: list[Reports] = []
        for job_id, n in meta.done.items():
            r = self.pending.get(job_id)
            if r is None:
                self.unknown_reports += 1
                continue
            r.workers += n
            if r.workers >= self.world_size:
                complete.append(self.pending.pop(job_id))
        complete.sort(key=lambda r: r.job.job_id)
        return complete

    def __len__(self) -> int:
        return len(self.pending)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.pending


class JobSettler:
    def __init__(self, manager: OffloadingManager, tracks: dict[str, RequestTrack],
                 released: Callable[[int, Iterable[int]], None], stats: KVTierStats) -> None:
        self._manager = manager
        self._tracks = tracks  # the scheduler's live requests (settling may drop one)
        self._released = released  # a store job no longer reads its engine blocks
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
            self._released(job.job_id, job.gpu_ids)
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
