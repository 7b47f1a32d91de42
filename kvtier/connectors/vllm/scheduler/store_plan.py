"""Planning stores on the scheduler side: which of a request's blocks to copy out, when.

A store is planned for the blocks a request completed in earlier steps (``store_stop``), with
one slice of keys and engine blocks per request: a prompt's whole store is planned in one
scheduler step, which sits on the first token's path when the store cannot wait
(``first_token_pending`` says when it can). The planner also remembers which engine blocks
unsettled stores still copy out of (``reading``): a step that rewrites one of them fences
those stores first; settling a store releases its blocks (``released``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from kvtier.connectors.vllm.compat.req_data import written_block_ids
from kvtier.connectors.vllm.metadata import LoadJob, StoreJob
from kvtier.connectors.vllm.scheduler.ledger import JobLedger
from kvtier.connectors.vllm.scheduler.requests import KeyMap, RequestTrack
from kvtier.connectors.vllm.settings import ConnectorSettings
from kvtier.connectors.vllm.stats import KVTierStats
from kvtier.manager.abstract import OffloadingManager
from kvtier.manager.specs import BlockKey, RequestContext

# (request, kvtier block index, key): describe a stored block for the event streams
Remember = Callable[[Any, int, BlockKey], None]


class StorePlanner:
    def __init__(self, settings: ConnectorSettings, keymap: KeyMap, manager: OffloadingManager,
                 ledger: JobLedger, stats: KVTierStats, remember: Remember | None) -> None:
        self._settings = settings
        self._keymap = keymap
        self._manager = manager
        self._ledger = ledger
        self._stats = stats
        self._remember = remember  # None: no event stream publishes what a block holds
        self._sources: dict[int, set[int]] = {}  # engine block -> unsettled stores reading it

    def store_stop(self, t: RequestTrack, scheduled: int = 0) -> int:
        """Index past the last kvtier block that is full and computed once ``scheduled`` more
        tokens are.

        build_connector_meta runs before vLLM adds the current step's tokens, so with
        ``scheduled`` 0 this counts the blocks of earlier steps only, whose forwards the worker
        enqueued before this step's hooks; tokens not known yet (speculative drafts) are never
        stored."""
        request = t.request
        computed = min(request.num_computed_tokens + scheduled, request.num_tokens)
        stop = min(computed // self._settings.block_tokens * self._keymap.per_block,
                   self._keymap.num_keyed(request))
        if self._settings.offload_prompt_only:
            return min(stop, self._prompt_blocks(request))
        return stop

    def plan(self, t: RequestTrack, kv_cache_manager: Any, scheduled: int = 0
             ) -> StoreJob | None:
        """The store of ``t``'s blocks completed so far (``scheduled`` > 0: and by this step).
        ``kv_cache_manager``: vLLM's, which holds the request's block table (None: not bound
        yet, nothing is stored)."""
        request = t.request
        if t.params.skip_store or kv_cache_manager is None:
            return None
        bt = self._settings.block_tokens
        stop = self.store_stop(t, scheduled)
        first = t.next_store
        if stop <= first:
            return None
        t.next_store = stop
        km = self._keymap
        block_ids = km.table(kv_cache_manager.get_block_ids(t.req_id))
        cand = km.allocated(block_ids, first, stop)
        if not cand:
            return None
        keys = (km.keys(request, first, stop) if len(cand) == stop - first
                else [km.key(request, i) for i in cand])
        index = dict(zip(keys, cand))
        if len(index) < len(keys):  # a repeated key (hash collision): plan it once
            keys = list(index)
        parent = km.parent_index(cand[0])
        ctx = RequestContext(
            request_id=t.req_id, first_block_index=cand[0],
            num_prompt_blocks=self._prompt_blocks(request),
            offload_ratio=t.params.offload_ratio, max_offload_tokens=t.params.max_offload_tokens,
            block_tokens=bt, parent_key=km.key(request, parent) if parent >= 0 else None,
            hints=t.hints,
        )
        plan = self._manager.prepare_store(keys, ctx)
        if not plan.keys:
            return None
        if len(index) == len(cand) and tuple(plan.keys) == tuple(keys):  # every block stored
            planned = cand
        else:
            planned = [index[k] for k in plan.keys]
        gpu = km.gpu_ids_of(block_ids, planned)
        job_id = self._ledger.next_id()
        t.store_jobs.add(job_id)
        for b in gpu:
            self._sources.setdefault(b, set()).add(job_id)
        if self._remember is not None:
            for k, i in zip(plan.keys, planned):
                self._remember(request, i, k)
        self._stats.add("store_tokens", len(plan.keys) * bt)
        return self._ledger.add(StoreJob(job_id, t.req_id, tuple(plan.keys),
                                         tuple(plan.cpu_slots), gpu, this_step=scheduled > 0))

    def written_blocks(self, so: Any, loads: Iterable[LoadJob]) -> set[int]:
        """Engine blocks this step writes: newly allocated ones (computed, or loaded into by
        the step's ``loads``) and copy-on-write destinations. A pending store reading one of
        them must finish first."""
        out = written_block_ids(so, self._settings.block_size)  # every group's
        for job in loads:
            out.update(job.gpu_ids)
        out.discard(0)
        return out

    def reading(self, blocks: Iterable[int]) -> list[int]:
        """Unsettled store jobs that still copy out of any of these engine blocks."""
        if not self._sources:
            return []
        return sorted({j for b in blocks for j in self._sources.get(b, ())})

    def released(self, job_id: int, gpu_ids: Iterable[int]) -> None:
        """Store ``job_id`` settled: it no longer reads its source blocks."""
        for b in gpu_ids:
            jobs = self._sources.get(b)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del self._sources[b]

    def _prompt_blocks(self, request: Any) -> int:
        """kvtier blocks that ``request``'s prompt fills completely."""
        return request.num_prompt_tokens // self._settings.block_tokens * self._keymap.per_block

    def can_wait(self, t: RequestTrack) -> bool:
        """Whether ``t``'s due store may wait for the next store step: a running request
        whose prompt blocks were all planned already (only decoded blocks are due)."""
        return not t.finished and t.next_store >= self._prompt_blocks(t.request)

    @staticmethod
    def first_token_pending(t: RequestTrack) -> bool:
        """Its prompt is computed but its first token not returned yet: only with vLLM's async
        scheduling, where this step is scheduled and launched before the prompt step's output
        is processed, so planning and submitting the prompt's store here would delay that
        token (docs/design-measurements.md has the figure). The store waits one more step;
        its blocks stay held (a running request's, or a finished one's through
        ``request_finished``)."""
        r = t.request
        return (not t.finished and r.num_output_tokens == 0
                and r.num_computed_tokens >= r.num_prompt_tokens)
