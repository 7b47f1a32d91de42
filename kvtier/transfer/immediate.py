"""The caller-thread half of the transfer engine: hops of :class:`ImmediateHandler` routes.

Such hops (the CUDA GPU<->CPU copies) are enqueued on the submitting thread and polled from the
caller's ``get_finished`` / ``wait``, never handed to the loop thread; ``fence`` and
``fence_layer`` order the caller's later device work after them. A mixin of
:class:`~kvtier.transfer.engine.TransferEngine`, whose state it shares (``_immediate``,
``_parked``, ``_imm_lock``, ``_lock``/``_cond``, ``_live``, ``_finished``).
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.transfer.handlers import ImmediateHandler
from kvtier.transfer.jobs import TransferOutcome
from kvtier.transfer.lanes import Job

log = logging.getLogger(__name__)


class ImmediateHops:
    # ---- immediate hops (caller threads, under _imm_lock) ---------------------------------------

    def _start_immediate(self, job: Job) -> None:
        """Enqueue the job's next hop on its device queue now; a refusal fails the job."""
        lane = self._lane(job)
        src, dst = job.hops[job.next_hop]
        job.started = time.perf_counter()
        try:
            job.pending = lane.handler.start(src, dst)
        except Exception as exc:  # noqa: BLE001 - a refused hop is a failed job, like on the loop
            error = f"{lane.name}: {type(exc).__name__}: {exc}"
            log.warning("%s: job %d failed: %s", self.name, job.job_id, error)
            self._hop_done(lane, job, TransferOutcome(), error, 0.0)
            self._finish(job)
            return
        self._immediate[job.job_id] = job

    def _complete_immediate(self, job: Job, outcome: TransferOutcome) -> None:
        lane = self._lane(job)
        del self._immediate[job.job_id]
        job.pending = None
        seconds = outcome.seconds
        if seconds is None:
            seconds = time.perf_counter() - job.started
        self._hop_done(lane, job, outcome, None, seconds)
        if job.next_hop + 1 < len(job.hops):
            job.next_hop += 1
            if self._is_immediate(job):
                self._start_immediate(job)
            else:
                self._loop.call_soon_threadsafe(self._dispatch, job)
        else:
            self._finish(job)

    def _advance(self, block_on: Iterable[int] = ()) -> None:
        """Start parked immediate hops, collect the finished ones (``block_on``: wait for those
        job ids' immediate hops, if running)."""
        with self._imm_lock:
            with self._lock:
                parked, self._parked = self._parked, []
            for job in parked:
                self._start_immediate(job)
            for jid in block_on:
                job = self._immediate.get(jid)
                if job is not None:
                    self._complete_immediate(job, self._lane(job).handler.finish(job.pending))
            for job in list(self._immediate.values()):
                outcome = self._lane(job).handler.poll(job.pending)
                if outcome is not None:
                    self._complete_immediate(job, outcome)

    def prefetch(self, src: LoadStoreSpec, to: Medium, whole: bool = False) -> bool:
        """Hint that ``src`` will probably be copied to ``to`` next (the handler may start
        reading it: ``ImmediateHandler.prefetch``; ``whole``: the copy's destination will be
        ``LoadStoreSpec.whole``). A failure only logs: the hop itself will run in full when
        submitted."""
        handler = self._handlers.get((src.medium, to))
        if not isinstance(handler, ImmediateHandler):
            return False
        with self._imm_lock:
            try:
                return handler.prefetch(src, whole)
            except Exception as exc:  # noqa: BLE001 - a hint; the load runs without it
                log.warning("%s: prefetch of %d blocks failed: %s", self.name, len(src.ids),
                            exc)
                handler.drop_prefetch()
                return False

    def drop_prefetches(self) -> None:
        """Drop every unused prefetch (before the prefetched sources may be reassigned)."""
        with self._imm_lock:
            for handler in self._handlers.values():
                if isinstance(handler, ImmediateHandler):
                    handler.drop_prefetch()

    def prefetch_counts(self) -> dict[str, int]:
        """Prefetch hints used by a hop and dropped unused, over all handlers (timelines)."""
        out = {"used": 0, "dropped": 0}
        for handler in self._handlers.values():
            for k, v in getattr(handler, "prefetches", {}).items():
                out[k] = out.get(k, 0) + v
        return out

    def prefetch_min_bytes(self, src: Medium, to: Medium) -> int | None:
        """The smallest hop ``src -> to`` worth a prefetch hint; None: none is taken."""
        handler = self._handlers.get((src, to))
        return handler.prefetch_min_bytes if isinstance(handler, ImmediateHandler) else None

    def fence(self, job_ids: Iterable[int]) -> None:
        """Order device work the caller enqueues from now on after these jobs: a stream wait
        for a job on an immediate hop (the host goes on at once), else a host wait until the
        job finished. Results stay collectable by ``get_finished``."""
        ids = [int(i) for i in job_ids]
        while True:
            self._advance()
            with self._cond:
                waiting = [i for i in ids if i in self._live and i not in self._finished
                           and i not in self._immediate]
                if not waiting:
                    break
                self._cond.wait(0.002)
        with self._imm_lock:
            for i in ids:
                job = self._immediate.get(i)
                if job is not None:
                    self._lane(job).handler.fence(job.pending)

    def fence_layer(self, job_ids: Iterable[int], layer: int) -> None:
        """``fence`` for the pages of one layer: on a handler that copies layer by layer, the
        caller's stream waits only for that layer of these jobs (vLLM's per-layer hook)."""
        ids = [int(i) for i in job_ids]
        with self._imm_lock:
            rest = []
            for i in ids:
                job = self._immediate.get(i)
                if job is None:
                    rest.append(i)
                else:
                    self._lane(job).handler.fence_layer(job.pending, layer)
        if rest:  # finished already (nothing to wait for) or not on an immediate hop yet
            self.fence(rest)
