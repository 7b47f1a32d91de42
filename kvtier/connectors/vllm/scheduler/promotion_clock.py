"""What a disk (or shared-tier) hit really costs a request: its promotion's wall time.

Why: the cost model used to learn a disk hit's cost from the worker's DISK -> CPU hop alone
(the seconds the read took). A request whose hit is promoted asynchronously waits longer than
that: for engine steps to see the read finish, then for the step that loads it into the GPU.
So disk hits whose reads are fast get loaded and still take longer than recomputing them:
the hop says "fast", the request says "slower" (figures:
docs/design-measurements.md). So the scheduler times each of its own promotions from planning to settling; the
hops keep teaching the tier's bandwidth (a wall time would fold a fixed wait into it, and a
1k hit's wait then made 8k hits look slower than they are), and the time beyond the hops
becomes the tier's fixed cost per load (``LoadCostModel.record_promotion``).

A promotion that reads from both the disk and the shared tier cannot split its wall time
between them: it teaches nothing (rare: a prefix whose blocks live on both).
"""

from __future__ import annotations

import time
from typing import Sequence

from kvtier.manager.specs import Medium


class PromotionClock:
    def __init__(self, block_bytes: int, clock=time.monotonic) -> None:
        self.block_bytes = block_bytes
        self._clock = clock
        self._started: dict[int, tuple[float, Medium, int]] = {}

    def started(self, job_id: int, from_disk: Sequence[bool], from_remote: Sequence[bool]
                ) -> None:
        """A load job was planned; times it if it promotes from exactly one timed tier."""
        disk, remote = sum(from_disk), sum(from_remote)
        if disk and not remote:
            self._started[job_id] = (self._clock(), Medium.DISK, disk)
        elif remote and not disk:
            self._started[job_id] = (self._clock(), Medium.REMOTE, remote)

    def settled(self, job_id: int, ok: bool) -> tuple[Medium, int, float] | None:
        """The (tier, bytes promoted, seconds from plan to settle) sample of a timed job that
        worked; None otherwise (a failed load measured nothing about the tier's speed)."""
        start = self._started.pop(job_id, None)
        if start is None or not ok:
            return None
        t0, medium, blocks = start
        return medium, blocks * self.block_bytes, self._clock() - t0

    def __len__(self) -> int:
        return len(self._started)
