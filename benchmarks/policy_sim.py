"""Offline replay of a request trace against eviction/admission plug-ins (no tensors, no I/O).

One cache of ``capacity`` blocks with prefix semantics: a request hits the longest resident
prefix of its keys; the rest is then stored, admission permitting, evicting through the policy
when full. The plug-ins are driven through exactly the calls the real manager makes
(``record_lookup``/``on_hit``/``on_evict``/``admit`` and ``insert(key, parent)``/``access``/
``remove``/``victims(n, evictable)``), so a policy that wins here wins there.

Replay conventions (the manager should follow the same ones):

- hits are touched last-to-first, so a prefix's first block ends up the most recent
  (vLLM's ``touch`` does the same: a root is needed whenever any of its descendants is);
- new blocks are stored in prompt order after the hits were touched;
- storing stops at the first block admission refuses: under prefix semantics the blocks behind a
  missing one are unreachable until it is stored, so writing them wastes bandwidth;
- the request's own hit blocks are pinned (being loaded) while room is made.

Run ``python benchmarks/policy_sim.py --help`` for the comparison table. ``kvtier bench
--compare`` replays the same trace through the real manager instead; a test asserts that both
give the same numbers for the same spec.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: kvtier too

from kvtier.bench.compare import HINTS, gap_closed, infinite, parse_spec  # noqa: E402
from kvtier.bench.compare import compare as manager_compare  # noqa: E402
from kvtier.bench.sim_result import SimResult  # noqa: E402
from kvtier.bench.trace import TraceRequest, load_trace  # noqa: E402
from kvtier.manager.admission import AdmissionPolicy, make_admission  # noqa: E402
from kvtier.manager.policies import EvictionPolicy, make_policy  # noqa: E402

# Plug-ins register themselves on import (until the package's __init__ imports it).
from kvtier.manager.admission import reuse_gate as _reuse_gate  # noqa: F401,E402
from kvtier.manager.admission.reuse_gate import ReuseGate  # noqa: E402
from kvtier.manager.hints import KEEP, ONE_OFF, HintBook, RetentionHint  # noqa: E402
from kvtier.manager.policies.hinted import HintedEviction  # noqa: E402


class _Cache:
    """The replayed tier: residency, hit bookkeeping, and the two plug-ins."""

    def __init__(self, capacity: int, policy: EvictionPolicy, admission: AdmissionPolicy) -> None:
        self.capacity = capacity
        self.policy = policy
        self.admission = admission
        self.hits_since_store: dict[int, int] = {}  # resident key -> hits since written

    def evict(self, n: int, pinned: set[int], res: SimResult) -> int:
        victims = self.policy.victims(n, lambda k: k not in pinned) if n > 0 else []
        for v in victims:
            if v not in self.hits_since_store or v in pinned:
                raise RuntimeError(f"policy {self.policy.name!r} offered a non-evictable key {v!r}")
            if self.hits_since_store.pop(v) == 0:
                res.wasted += 1
            self.policy.remove(v)
            self.admission.on_evict(v)
        res.evicted += len(victims)
        return len(victims)


def simulate(
    trace: Sequence[TraceRequest],
    capacity: int,
    spec: str = "lru",
    policy: EvictionPolicy | None = None,
    admission: AdmissionPolicy | None = None,
) -> SimResult:
    """Replay ``trace`` through one tier of ``capacity`` blocks using the plug-ins named by
    ``spec`` (or the given instances)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    ev_name, adm_name = parse_spec(spec)
    if policy is None:
        policy = make_policy(ev_name, capacity)
    if admission is None:
        admission = make_admission(adm_name, threshold=2, capacity_blocks=capacity)
    book = None
    if spec.endswith(HINTS):  # a router that knows which conversations continue
        book = HintBook(max(1, capacity // 2), clock=lambda: 0.0)
        policy = HintedEviction(policy, book)
        if isinstance(admission, ReuseGate):
            admission.hints = book
    cache = _Cache(capacity, policy, admission)
    resident = cache.hits_since_store
    res = SimResult(spec, capacity)
    t0 = time.perf_counter()
    for req in trace:
        keys = req.hash_ids
        n = len(keys)
        res.blocks += n
        res.tokens += req.input_length
        if book is not None and req.continues is not None:
            book.note(keys, RetentionHint(KEEP if req.continues else ONE_OFF))
        admission.record_lookup(keys)
        k = 0
        while k < n and keys[k] in resident:
            k += 1
        for i in range(k - 1, -1, -1):
            key = keys[i]
            resident[key] += 1
            admission.on_hit(key)
            policy.access(key)
            res.hit_tokens += req.block_tokens(i)
        res.hit_blocks += k
        if k == n:
            continue
        to_store: list[int] = []
        for i in range(k, n):
            key = keys[i]
            if key in resident:  # resident behind a gap: keep it, it becomes reachable again
                policy.access(key)
                continue
            if not admission.admit(key):
                break
            to_store.append(i)
        if not to_store:
            continue
        pinned = set(keys[:k])
        need = len(resident) + len(to_store) - capacity
        if need > 0:
            got = cache.evict(need, pinned, res)
            if got < need:  # too little evictable room: store the leading part that fits
                del to_store[len(to_store) - (need - got):]
        for i in to_store:
            key = keys[i]
            resident[key] = 0
            policy.insert(key, keys[i - 1] if i else None)
        res.written += len(to_store)
    res.seconds = time.perf_counter() - t0
    return res


def compare(
    trace: Sequence[TraceRequest], capacities: Sequence[int], specs: Sequence[str],
    with_belady: bool = True, run=None,
) -> list[SimResult]:
    """:func:`kvtier.bench.compare.compare` (every spec at every capacity, then Belady's two
    bounds) with this simulator as the default ``run``."""
    return manager_compare(trace, capacities, specs, with_belady, run=run or simulate)


def _by_capacity(results: Sequence[SimResult]) -> dict[int, list[SimResult]]:
    by_c: dict[int, list[SimResult]] = {}
    for r in results:
        by_c.setdefault(r.capacity, []).append(r)
    return by_c


def format_table(results: Sequence[SimResult], ceiling: SimResult | None = None) -> str:
    """Markdown: one row per (capacity, policy); gap closed is relative to LRU and Belady."""
    rows = [
        "| C | policy | block hit | token hit | written | wasted | gap closed | writes vs LRU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c, rs in _by_capacity(results).items():
        lru = next((r for r in rs if r.policy == "lru"), None)
        best = next((r for r in rs if r.policy.startswith("belady")), None)
        for r in rs:
            gap = gap_closed(r, lru, best) if lru and best else None
            wr = f"{r.written / lru.written:.0%}" if lru and lru.written else "-"
            rows.append(
                f"| {c:,} | {r.policy} | {r.hit_rate:.1%} | {r.token_hit_rate:.1%} | "
                f"{r.written / 1000:.1f}k | {r.wasted / 1000:.1f}k | "
                f"{'-' if gap is None else f'{gap:.0%}'} | {wr} |"
            )
    if ceiling is not None:
        rows.append(f"| inf | infinite | {ceiling.hit_rate:.1%} | {ceiling.token_hit_rate:.1%} | "
                    f"{ceiling.written / 1000:.1f}k | - | - | - |")
    return "\n".join(rows)


def format_summary(results: Sequence[SimResult]) -> str:
    """One row per policy, one cell per capacity: hit-rate difference to LRU in points and
    the share of LRU's writes; the last column is the worst difference (the "never loses to
    LRU" check at a glance)."""
    by_c = _by_capacity(results)
    caps = list(by_c)
    cells: dict[str, list[str]] = {}
    worst: dict[str, float] = {}
    for c in caps:
        rs = by_c[c]
        lru = next((r for r in rs if r.policy == "lru"), None)
        if lru is None:
            continue
        for r in rs:
            if r.policy == "lru" or r.policy.startswith("belady"):
                continue
            d = r.hit_rate - lru.hit_rate
            ratio = r.written / lru.written if lru.written else 1.0
            cells.setdefault(r.policy, []).append(f"{d * 100:+.1f} / {ratio:.0%}")
            worst[r.policy] = min(worst.get(r.policy, d), d)
    head = "| policy | " + " | ".join(f"C={c:,}" for c in caps) + " | worst |"
    rows = [head, "|---" * (len(caps) + 2) + "|"]
    for name, v in cells.items():
        rows.append(f"| {name} | " + " | ".join(v) + f" | {worst[name] * 100:+.2f} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    from trace_gen import SHAPES, generate

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake jsonl trace")
    src.add_argument("--shape", choices=SHAPES, help="replay a generated trace instead")
    ap.add_argument("--seed", type=int, default=0, help="seed of --shape")
    ap.add_argument("--requests", type=int, default=4000, help="requests of --shape")
    ap.add_argument("--capacity-blocks", default="1000,4000,16000")
    ap.add_argument("--policies", default="arc,lru+reuse_gate",
                    help="comma list of eviction[+admission]; lru is always run")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--no-belady", action="store_true", help="skip the offline bounds")
    ap.add_argument("--summary", action="store_true", help="one line per policy vs LRU")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.trace:
        trace = load_trace(args.trace, args.limit)
    else:
        trace = generate(args.shape, args.requests, args.seed)[: args.limit]
    caps = [int(c) for c in args.capacity_blocks.split(",") if c.strip()]
    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    results = compare(trace, caps, specs, with_belady=not args.no_belady)
    ceiling = infinite(trace)
    if args.json:
        json.dump([r.as_dict() for r in results + [ceiling]], sys.stdout, indent=1)
        print()
    elif args.summary:
        print(format_summary(results))
    else:
        print(format_table(results, ceiling))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
