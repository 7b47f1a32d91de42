"""Belady's offline optimum for ``--compare``: the upper bound a real policy is judged by.

Evict the resident block whose next use is farthest in the future. With prefix ids a block is
never used without its parent, so the parent's next use is never later than the child's; ties
evict the deeper block first, so the kept set stays a union of prefixes. ``skip_unused`` also
refuses to write blocks that are never used again or would be the first victim at once (their
next use is farther than every resident block's): same hits, far fewer writes. This needs the
future, so it runs offline with a lazy heap.
"""

from __future__ import annotations

import heapq
import time
from typing import Sequence

from kvtier.bench.sim_result import SimResult
from kvtier.bench.trace import TraceRequest

NEVER = 1 << 62


def next_uses(trace: Sequence[TraceRequest]) -> list[list[int]]:
    """For each request and block, the index of the next request that contains the block."""
    nxt: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in trace]
    for i in range(len(trace) - 1, -1, -1):
        keys = trace[i].hash_ids
        out[i] = [nxt.get(k, NEVER) for k in keys]
        for k in keys:
            nxt[k] = i
    return out


def belady(trace: Sequence[TraceRequest], capacity: int, skip_unused: bool = False) -> SimResult:
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    name = "belady-skip" if skip_unused else "belady"
    res = SimResult(name, capacity)
    t0 = time.perf_counter()
    uses = next_uses(trace)
    prio: dict[int, tuple[int, int]] = {}  # resident key -> (next use, depth)
    hits: dict[int, int] = {}  # resident key -> hits since written
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key), lazily invalidated

    def set_prio(key: int, nu: int, depth: int) -> None:
        prio[key] = (nu, depth)
        heapq.heappush(heap, (-nu, -depth, key))

    def top() -> tuple[int, int, int]:
        while True:
            nnu, nd, key = heap[0]
            if prio.get(key) == (-nnu, -nd):
                return -nnu, -nd, key
            heapq.heappop(heap)

    for i, req in enumerate(trace):
        keys, nu = req.hash_ids, uses[i]
        n = len(keys)
        res.blocks += n
        res.tokens += req.input_length
        k = 0
        while k < n and keys[k] in prio:
            hits[keys[k]] += 1
            res.hit_tokens += req.block_tokens(k)
            set_prio(keys[k], nu[k], k)
            k += 1
        res.hit_blocks += k
        for j in range(k, n):
            key = keys[j]
            if key in prio:
                set_prio(key, nu[j], j)
                continue
            if skip_unused and nu[j] == NEVER:
                continue
            if len(prio) < capacity:
                res.written += 1
                set_prio(key, nu[j], j)
                hits[key] = 0
                continue
            far_nu, far_d, far_key = top()
            if (nu[j], j) >= (far_nu, far_d):  # the new block is the farthest: it goes at once
                if not skip_unused:
                    res.written += 1
                    res.wasted += 1
                    res.evicted += 1
                continue
            res.written += 1
            heapq.heappop(heap)
            del prio[far_key]
            if hits.pop(far_key) == 0:
                res.wasted += 1
            res.evicted += 1
            set_prio(key, nu[j], j)
            hits[key] = 0
    res.seconds = time.perf_counter() - t0
    return res
