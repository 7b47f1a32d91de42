"""The scheduler's ledger of jobs handed to workers and not yet settled.

Every job (load, store, background move) is sent to all workers; each worker reports it once
when its part is done. A :class:`HandedJob` is the scheduler's record of one such job while it
awaits those reports (:mod:`kvtier.runtime.load_job` reads a load's result). The ledger adds those reports up and releases a job when all
``world_size`` workers reported it: only then may the manager publish or free what the job's
prepare call pinned. Failed keys and errors are unioned / counted across workers, so one bad
worker fails the job for all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count
from typing import Literal

from kvtier.connectors.vllm.metadata import KVTierWorkerMetadata
from kvtier.manager.specs import BlockKey

Kind = Literal["load", "store", "background"]


@dataclass
class HandedJob:
    """A job handed to every worker: what settling it needs, and the workers' reports so far."""

    kind: Kind
    req_id: str | None = None
    keys: tuple[BlockKey, ...] = ()
    gpu_ids: tuple[int, ...] = ()  # stores: source blocks (fenced until settled)
    transfer_id: int = 0  # background: the manager's transfer id
    reports: int = 0
    errors: int = 0
    failed: set[BlockKey] = field(default_factory=set)
    hard_failed: set[BlockKey] = field(default_factory=set)  # failed other than transiently

    @property
    def ok(self) -> bool:
        return self.errors == 0 and not self.failed

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
        self.pending: dict[int, HandedJob] = {}
        self.unknown_reports = 0  # reports for ids never issued (ignored, counted)

    def add(self, job: HandedJob) -> int:
        job_id = next(self._ids)
        self.pending[job_id] = job
        return job_id

    def record(self, meta: KVTierWorkerMetadata) -> list[tuple[int, HandedJob]]:
        """Apply one step's aggregated reports; returns the jobs now complete, by id."""
        for job_id, keys in meta.failed.items():
            job = self.pending.get(job_id)
            if job is not None:
                job.failed.update(keys)
                job.hard_failed |= meta.hard_failures(job_id)
        for job_id, n in meta.errors.items():
            job = self.pending.get(job_id)
            if job is not None:
                job.errors += n
        complete: list[tuple[int, HandedJob]] = []
        for job_id, n in meta.done.items():
            job = self.pending.get(job_id)
            if job is None:
                self.unknown_reports += 1
                continue
            job.reports += n
            if job.reports >= self.world_size:
                complete.append((job_id, self.pending.pop(job_id)))
        complete.sort(key=lambda item: item[0])
        return complete

    def __len__(self) -> int:
        return len(self.pending)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.pending
