"""The scheduler's ledger of jobs handed to workers and not yet settled.

Every job (load, store, background move) is sent to all workers; each worker reports it once
when its part is done. The ledger keeps the job exactly as it was handed (the metadata's
``LoadJob``, ``StoreJob`` or ``BackgroundJob``: no second record of it) beside the workers'
reports so far, adds those reports up and releases a job when all ``world_size`` workers
reported it: only then may the manager publish or free what the job's prepare call pinned.
Failed keys and errors are unioned / counted across workers, so one bad worker fails the job
for all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count

from kvtier.connectors.vllm.metadata import HandedJob, KVTierWorkerMetadata
from kvtier.manager.specs import BlockKey


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
