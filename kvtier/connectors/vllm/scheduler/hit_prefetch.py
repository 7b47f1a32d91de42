"""A synchronous CPU hit's copy started at the lookup, before vLLM allocates its blocks.

Why: between ``get_num_new_matched_tokens`` and ``update_state_after_alloc`` vLLM allocates the
request's blocks and kvtier pins and plans the load, milliseconds for a long prompt, all of
it before the copy (the hit's critical path) could start (figures:
docs/design-measurements.md). The lookup already knows the CPU slots, so with the worker in this thread
(:mod:`..handoff`) it names them to the worker, whose load handler starts the host -> staging
half of the copy's first pieces (:mod:`kvtier.transfer.cuda.prefetch`). The load planned right
after uses them if its slots are the same; any other step of the scheduler (the next lookup,
``build_meta``) drops an unused prefetch first, so a prefetch never outlives the pass in which
its slots were read as READY.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvtier.connectors.vllm.handoff import ColocatedWorker, WorkerHandoff
from kvtier.manager.specs import BlockKey, Medium


class HitPrefetch:
    def __init__(self, handoff: WorkerHandoff) -> None:
        self.handoff = handoff
        self._worker: ColocatedWorker | None = None  # the worker holding an unused prefetch

    def start(self, manager: Any, keys: Sequence[BlockKey], nbytes: int,
              whole: bool = False) -> bool:
        """Prefetch the CPU hit ``keys`` (all READY in CPU) if the worker takes a hint of
        ``nbytes`` (``whole``: its load will be ``LoadJob.whole``); True if a copy started."""
        self.drop()
        worker = self.handoff.worker_here()
        least = worker.prefetch_min_bytes() if worker is not None else None
        cpu = manager.tier(Medium.CPU) if least is not None and nbytes >= least else None
        if cpu is None:
            return False
        slots = cpu.ready_handles(keys)
        if len(slots) != len(keys) or not worker.prefetch_load(slots, whole):
            return False
        self._worker = worker
        return True

    def drop(self) -> None:
        """Drop an unused prefetch (used ones are gone already: a no-op)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.drop_prefetch()
