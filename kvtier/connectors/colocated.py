"""A worker in the scheduler's own process and thread: a synchronous load starts when planned.

Why: on an H100, vLLM spends ~3 ms between the end of ``schedule()`` and the connector's first
worker hook of the step (the model runner adds the new request's 8k prompt to its persistent
batch and prepares inputs first; the timeline of ``benchmarks/vllm_e2e.py``), and a CPU hit of
an 8k prompt is a ~20 ms copy. With one worker in the engine-core process (TP 1 and vLLM's
uni-process executor: ``vllm serve`` and ``LLM`` both run that way) the scheduler side hands a
synchronous load to that worker as soon as it planned it (``update_state_after_alloc``: the
engine blocks are the request's from then on), and the copy runs during those milliseconds.

The hand-off is taken only when it is safe to call the worker directly: same engine (vLLM's
``engine_id``), one worker, and the scheduler running on the thread that runs the worker's
step hooks (the worker side is single-threaded). Anything else takes the usual path: the
worker submits the load at its first hook of the step. Ordering on the GPU is the usual one:
the copy waits for the device work enqueued so far, and stores still reading the blocks it
overwrites are fenced first.
"""

from __future__ import annotations

import threading
from typing import Any

_workers: dict[str, Any] = {}  # engine id -> the worker side registered in this process
_lock = threading.Lock()


def register(engine_id: str, worker: Any) -> None:
    if engine_id:
        with _lock:
            _workers[engine_id] = worker


def unregister(engine_id: str, worker: Any) -> None:
    with _lock:
        if _workers.get(engine_id) is worker:
            del _workers[engine_id]


def worker_for(engine_id: str) -> Any | None:
    """The worker side of this engine if the calling thread may drive it directly."""
    with _lock:
        worker = _workers.get(engine_id) if engine_id else None
    if worker is None or worker.hook_thread != threading.get_ident():
        return None
    return worker
