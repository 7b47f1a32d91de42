"""The ``bench --compare`` table as a terminal shows it: markdown (pastable into notes and
issues) that fits 80 columns.

The headers are one word each (spelled out, "gap closed" and "writes vs LRU" take 86
columns); the intro above the table, wrapped at 80, says what each one means.
"""

from __future__ import annotations

import textwrap
from typing import Sequence

from kvtier.bench.compare import gap_closed
from kvtier.bench.sim_result import SimResult

WIDTH = 80
HEADER = "| C | policy | block hit | token hit | written | wasted | gap | writes |"
LEGEND = ("C = capacity in 512-token trace blocks; written = blocks stored; wasted = written, "
          "evicted unread; gap = share of the LRU->Belady hit-rate gap closed; writes = "
          "written relative to LRU")


def intro(trace_name: str, requests: int, lookups: int, seconds: float) -> str:
    head = (f"kvtier bench --compare: {trace_name}, {requests:,} requests, {lookups:,} block "
            f"lookups, {seconds:.1f}s")
    return "\n".join(textwrap.wrap(head, WIDTH, break_on_hyphens=False)
                     + textwrap.wrap(LEGEND, WIDTH, break_on_hyphens=False))


def table(results: Sequence[SimResult], ceiling: SimResult | None = None) -> str:
    rows = [HEADER, "|---|---|--:|--:|--:|--:|--:|--:|"]
    by_capacity: dict[int, list[SimResult]] = {}
    for r in results:
        by_capacity.setdefault(r.capacity, []).append(r)
    for c, rs in by_capacity.items():
        lru = next((r for r in rs if r.policy == "lru"), None)
        best = next((r for r in rs if r.policy.startswith("belady")), None)
        for r in rs:
            gap = gap_closed(r, lru, best) if lru and best else None
            writes = f"{r.written / lru.written:.0%}" if lru and lru.written else "-"
            rows.append(f"| {c:,} | {r.policy} | {r.hit_rate:.1%} | {r.token_hit_rate:.1%} | "
                        f"{r.written / 1000:.1f}k | {r.wasted / 1000:.1f}k | "
                        f"{'-' if gap is None else f'{gap:.0%}'} | {writes} |")
    if ceiling is not None:
        rows.append(f"| inf | infinite | {ceiling.hit_rate:.1%} | {ceiling.token_hit_rate:.1%} "
                    f"| {ceiling.written / 1000:.1f}k | - | - | - |")
    return "\n".join(rows)
