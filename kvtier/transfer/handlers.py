"""The handler contract: one handler moves bytes for one (source, destination) direction.

Handlers only execute: the manager already decided what goes where, so a handler validates its
input (bad addresses -> ``ValueError``), moves the bytes and reports what it moved. It raises on
failure; the engine turns that into a failed job and keeps the direction's worker alive.

Blocking work (torch copies, file I/O) must not run on the engine's event loop, or one slow
direction would stall every other one. ``run_blocking`` runs it on a thread pool owned by the
handler, sized to ``concurrency * threads_per_job``: a direction can therefore never take the
threads another direction needs (with the loop's shared default executor a burst of disk reads
could queue a GPU load behind them).
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.transfer.jobs import Route, TransferOutcome, route_name

T = TypeVar("T")


class TransferHandler(ABC):
    """A handler the engine runs on its event loop (``run``), one route per handler."""

    direction: Route
    concurrency: int = 1
    """Jobs of this direction that may run at once (they still start in submission order)."""
    threads_per_job: int = 1
    """Threads one job may use at once through ``run_blocking`` (e.g. parallel disk reads)."""

    _executor: ThreadPoolExecutor | None = None
    _executor_lock = threading.Lock()

    @abstractmethod
    async def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        """Move ``src`` to ``dst``; raise on failure."""

    @property
    def name(self) -> str:
        return route_name(self.direction)

    def check_media(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        if (src.medium, dst.medium) != tuple(self.direction):
            raise ValueError(
                f"{type(self).__name__} handles {self.name}, got "
                f"{Medium(src.medium).value}->{Medium(dst.medium).value}"
            )

    def _get_executor(self) -> ThreadPoolExecutor:
        with TransferHandler._executor_lock:
            if self._executor is None:
                workers = max(1, int(self.concurrency)) * max(1, int(self.threads_per_job))
                self._executor = ThreadPoolExecutor(
                    max_workers=workers, thread_name_prefix=f"kvtier-{self.name}"
                )
            return self._executor

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on this handler's threads and await its result."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._get_executor(), fn, *args)

    def close(self, wait: bool = True) -> None:
        """Release the handler's threads (the engine calls this on ``close``; ``wait=False`` when
        a job is stuck). A closed handler may be used again: its pool is recreated on demand."""
        with TransferHandler._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=wait)


class ImmediateHandler(TransferHandler):
    """A handler whose hops are *enqueued on the caller's thread* and run on a device queue.

    Why: a GPU copy is asynchronous already; handing it to the event-loop thread only adds
    thread hops, and every hop must win the GIL from vLLM's busy engine thread (up to the
    5 ms switch interval each time). Enqueued where it is submitted, a copy starts within
    microseconds and is ordered on the GPU (``start`` records the caller's stream position;
    ``fence`` makes the caller's stream wait for the copy) instead of by host syncs. The engine
    polls ``poll`` from the caller's thread (``get_finished`` / ``wait``); nothing here runs on
    the event loop.
    """

    immediate = True

    @abstractmethod
    def start(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> Any:
        """Validate and enqueue the hop (after the work already on the caller's stream);
        return a handle for ``poll``/``fence``/``finish``. Raise on bad input."""

    @abstractmethod
    def poll(self, pending: Any) -> TransferOutcome | None:
        """The hop's outcome once the device finished it, else ``None``. Never blocks."""

    @abstractmethod
    def fence(self, pending: Any) -> None:
        """Order work the caller enqueues from now on after this hop (on the device)."""

    def fence_layer(self, pending: Any, layer: int) -> None:
        """``fence`` for the pages of one layer only; handlers that copy a hop layer by layer
        override it (the rest fence the whole hop, which is always correct)."""
        self.fence(pending)

    @abstractmethod
    def finish(self, pending: Any) -> TransferOutcome:
        """Block until the hop is done and return its outcome."""

    #: the smallest hop ``prefetch`` starts early; None: this handler never prefetches
    prefetch_min_bytes: int | None = None

    def prefetch(self, src: LoadStoreSpec, whole: bool = False) -> bool:
        """Hint: the next hop started here will probably read ``src``; a handler may begin
        reading it now (the CUDA load's host -> staging half, :mod:`kvtier.transfer.cuda.
        prefetch`). The next ``start`` uses it if its source is exactly ``src`` and drops it
        otherwise. ``whole``: that hop's destination will be ``whole``
        (``LoadStoreSpec.whole``). True if something was started. Default: nothing."""
        return False

    def drop_prefetch(self) -> None:
        """Forget an unused prefetch (its source may be reassigned from now on)."""

    async def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        """Start the hop and await it (for direct use, e.g. tests; the engine never calls it)."""
        pending = self.start(src, dst)
        delay = 20e-6
        while (out := self.poll(pending)) is None:
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2e-4)
        return out
