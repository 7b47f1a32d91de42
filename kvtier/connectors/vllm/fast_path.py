"""The fast path: with TP 1 the scheduler side drives its own engine's worker directly.

Why: vLLM spends milliseconds between the end of ``schedule()`` and the connector's first
worker hook of the step, and between ``get_num_new_matched_tokens`` and
``update_state_after_alloc`` it allocates the request's blocks; a CPU hit of a long prompt is
a copy of tens of milliseconds. With one worker in the engine-core process (TP 1 and vLLM's
uni-process executor, as ``vllm serve`` and ``LLM`` run) the scheduler side can start that
copy early, twice (figures: docs/design-measurements.md):

* at the lookup (``FastPath.prefetch``): the worker's load handler starts the host -> staging
  half of the hit's first pieces (:class:`kvtier.transfer.cuda.direct.Prefetch`). The load planned
  right after uses them if its slots are the same; any other step of the scheduler drops an
  unused prefetch first (``FastPath.drop``), so a prefetch never outlives the pass in which
  its slots were read as READY;
* when the load is planned (``FastPath.submit``): the engine blocks are the request's from
  then on, so the worker submits the synchronous load at once instead of at its first hook.

Both halves of one engine share a :class:`WorkerHandoff`, found by vLLM's ``engine_id`` with
:func:`handoff_for`. The worker is called only from the thread that runs its step hooks (the
worker side is single-threaded). Anything else, or the switch off
(``kv_connector_extra_config.same_thread_fast_path: false``), takes the usual path."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    from kvtier.connectors.vllm.metadata import LoadJob
    from kvtier.manager.specs import BlockKey


class ColocatedWorker(Protocol):
    """What the scheduler side may ask of a worker side in its own thread."""

    hook_thread: int | None  # the thread vLLM runs the worker's step hooks on

    def submit_ahead(self, job: "LoadJob", flush: tuple[int, ...]) -> None:
        """Submit a synchronous load as soon as it is planned."""

    def prefetch_min_bytes(self) -> int | None:
        """The smallest hit worth a prefetch; None when this worker takes none."""

    def prefetch_load(self, slots: list[int], whole: bool = False) -> bool:
        """Start a CPU hit's copy at the lookup; False when it did not start."""

    def drop_prefetch(self) -> None:
        """Drop a prefetch no load used."""


class WorkerHandoff:
    """The worker side of one engine in this process, if any (attach / detach / worker_here)."""

    def __init__(self) -> None:
        self._worker: ColocatedWorker | None = None
        self._lock = threading.Lock()

    def attach(self, worker: ColocatedWorker) -> None:
        with self._lock:
            self._worker = worker

    def detach(self, worker: ColocatedWorker) -> None:
        with self._lock:
            if self._worker is worker:
                self._worker = None

    def worker_here(self) -> ColocatedWorker | None:
        """The worker if the calling thread may drive it directly, else None."""
        with self._lock:
            worker = self._worker
        if worker is None or worker.hook_thread != threading.get_ident():
            return None
        return worker


_by_engine: dict[str, WorkerHandoff] = {}
_by_engine_lock = threading.Lock()


def handoff_for(engine_id: str) -> WorkerHandoff:
    """The hand-off both halves of engine ``engine_id`` share in this process. An engine
    without an id gets a hand-off of its own, which no worker ever reaches."""
    if not engine_id:
        return WorkerHandoff()
    with _by_engine_lock:
        return _by_engine.setdefault(engine_id, WorkerHandoff())


class FastPath:
    """The scheduler side's use of the hand-off; ``enabled`` is the one switch."""

    def __init__(self, handoff: WorkerHandoff, enabled: bool = True) -> None:
        self.handoff = handoff
        self.enabled = enabled
        self._prefetched: ColocatedWorker | None = None  # the worker holding an unused one

    def _worker(self) -> ColocatedWorker | None:
        return self.handoff.worker_here() if self.enabled else None

    def prefetch(self, manager: Any, keys: Sequence["BlockKey"], nbytes: int,
                 whole: bool = False) -> bool:
        """Prefetch the CPU hit ``keys`` (all READY in CPU memory, found by this lookup) if the
        worker takes a hint of ``nbytes`` (``whole``: its load will be ``LoadJob.whole``);
        True if a copy started."""
        self.drop()
        worker = self._worker()
        least = worker.prefetch_min_bytes() if worker is not None else None
        if least is None or nbytes < least:
            return False
        slots = manager.peek_cpu_slots(keys)
        if len(slots) != len(keys) or not worker.prefetch_load(list(slots), whole):
            return False
        self._prefetched = worker
        return True

    def submit(self, job: "LoadJob", flush: tuple[int, ...]) -> bool:
        """Hand a planned synchronous load to the worker now; False: it waits for the
        worker's first hook of the step."""
        worker = self._worker()
        if worker is None:
            return False
        worker.submit_ahead(job, flush)
        return True

    def drop(self) -> None:
        """Drop an unused prefetch (a used one is gone already: a no-op)."""
        worker, self._prefetched = self._prefetched, None
        if worker is not None:
            worker.drop_prefetch()
