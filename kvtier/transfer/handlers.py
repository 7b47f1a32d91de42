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

    def on_submit(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        """Called on the submitting thread before the job is queued. CUDA handlers record the
        caller's stream position here so a store cannot read pages the compute has not
        written yet; CPU handlers need nothing."""

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
