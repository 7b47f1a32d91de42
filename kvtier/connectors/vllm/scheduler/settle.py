"""Settling finished jobs on the scheduler side: the manager's prepare calls get their complete.

The settler owns the promotions in flight: which load job promotes each key from disk (a load
planned later that joins it waits for it), their plan -> settle clock (:mod:`promotion_clock`),
the loads parked until the promotions they joined settled (the manager's
``prepare_shared_load`` contract), and the settled promoting loads whose results the workers
may forget. A settled failed load rewinds the request's store cursor, since vLLM recomputes
from its first failed block.
"""

from __future__ import annotations

from typing import Sequence

from kvtier.connectors.vllm.scheduler.ledger import HandedJob, JobLedger
from kvtier.connectors.vllm.scheduler.promotion_clock import PromotionClock
from kvtier.connectors.vllm.scheduler.requests import RequestTrack, drop_if_done
from kvtier.connectors.vllm.scheduler.store_plan import StorePlanner
from kvtier.connectors.vllm.stats import KVTierStats
from kvtier.manager.abstract import OffloadingManager
from kvtier.manager.specs import BlockKey
from kvtier.observe.timeline import timeline


class JobSettler:
    def __init__(self, manager: OffloadingManager, ledger: JobLedger,
                 tracks: dict[str, RequestTrack], stores: StorePlanner, stats: KVTierStats,
                 block_bytes: int) -> None:
        self._manager = manager
        self._ledger = ledger
        self._tracks = tracks  # the scheduler's live requests (settling may drop one)
        self._stores = stores
        self._stats = stats
        self.clock = PromotionClock(block_bytes)  # disk-hit wall times, plan -> settle
        self._promoting: dict[BlockKey, int] = {}  # key -> load job promoting it from disk
        self._parked: dict[int, HandedJob] = {}  # complete loads waiting for those they joined
        self._forget: list[int] = []  # settled promoting loads: workers may drop their results
        self._tl = timeline()

    # ------------------------------------------------------------------ planning a load
    def promoting(self, keys: Sequence[BlockKey], joined: Sequence[bool]) -> tuple[int, ...]:
        """The load jobs promoting the joined ones of ``keys``: a new load waits for them."""
        return tuple(sorted({self._promoting[k] for k, j in zip(keys, joined)
                             if j and k in self._promoting}))

    def load_planned(self, job_id: int, keys: Sequence[BlockKey], from_disk: Sequence[bool],
                     from_remote: Sequence[bool], timed: bool) -> None:
        """Load ``job_id`` promotes ``keys[i]`` where ``from_disk[i]``; ``timed``: its request
        waits for it (asynchronous), so its wall time teaches the cost model."""
        if timed:
            self.clock.started(job_id, from_disk, from_remote)
        for key, disk in zip(keys, from_disk):
            if disk:
                self._promoting[key] = job_id

    # ------------------------------------------------------------------ state
    def has_parked(self) -> bool:
        return bool(self._parked)

    def has_forget(self) -> bool:
        return bool(self._forget)

    def take_forget(self) -> tuple[int, ...]:
        out, self._forget = tuple(self._forget), []
        return out

    def _unsettled(self, job_id: int) -> bool:
        return job_id in self._ledger or job_id in self._parked

    # ------------------------------------------------------------------ settling
    def settle(self, job_id: int, job: HandedJob) -> None:
        """Every worker reported ``job_id``: complete what its prepare call pinned."""
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
            self._manager.complete_store(job.keys, success=job.errors == 0)
            if job.errors:
                self._stats.add("failed_store_jobs", 1)
            self._stores.released(job_id, job.gpu_ids)
            t = self._tracks.get(job.req_id)
            if t is not None:
                t.store_jobs.discard(job_id)
                drop_if_done(self._tracks, t)
        else:
            self._manager.complete_background(job.transfer_id, success=job.errors == 0)

    def _settle_load(self, job_id: int, job: HandedJob) -> None:
        failed, transient = set(job.failed), job.transient
        sample = self.clock.settled(job_id, ok=not failed and job.errors == 0)
        if sample is not None:  # what the request waited for its promotion: the cost model
            self._manager.record_promotion(*sample)
        self._manager.complete_load(job.keys,
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
            self._forget.append(job_id)
        t = self._tracks.get(job.req_id)
        if t is not None and t.load_job == job_id:
            t.load_job = None
            if failed:  # vLLM recomputes from the first failed block on: store those again
                first = min(i for i, k in enumerate(job.keys) if k in failed)
                t.next_store = min(t.next_store, t.load_first_index + first)
            drop_if_done(self._tracks, t)
        if self._tl.enabled:
            self._tl.mark("sched", "load_settled", req=job.req_id, job=job_id, failed=len(failed))
