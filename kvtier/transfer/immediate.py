"""Hops of :class:`ImmediateHandler` routes, run on the callers' threads, never on the loop.

Such hops (the CUDA GPU<->CPU copies) are enqueued on the submitting thread and polled from the
caller's ``get_finished`` / ``wait``; ``fence`` and ``fence_layer`` order the caller's later
device work after them. A hop that follows one which reports final blocks while it runs (the
shared tier's read) starts in pieces before that hop ends (:mod:`kvtier.transfer.early`).
:class:`~kvtier.transfer.engine.TransferEngine` owns one
:class:`ImmediateHops` and talks to it only through the methods below; what the hops need
back from the engine (the lane of a hop, accounting a finished hop, ending a job, queueing a
later hop on the loop) is handed in at construction as callables.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Mapping, Sequence

from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.transfer.early import EarlyCopies, Pieces
from kvtier.transfer.handlers import ImmediateHandler, TransferHandler
from kvtier.transfer.jobs import Route, TransferOutcome, route_of
from kvtier.transfer.lanes import JobProgress, Lane

log = logging.getLogger(__name__)

AccountHop = Callable[[Lane, JobProgress, TransferOutcome, "str | None", float], None]


class ImmediateHops:
    """The immediate hops running on a device queue and the jobs parked for one.

    Thread-safe: every method may be called from any caller thread; ``park`` is also called
    from the engine's loop thread (a chained job whose next hop is immediate waits here for
    the next caller).
    """

    def __init__(
        self,
        name: str,
        handlers: Mapping[Route, TransferHandler],
        *,
        lane_of: Callable[[JobProgress], Lane],
        account: AccountHop,
        finish: Callable[[JobProgress], None],
        to_loop: Callable[[JobProgress], None],
    ) -> None:
        """``lane_of``: the lane of a job's next hop; ``account``: record one finished hop
        (lane, job, outcome, error, seconds); ``finish``: hand the ended job's result over;
        ``to_loop``: queue the job's next (non-immediate) hop on the engine's loop."""
        self.name = name
        self._handlers = {r: h for r, h in handlers.items() if isinstance(h, ImmediateHandler)}
        self._lane_of = lane_of
        self._account = account
        self._finish = finish
        self._to_loop = to_loop
        self.running: dict[int, JobProgress] = {}  # job id -> its hop on a device queue
        # (a job whose ``error`` is set only waits for the pieces its failed hop let start)
        self._parked: list[JobProgress] = []  # jobs whose next hop waits for a caller
        self._parked_lock = threading.Lock()
        self._lock = threading.RLock()  # the callers' side: starting, polling, fencing
        self._early: dict[int, EarlyCopies] = {}  # job id -> its next hop, taken apart
        self._early_lock = threading.Lock()  # _early and its entries (any thread)

    def takes(self, job: JobProgress) -> bool:
        """Whether the job's next hop runs here (its route has an immediate handler)."""
        return route_of(job.hops[job.next_hop]) in self._handlers

    def is_running(self, job_id: int) -> bool:
        return job_id in self.running

    def has_parked(self) -> bool:
        return bool(self._parked)

    def has_early(self) -> bool:
        """Whether a running hop may report blocks whose copies could start early."""
        return bool(self._early)

    def park(self, job: JobProgress) -> None:
        """Keep the job until a caller's next call starts its hop (loop thread)."""
        with self._parked_lock:
            self._parked.append(job)

    # ---- early copies (kvtier.transfer.early) ----------------------------------------------

    def open_early(self, job: JobProgress) -> Callable[[Sequence[int]], None] | None:
        """Loop thread, as the job's hop starts: if its next hop runs here and reads what this
        one writes, take it apart; returns the callback the running hop reports final
        blocks to (None: the next hop starts whole, afterwards)."""
        if job.next_hop + 1 >= len(job.hops):
            return None
        _, written = job.hops[job.next_hop]
        following = job.hops[job.next_hop + 1]
        handler = self._handlers.get(route_of(following))
        if handler is None or following[0].medium != written.medium \
                or not EarlyCopies.fits(following):
            return None
        early = EarlyCopies(following, written.ids, handler)
        with self._early_lock:
            self._early[job.job_id] = early
        return lambda ids, jid=job.job_id: self._ready(jid, ids)

    def _ready(self, job_id: int, ids: Sequence[int]) -> None:
        with self._early_lock:
            early = self._early.get(job_id)
            if early is not None:
                early.add_ready(ids)

    def end_early(self, job: JobProgress) -> bool:
        """Loop thread: the job's hop failed. False: nothing of the next hop started, end the
        job now. True: pieces are on the device; the job ends once they are done."""
        with self._early_lock:
            early = self._early.pop(job.job_id, None)
            if early is None:
                return False
            early.open = False
            if not early.pieces:
                return False
        job.pending = Pieces(early.handler, early.pieces)
        self.park(job)
        return True

    def _start_pieces(self) -> None:
        """Enqueue the pieces whose blocks became final (callers' lock held)."""
        with self._early_lock:
            for jid, early in self._early.items():
                piece = early.take()
                if piece is None:
                    continue
                indices, (src, dst) = piece
                try:
                    early.started(indices, early.handler.start(src, dst))
                except Exception as exc:  # noqa: BLE001 - the rest copies them after the read
                    early.open = False
                    log.warning("%s: job %d: an early copy of %d blocks failed (%s); they are "
                                "copied after the read", self.name, jid, len(src.ids), exc)

    def start(self, job: JobProgress) -> None:
        with self._lock:
            self._start(job)

    def _start(self, job: JobProgress) -> None:
        """Enqueue the job's next hop on its device queue now (what its early pieces did not
        copy); a refusal fails the job, which still waits for those pieces."""
        if job.error is not None:  # a failed hop's pieces (end_early): wait for them only
            self.running[job.job_id] = job
            return
        lane = self._lane_of(job)
        hop: tuple | None = job.hops[job.next_hop]
        handles: list = []
        with self._early_lock:
            early = self._early.pop(job.job_id, None)
            if early is not None:
                hop = early.rest()
                handles = early.pieces
        job.started = time.perf_counter()
        try:
            if hop is not None:
                handles.append(lane.handler.start(*hop))
        except Exception as exc:  # noqa: BLE001 - a refused hop is a failed job, like on the loop
            error = f"{lane.name}: {type(exc).__name__}: {exc}"
            log.warning("%s: job %d failed: %s", self.name, job.job_id, error)
            self._account(lane, job, TransferOutcome(), error, 0.0)
            if not handles:
                self._finish(job)
                return
        job.pending = Pieces(lane.handler, handles)
        self.running[job.job_id] = job

    def _complete(self, job: JobProgress, outcome: TransferOutcome) -> None:
        del self.running[job.job_id]
        job.pending = None
        if job.error is not None:  # only its pieces ran on: the failure was accounted
            self._finish(job)
            return
        lane = self._lane_of(job)
        seconds = outcome.seconds
        if seconds is None:
            seconds = time.perf_counter() - job.started
        self._account(lane, job, outcome, None, seconds)
        if job.next_hop + 1 < len(job.hops):
            job.next_hop += 1
            if self.takes(job):
                self._start(job)
            else:
                self._to_loop(job)
        else:
            self._finish(job)

    def advance(self, block_on: Iterable[int] = ()) -> None:
        """Start parked hops, collect the finished ones (``block_on``: wait for those job ids'
        hops, if running)."""
        with self._lock:
            with self._parked_lock:
                parked, self._parked = self._parked, []
            for job in parked:
                self._start(job)
            if self._early:
                self._start_pieces()
            for jid in block_on:
                job = self.running.get(jid)
                if job is not None:
                    self._complete(job, job.pending.finish())
            for job in list(self.running.values()):
                outcome = job.pending.poll()
                if outcome is not None:
                    self._complete(job, outcome)

    def fence(self, job_ids: Iterable[int]) -> None:
        """The caller's stream waits for those of these jobs running here (others: nothing)."""
        with self._lock:
            for i in job_ids:
                job = self.running.get(i)
                if job is not None:
                    job.pending.fence()

    def fence_layer(self, job_ids: Iterable[int], layer: int) -> list[int]:
        """The caller's stream waits for one layer of those jobs running here; returns the
        others (finished already, or not on an immediate hop yet)."""
        rest = []
        with self._lock:
            for i in job_ids:
                job = self.running.get(i)
                if job is None:
                    rest.append(i)
                else:
                    job.pending.fence_layer(layer)
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
