"""Jobs of :class:`ImmediateHandler` routes, run on the callers' threads, never on the loop.

Such jobs (the CUDA GPU<->CPU copies) are enqueued on the submitting thread and polled from the
caller's ``get_finished`` / ``wait``; ``fence`` and ``fence_layer`` order the caller's later
device work after them. :class:`~kvtier.transfer.engine.TransferEngine` owns one
:class:`ImmediateHops` and talks to it only through the methods below; what the jobs need back
from the engine (the lane of a job, ending a job with its outcome) is handed in at
construction as callables.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Mapping

from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.transfer.handlers import ImmediateHandler, TransferHandler
from kvtier.transfer.jobs import Job, Lane, Route, TransferOutcome

log = logging.getLogger(__name__)

AccountHop = Callable[[Lane, Job, TransferOutcome, "str | None", float], None]


class ImmediateHops:
    """The immediate jobs running on a device queue. Thread-safe: every method may be called
    from any caller thread."""

    def __init__(
        self,
        name: str,
        handlers: Mapping[Route, TransferHandler],
        *,
        lane_of: Callable[[Job], Lane],
        account: AccountHop,
    ) -> None:
        """``lane_of``: the lane of a job; ``account``: record one ended job and hand its
        result over (lane, job, outcome, error, seconds)."""
        self.name = name
        self._handlers = {r: h for r, h in handlers.items() if isinstance(h, ImmediateHandler)}
        self._lane_of = lane_of
        self._account = account
        self.running: dict[int, Job] = {}  # job id -> the job on a device queue
        self._lock = threading.RLock()  # the callers' side: starting, polling, fencing

    def takes(self, job: Job) -> bool:
        """Whether the job runs here (its route has an immediate handler)."""
        return job.route in self._handlers

    def is_running(self, job_id: int) -> bool:
        return job_id in self.running

    def start(self, job: Job) -> None:
        """Enqueue the job on its device queue now; a refusal fails the job."""
        with self._lock:
            lane = self._lane_of(job)
            job.started = time.perf_counter()
            try:
                job.pending = lane.handler.start(job.src, job.dst)
            except Exception as exc:  # noqa: BLE001 - a refused job fails, like on the loop
                error = f"{lane.name}: {type(exc).__name__}: {exc}"
                log.warning("%s: job %d failed: %s", self.name, job.job_id, error)
                self._account(lane, job, TransferOutcome(), error, 0.0)
                return
            self.running[job.job_id] = job

    def _complete(self, job: Job, outcome: TransferOutcome) -> None:
        del self.running[job.job_id]
        lane = self._lane_of(job)
        seconds = outcome.seconds
        if seconds is None:
            seconds = time.perf_counter() - job.started
        job.pending = None
        self._account(lane, job, outcome, None, seconds)

    def advance(self, block_on: Iterable[int] = ()) -> None:
        """Collect the finished jobs (``block_on``: wait for those job ids, if running)."""
        with self._lock:
            for jid in block_on:
                job = self.running.get(jid)
                if job is not None:
                    self._complete(job, self._lane_of(job).handler.finish(job.pending))
            for job in list(self.running.values()):
                outcome = self._lane_of(job).handler.poll(job.pending)
                if outcome is not None:
                    self._complete(job, outcome)

    def fence(self, job_ids: Iterable[int]) -> None:
        """The caller's stream waits for those of these jobs running here (others: nothing)."""
        with self._lock:
            for i in job_ids:
                job = self.running.get(i)
                if job is not None:
                    self._lane_of(job).handler.fence(job.pending)

    def fence_layer(self, job_ids: Iterable[int], layer: int) -> list[int]:
        """The caller's stream waits for one layer of those jobs running here; returns the
        others (finished already, or not immediate jobs)."""
        rest = []
        with self._lock:
            for i in job_ids:
                job = self.running.get(i)
                if job is None:
                    rest.append(i)
                else:
                    self._lane_of(job).handler.fence_layer(job.pending, layer)
        return rest

    def prefetch(self, src: LoadStoreSpec, to: Medium, whole: bool = False) -> bool:
        """See :meth:`TransferEngine.prefetch`."""
        handler = self._handlers.get((src.medium, to))
        if handler is None:
            return False
        with self._lock:
            try:
                return handler.prefetch(src, whole)
            except Exception as exc:  # noqa: BLE001 - a hint; the load runs without it
                log.warning("%s: prefetch of %d blocks failed: %s", self.name, len(src.ids),
                            exc)
                handler.drop_prefetch()
                return False

    def drop_prefetches(self) -> None:
        with self._lock:
            for handler in self._handlers.values():
                handler.drop_prefetch()

    def prefetch_counts(self) -> dict[str, int]:
        out = {"used": 0, "dropped": 0}
        for handler in self._handlers.values():
            for k, v in getattr(handler, "prefetches", {}).items():
                out[k] = out.get(k, 0) + v
        return out

    def prefetch_min_bytes(self, src: Medium, to: Medium) -> int | None:
        handler = self._handlers.get((src, to))
        return handler.prefetch_min_bytes if handler is not None else None
