"""Planning stores on the scheduler side: which of a request's blocks to copy out, when.

A mixin of :class:`~kvtier.connectors.vllm.scheduler.side.SchedulerSide` (its state: ``settings``,
``keymap``, ``manager``, ``ledger``, ``kv_cache_manager``, ``_sources``, ``_step_loads``,
``_describe``, ``_events``, ``_stats``). A store is planned for the blocks a request completed
in earlier steps (``_store_stop``), with one slice of keys and engine blocks per request: a
prompt's whole store is planned in one scheduler step, which sits on the first token's path
when the store cannot wait (``_first_token_pending`` says when it can).
"""

from __future__ import annotations

from typing import Any, Iterable

from kvtier.connectors.vllm.compat.req_data import written_block_ids
from kvtier.connectors.vllm.scheduler.ledger import Job
from kvtier.connectors.vllm.metadata import StoreJob
from kvtier.connectors.vllm.scheduler.requests import RequestTrack
from kvtier.manager.specs import BlockKey, RequestContext


class StorePlanning:
    def _remember(self, request: Any, index: int, key: BlockKey) -> None:
        if not self._describe:
            return
        before = self.keymap.parent_index(index)
        parent = self.keymap.key(request, before) if before >= 0 else None
        lora = getattr(request, "lora_request", None)
        self._events.remember(key, self.keymap.tokens(request, index), parent,
                              getattr(lora, "lora_name", None))

    def _store_stop(self, t: RequestTrack, scheduled: int = 0) -> int:
        """Index past the last kvtier block that is full and computed once ``scheduled`` more
        tokens are.

        build_connector_meta runs before vLLM adds the current step's tokens, so with
        ``scheduled`` 0 this counts the blocks of earlier steps only, whose forwards the worker
        enqueued before this step's hooks; tokens not known yet (speculative drafts) are never
        stored."""
        request = t.request
        computed = min(request.num_computed_tokens + scheduled, request.num_tokens)
        return min(computed // self.settings.block_tokens * self.keymap.per_block,
                   self.keymap.num_keyed(request))

    def _plan_store(self, t: RequestTrack, scheduled: int = 0) -> StoreJob | None:
        """The store of ``t``'s blocks completed so far (``scheduled`` > 0: and by this step)."""
        request = t.request
        if t.params.skip_store or self.kv_cache_manager is None:
            return None
        bt, per = self.settings.block_tokens, self.keymap.per_block
        stop = self._store_stop(t, scheduled)
        first = t.next_store
        if stop <= first:
            return None
        t.next_store = stop
        km = self.keymap
        block_ids = km.table(self.kv_cache_manager.get_block_ids(t.req_id))
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
            num_prompt_blocks=request.num_prompt_tokens // bt * per,
            offload_ratio=t.params.offload_ratio, max_offload_tokens=t.params.max_offload_tokens,
            block_tokens=bt, parent_key=km.key(request, parent) if parent >= 0 else None,
            hints=t.hints,
        )
        plan = self.manager.prepare_store(keys, ctx)
        if not plan.keys:
            return None
        if len(index) == len(cand) and tuple(plan.keys) == tuple(keys):  # every block stored
            planned = cand
        else:
            planned = [index[k] for k in plan.keys]
        gpu = km.gpu_ids_of(block_ids, planned)
        job_id = self.ledger.add(Job("store", t.req_id, tuple(plan.keys), gpu_ids=gpu))
        t.store_jobs.add(job_id)
        for b in gpu:
            self._sources.setdefault(b, set()).add(job_id)
        if self._describe:
            for k, i in zip(plan.keys, planned):
                self._remember(request, i, k)
        self._stats.add("store_tokens", len(plan.keys) * bt)
        return StoreJob(job_id, t.req_id, tuple(plan.keys), tuple(plan.cpu_slots), gpu,
                        this_step=scheduled > 0)

    def _written_blocks(self, so: Any) -> set[int]:
        """Engine blocks this step writes: newly allocated ones (computed or loaded into) and
        copy-on-write destinations. A pending store reading one of them must finish first."""
        out = written_block_ids(so, self.settings.block_size)  # every group's
        for job in self._step_loads:
            out.update(job.gpu_ids)
        out.discard(0)
        return out

    def _stores_reading(self, blocks: Iterable[int]) -> list[int]:
        """Unsettled store jobs that still copy out of any of these engine blocks."""
        if not self._sources:
            return []
        return sorted({j for b in blocks for j in self._sources.get(b, ())})

    @staticmethod
    def _first_token_pending(t: RequestTrack) -> bool:
        """Its prompt is computed but its first token not returned yet: only with vLLM's async
        scheduling, where this step is scheduled and launched before the prompt step's output
        is processed, so planning and submitting the prompt's store here would delay that
        token (a 2k-token 1B prompt: ~4 ms on the lent H100's host). The store waits one more
        step; its blocks stay held (a running request's, or a finished one's through
        ``request_finished``)."""
        r = t.request
        return (not t.finished and r.num_output_tokens == 0
                and r.num_computed_tokens >= r.num_prompt_tokens)

