"""The transfer engine: a synchronous facade over one asyncio loop running one worker per direction.

vLLM's worker thread must never block on a copy, so callers only ``submit`` (returns a job id at
once) and later drain ``get_finished``. Behind that, one event loop in its own daemon thread runs
one worker per (source medium, destination medium) route. Each route has its own queue, so a long
CPU->DISK store never sits in front of a CPU->GPU load; within a route jobs *start* in submission
order and up to ``handler.concurrency`` of them run at once.

A job is one (source spec, destination spec) pair, routed by its media; its result is one
:class:`~kvtier.transfer.jobs.JobResult`. A job whose handler raises fails; one whose handler
only reports ``failed_keys`` (blocks that individually could not be read) does not, and the
caller settles those keys with the manager.

Immediate routes (:class:`ImmediateHandler`, the CUDA GPU<->CPU copies) bypass the loop: their
jobs are enqueued on the submitting thread and their completion is polled by ``get_finished``
and ``wait`` on the caller's thread (:class:`~kvtier.transfer.immediate.ImmediateHops`, a
collaborator the engine owns). ``fence`` orders the caller's later device work after given
jobs (a stream wait for immediate jobs, a host wait otherwise), so a forward can consume a
load without the host ever blocking on the GPU.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace
from typing import Iterable

from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.transfer.handlers import ImmediateHandler, TransferHandler
from kvtier.transfer.immediate import ImmediateHops
from kvtier.transfer.jobs import (
    DirectionStats,
    Job,
    JobResult,
    Lane,
    Route,
    TransferOutcome,
    check_handler,
    route_name,
)

log = logging.getLogger(__name__)


class TransferEngine:
    def __init__(self, handlers: Iterable[TransferHandler], *, name: str = "kvtier-transfer") -> None:
        self._handlers: dict[Route, TransferHandler] = {}
        for h in handlers:
            route = check_handler(h)
            if route in self._handlers:
                raise ValueError(f"two handlers for {route_name(route)}")
            self._handlers[route] = h
        if not self._handlers:
            raise ValueError("TransferEngine needs at least one handler")
        self.name = name
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._finished: dict[int, JobResult] = {}  # insertion order = completion order
        self._live: set[int] = set()  # submitted and not yet handed to the caller
        self._reserved: set[int] = set()  # ids a wait() call is collecting
        self._pending = 0
        self.jobs_done = 0  # grows with every accounted job: stats() changed only if it did
        self._next_id = 0
        self._closed = False
        self._stopped = False
        self._lanes: dict[Route, Lane] = {}
        self._immediate = ImmediateHops(
            name, self._handlers, lane_of=self._lane, account=self._hop_done)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=name, daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start_lanes(), self._loop).result()
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            raise

    # ---- loop thread -------------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _start_lanes(self) -> None:
        for route, h in self._handlers.items():
            lane = Lane(route, h, asyncio.Queue(), asyncio.Semaphore(h.concurrency))
            if not isinstance(h, ImmediateHandler):
                lane.worker = asyncio.ensure_future(self._worker(lane))
            self._lanes[route] = lane

    def _lane(self, job: Job) -> Lane:
        return self._lanes[job.route]

    def _dispatch(self, job: Job) -> None:
        """Loop thread: queue the job on its route."""
        self._lane(job).queue.put_nowait(job)

    async def _worker(self, lane: Lane) -> None:
        """Start the route's jobs in queue order, at most ``concurrency`` at a time."""
        while True:
            # Take a free slot before taking a job, so a job is never held outside the queue
            # while it waits (close() fails whatever is still queued).
            await lane.slots.acquire()
            try:
                job = await lane.queue.get()
            except BaseException:
                lane.slots.release()
                raise
            task = asyncio.ensure_future(self._run_hop(lane, job))
            lane.running[task] = job
            task.add_done_callback(lambda t, lane=lane: lane.running.pop(t, None))

    async def _run_hop(self, lane: Lane, job: Job) -> None:
        src, dst = job.src, job.dst
        outcome = TransferOutcome()
        error: str | None = None
        with self._lock:
            lane.active += 1
            if lane.active == 1:
                lane.busy_since = time.perf_counter()
        t0 = time.perf_counter()
        try:
            outcome = await lane.handler.run(src, dst)
            if not isinstance(outcome, TransferOutcome):
                raise TypeError(f"handler returned {type(outcome).__name__}, not TransferOutcome")
        except asyncio.CancelledError:
            error = f"{lane.name}: cancelled because the engine was closed"
            outcome = TransferOutcome()
        except BaseException as exc:  # noqa: BLE001 - a failing job must never kill the worker
            error = f"{lane.name}: {type(exc).__name__}: {exc}"
            outcome = TransferOutcome()
            log.warning("%s: job %d failed: %s", self.name, job.job_id, error)
            log.debug("%s: job %d traceback", self.name, job.job_id, exc_info=exc)
        finally:
            now = time.perf_counter()
            lane.slots.release()
        self._hop_done(lane, job, outcome, error, now - t0, ended_at=now)

    def _hop_done(self, lane: Lane, job: Job, outcome: TransferOutcome, error: str | None,
                  seconds: float, ended_at: float | None = None) -> None:
        """Account one job's run (one lock hold: a stats snapshot never sees its time without
        its bytes) and hand its result over. ``ended_at``: a loop job's end (busy time spans
        overlapping jobs); else an immediate job, whose ``seconds`` are its own."""
        with self._lock:
            if ended_at is None:
                lane.stats.seconds += seconds
            else:
                lane.active -= 1
                if lane.active == 0:
                    lane.stats.seconds += ended_at - lane.busy_since
            lane.stats.jobs += 1
            lane.stats.bytes += outcome.bytes
            if error is not None or outcome.failed_keys:
                lane.stats.failed_jobs += 1
            self.jobs_done += 1
        self._finish(job, outcome, error, seconds)

    def _finish(self, job: Job, outcome: TransferOutcome, error: str | None,
                seconds: float = 0.0) -> None:
        failed = tuple(dict.fromkeys(outcome.failed_keys))
        result = JobResult(
            job_id=job.job_id,
            ok=error is None and not failed,
            error=error,
            failed_keys=failed,
            bytes=outcome.bytes,
            seconds=seconds,
            direction=job.route,
            transient_keys=tuple(dict.fromkeys(outcome.transient_keys)),
            progress=tuple(outcome.progress),
        )
        with self._cond:
            self._finished[job.job_id] = result
            self._pending -= 1
            self._cond.notify_all()

    async def _shutdown(self) -> None:
        """Stop workers; fail whatever is still running or queued (only after a close timeout)."""
        lanes = list(self._lanes.values())
        workers = [lane.worker for lane in lanes if lane.worker is not None]
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        running = [(t, job) for lane in lanes for t, job in lane.running.items()]
        for t, _ in running:
            t.cancel()
        await asyncio.gather(*(t for t, _ in running), return_exceptions=True)
        for t, job in running:
            if t.cancelled():  # cancelled before its first step: _run_hop never saw the job
                self._finish(job, TransferOutcome(), "cancelled because the engine was closed")
        for lane in lanes:
            while not lane.queue.empty():
                job = lane.queue.get_nowait()
                self._finish(job, TransferOutcome(),
                             f"{lane.name}: not run because the engine was closed")

    # ---- caller side (any thread) -------------------------------------------------------------

    def submit(self, src: LoadStoreSpec, dst: LoadStoreSpec, *, job_id: int | None = None) -> int:
        """Queue ``src -> dst``; returns the job id at once. Thread-safe, never blocks on I/O.

        ``job_id``: the caller's id, which must not belong to a job whose result has not been
        collected yet (``ValueError``); ``None`` picks the next free number.
        """
        if not isinstance(src, LoadStoreSpec) or not isinstance(dst, LoadStoreSpec):
            raise TypeError("a job is a (LoadStoreSpec, LoadStoreSpec) pair")
        route = (src.medium, dst.medium)
        if route not in self._handlers:
            known = ", ".join(route_name(r) for r in self._handlers)
            raise ValueError(f"no transfer handler for {route_name(route)}; known: {known}")
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            if job_id is None:
                while self._next_id in self._live:
                    self._next_id += 1
                jid = self._next_id
                self._next_id += 1
            else:
                jid = int(job_id)
                if jid in self._live:
                    raise ValueError(f"job id {jid} is already in use")
            self._live.add(jid)
            self._pending += 1
            job = Job(jid, src, dst)
            if not self._immediate.takes(job):
                self._loop.call_soon_threadsafe(self._dispatch, job)
                return jid
        self._immediate.start(job)
        return jid

    def get_finished(self) -> list[JobResult]:
        """Results completed since the last call, in completion order. Never waits for a job."""
        self._immediate.advance()
        with self._lock:
            out = [r for jid, r in self._finished.items() if jid not in self._reserved]
            for r in out:
                del self._finished[r.job_id]
                self._live.discard(r.job_id)
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> list[JobResult]:
        """Block until the given jobs finish; returns their results in the order asked. These
        results are not returned again by ``get_finished``. ``TimeoutError`` leaves them there."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("wait() called from the transfer loop would deadlock")
        ids = list(dict.fromkeys(int(i) for i in job_ids))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            unknown = [i for i in ids if i not in self._live]
            if unknown:
                raise ValueError(f"unknown or already collected job ids: {unknown[:10]}")
            busy = [i for i in ids if i in self._reserved]
            if busy:
                raise ValueError(f"job ids already being waited for: {busy[:10]}")
            self._reserved.update(ids)
            try:
                while True:
                    missing = [i for i in ids if i not in self._finished]
                    if not missing:
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(
                            f"{len(missing)} of {len(ids)} jobs unfinished after {timeout}s"
                        )
                    if any(self._immediate.is_running(i) for i in missing):
                        # immediate jobs move only on a caller's thread: this one
                        self._cond.release()
                        try:
                            self._immediate.advance(block_on=missing)
                        finally:
                            self._cond.acquire()
                        continue
                    self._cond.wait(left if left is not None and left < 0.002 else 0.002)
                out = [self._finished.pop(i) for i in ids]
                self._live.difference_update(ids)
                return out
            finally:
                self._reserved.difference_update(ids)

    def pending(self) -> int:
        """Jobs submitted and not finished yet (queued or running)."""
        with self._lock:
            return self._pending

    def stats(self) -> dict[str, DirectionStats]:
        """A snapshot per route, keyed like ``"GPU->CPU"``; busy time includes jobs running now."""
        now = time.perf_counter()
        with self._lock:
            out = {}
            for lane in self._lanes.values():
                s = replace(lane.stats)
                if lane.active:
                    s.seconds += now - lane.busy_since
                out[lane.name] = s
        return out

    # ---- immediate jobs: ordering the caller's device work, prefetch hints ------------------

    def fence(self, job_ids: Iterable[int]) -> None:
        """Order device work the caller enqueues from now on after these jobs: a stream wait
        for an immediate job (the host goes on at once), else a host wait until the job
        finished. Results stay collectable by ``get_finished``."""
        ids = [int(i) for i in job_ids]
        while True:
            self._immediate.advance()
            with self._cond:
                waiting = [i for i in ids if i in self._live and i not in self._finished
                           and not self._immediate.is_running(i)]
                if not waiting:
                    break
                self._cond.wait(0.002)
        self._immediate.fence(ids)

    def fence_layer(self, job_ids: Iterable[int], layer: int) -> None:
        """``fence`` for the pages of one layer: on a handler that copies layer by layer, the
        caller's stream waits only for that layer of these jobs (vLLM's per-layer hook)."""
        rest = self._immediate.fence_layer([int(i) for i in job_ids], layer)
        if rest:  # finished already (nothing to wait for) or not an immediate job
            self.fence(rest)

    def prefetch(self, src: LoadStoreSpec, to: Medium, whole: bool = False) -> bool:
        """Hint that ``src`` will probably be copied to ``to`` next (the handler may start
        reading it: ``ImmediateHandler.prefetch``; ``whole``: the copy's destination will be
        ``LoadStoreSpec.whole``). A failure only logs: the job itself will run in full when
        submitted."""
        return self._immediate.prefetch(src, to, whole)

    def drop_prefetches(self) -> None:
        """Drop every unused prefetch (before the prefetched sources may be reassigned)."""
        self._immediate.drop_prefetches()

    def prefetch_counts(self) -> dict[str, int]:
        """Prefetch hints used by a hop and dropped unused, over all handlers (timelines)."""
        return self._immediate.prefetch_counts()

    def prefetch_min_bytes(self, src: Medium, to: Medium) -> int | None:
        """The smallest job ``src -> to`` worth a prefetch hint; None: none is taken."""
        return self._immediate.prefetch_min_bytes(src, to)

    @property
    def routes(self) -> tuple[Route, ...]:
        return tuple(self._handlers)

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, let queued and running jobs finish (up to ``timeout`` seconds), then
        stop the loop. Jobs still unfinished after the timeout complete as failed."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("close() called from the transfer loop would deadlock")
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closed = True
            if self._stopped:
                return
            self._stopped = True
            while self._pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.release()
                try:
                    self._immediate.advance(block_on=list(self._immediate.running))
                finally:
                    self._cond.acquire()
                self._cond.wait(min(left, 0.002))
            drained = self._pending == 0
        if not drained:
            log.warning("%s: closing with %d unfinished jobs (failed)", self.name, self.pending())
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)
        for h in self._handlers.values():
            h.close(wait=drained)

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
