"""The one channel from the scheduler side to a worker side in the same process and thread.

Why: vLLM spends milliseconds between the end of ``schedule()`` and the connector's first
worker hook of the step (the model runner adds the new requests to its persistent batch and
prepares inputs first), while a CPU hit of a long prompt is a copy of tens of milliseconds.
With one worker in the engine-core process (TP 1 and vLLM's uni-process executor: ``vllm
serve`` and ``LLM`` both run that way) the scheduler side hands a synchronous load to that
worker as soon as it planned it (``update_state_after_alloc``: the engine blocks are the
request's from then on), and the copy runs during those milliseconds.

vLLM builds the two halves separately, so :class:`KVTierConnector` (the composition root)
gives both halves of one engine the same :class:`WorkerHandoff`, found by vLLM's
``engine_id`` with :func:`handoff_for`: the worker attaches itself, the scheduler asks
:meth:`WorkerHandoff.worker_here`. Nothing else crosses between the halves outside the
per-step metadata. The hand-off is taken only when it is safe to call the worker directly:
a worker attached and the scheduler running on the thread that runs the worker's step hooks
(the worker side is single-threaded). Anything else takes the usual path: the worker submits
the load at its first hook of the step.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvtier.connectors.vllm.metadata import LoadJob


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
