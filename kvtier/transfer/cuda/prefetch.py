"""A load's first pieces copied into the staging ring before its engine blocks are known.

Why: a CPU hit's copy can start only once the scheduler has allocated the request's engine
blocks and planned the load (``update_state_after_alloc``), milliseconds after the lookup for
a long prompt (docs/design-measurements.md). The host -> staging half of a layered load
(:mod:`direct`) needs only the CPU slots, which the lookup already knows. So the scheduler
names the slots at the lookup and the first pieces (as many as the ring has buffers) are on
the wire while vLLM allocates; the load, once planned, scatters them and copies the rest.

Safety: the prefetch only *reads* pinned slots into staging buffers that nothing else uses
until it is consumed or dropped. The load consumes it only if its slots are exactly the
prefetched ones, in the same scheduler pass (the scheduler drops an unconsumed prefetch before
anything else can reassign a slot: READY slots are never rewritten before eviction, and nothing
evicts between a lookup and its own plan). Anything else given to the handler first drops it,
so the ring's buffers are always taken and freed in order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class Prefetch:
    """``runs``: the slots' runs of neighbours, as the load needs them; ``pieces``: ((layer, first block, end block), ring buffer index) in copy order;
    ``started`` / ``done``: timing events around the prefetched DMAs (the DMA stream);
    ``settled``: a load consumed it or its buffers were given back (exactly one of the two)."""

    slots: tuple[int, ...]
    runs: list[tuple[int, int, int]]  # the slots' runs (DirectLayerLoader._runs): reused
    pieces: tuple[tuple[tuple[int, int, int], int], ...]
    started: torch.cuda.Event
    done: torch.cuda.Event
    settled: bool = False

    def matches(self, slots: Sequence[int]) -> bool:
        return len(slots) == len(self.slots) and tuple(slots) == self.slots
