"""vLLM's engine loop with async scheduling, for the CPU rig.

On a GPU vLLM schedules step N+1, and runs its worker hooks and enqueues its forward, before
step N's sampled tokens reach the scheduler (``EngineCore.step_with_batch_queue`` with a queue
of two). A request's first token is therefore returned only after the next step was scheduled
and launched: whatever the connector does in that step sits on the first token's path. vLLM's
CPU platform turns async scheduling off, so this loop drives the real ``AsyncScheduler`` the
way the engine core does, and the fake forward reads the tokens sampled but not delivered yet
(the GPU runner has them on the device).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import vllm_harness as vh


class AsyncEngineLoop(vh.EngineLoop):
    queue_size = 2  # vLLM's batch queue with async scheduling (pipeline parallelism: more)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queue: deque = deque()
        self.pending: dict[str, list[int]] = {}  # sampled, not delivered to the scheduler yet
        # ("scheduled" | "delivered", SchedulerOutput), in the order the engine core does them
        self.order: list[tuple[str, Any]] = []

    def tokens(self, req: Any) -> Sequence[int]:
        return list(req.all_token_ids) + self.pending.get(req.request_id, [])

    def execute(self, so: Any) -> Any:
        merged = super().execute(so)
        for rid, toks in zip(merged.req_ids, merged.sampled_token_ids):
            if toks:
                self.pending.setdefault(rid, []).extend(toks)
        return merged

    def step(self) -> vh.StepRecord | None:
        """One ``step_with_batch_queue``: None while it only filled the queue."""
        sched = self.scheduler
        if sched.has_requests():
            so = sched.schedule()
            self.order.append(("scheduled", so))
            self.queue.appendleft((so, self.execute(so)))
            if len(self.queue) < self.queue_size and (
                    so.total_num_scheduled_tokens > 0 or sched.has_requests()):
                return None
        elif not self.queue:
            return None
        so, merged = self.queue.pop()
        rec = self.deliver(so, merged)
        self.order.append(("delivered", so))
        for rid, toks in zip(merged.req_ids, merged.sampled_token_ids):
            left = self.pending.get(rid)
            if left:
                del left[:len(toks)]
            if rid not in sched.requests:
                self.pending.pop(rid, None)
        return rec

    def busy(self) -> bool:
        return super().busy() or bool(self.queue)
