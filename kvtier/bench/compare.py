"""``kvtier bench --compare``: placement policies replayed through the real manager.

This module drives the ``TieredOffloadingManager`` itself (CPU tier only, capacity in trace
blocks) the way a connector does, so what it reports is what the manager would do in
production (its per-tier admission, touch order and stop-at-the-first-refused-block rule
included). No bytes move: every
``prepare_*`` is completed at once, so a long trace replays per policy and capacity without
a GPU, disk or server.

Per request (prefix semantics, one sighting per request): ``lookup`` of all the request's
blocks, ``prepare_load`` of the hits, ``prepare_store`` of the rest while the hits are still
pinned, then both completions. Belady's offline optimum is computed in the same run as the
upper bound, and an unbounded cache as the ceiling of every policy.
"""

from __future__ import annotations

import time
from typing import Sequence

from kvtier.bench.belady import belady
from kvtier.bench.sim_result import SimResult
from kvtier.bench.trace import TRACE_BLOCK_TOKENS, TraceRequest
from kvtier.manager.admission import admission_names, make_admission
from kvtier.manager.hints import KEEP, ONE_OFF, RetentionHint
from kvtier.manager.policies import policy_names
from kvtier.manager.specs import Medium, RequestContext
from kvtier.manager.tiered import TieredOffloadingManager

DEFAULT_POLICIES = ("lru", "arc", "lru+reuse_gate", "arc+reuse_gate")
THRESHOLD = 2  # what ``+threshold`` means here: store on the second sighting
HINTS = "+hints"


def parse_spec(spec: str) -> tuple[str, str]:
    """``"eviction[+admission][+hints]"`` -> names; admission defaults to ``all``."""
    spec = spec.removesuffix(HINTS)
    eviction, _, admission = spec.partition("+")
    return eviction.strip(), (admission.strip() or "all")


def build(capacity: int, spec: str) -> TieredOffloadingManager:
    """A CPU-only manager of ``capacity`` blocks with the plug-ins ``spec`` names
    (``eviction[+admission]``)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    eviction, admission = parse_spec(spec)
    adm = make_admission(admission, threshold=THRESHOLD, capacity_blocks=capacity)
    return TieredOffloadingManager(cpu_blocks=capacity, cpu_eviction=eviction, cpu_admission=adm)


def replay(trace: Sequence[TraceRequest], capacity: int, spec: str = "lru") -> SimResult:
    """Replay ``trace`` through a real manager; block ids are used as keys as they are (the
    manager never looks inside a key, and int keys hash the same in every process, so runs
    are reproducible)."""
    m = build(capacity, spec)
    hinted = spec.endswith(HINTS)  # the trace's ``continues`` as a router's retention hints
    res = SimResult(spec, capacity)
    hits_since_store: dict[int, int] = {}  # resident key -> hits since it was written
    t0 = time.perf_counter()
    for n_req, req in enumerate(trace):
        keys = req.hash_ids
        n = len(keys)
        res.blocks += n
        res.tokens += req.input_length
        if hinted and req.continues is not None:
            m.set_retention(str(n_req), RetentionHint(KEEP if req.continues else ONE_OFF))
        hits = m.lookup(keys).num_hits
        load = m.prepare_load(keys[:hits]) if hits else None
        loaded = len(load.keys) if load is not None else 0
        for i in range(loaded):
            hits_since_store[keys[i]] += 1
            res.hit_tokens += req.block_tokens(i)
        res.hit_blocks += loaded
        if loaded < n:
            ctx = RequestContext(request_id=str(n_req), first_block_index=loaded, num_prompt_blocks=n,
                                 block_tokens=TRACE_BLOCK_TOKENS,
                                 parent_key=keys[loaded - 1] if loaded else None)
            plan = m.prepare_store(keys[loaded:], ctx)
            for key in plan.evicted.get(Medium.CPU, ()):
                if hits_since_store.pop(key) == 0:
                    res.wasted += 1
            m.complete_store(plan.keys)
            for key in plan.keys:
                hits_since_store[key] = 0
            res.written += len(plan.keys)
        if load is not None:
            m.complete_load(load.keys)
        m.take_events()  # nobody reads them here; keep the queue empty
    res.seconds = time.perf_counter() - t0
    res.evicted = m.stats.evicted_blocks["CPU"]
    if m.pins() or m.stats.protocol_errors:  # the driver itself must be a correct caller
        raise RuntimeError(f"replay left {m.pins()} pins and {m.stats.protocol_errors} "
                           "protocol errors behind")
    return res


def compare(
    trace: Sequence[TraceRequest], capacities: Sequence[int], specs: Sequence[str],
    with_belady: bool = True, run=None,
) -> list[SimResult]:
    """Every spec at every capacity (LRU always included, first), then Belady (writes every
    miss) and Belady that skips writes never reused (same hits). ``run(trace, capacity,
    spec) -> SimResult`` replays one spec (default: the real manager, :func:`replay`)."""
    run = run or replay
    specs = ["lru"] + [s for s in dict.fromkeys(specs) if s != "lru"]
    out: list[SimResult] = []
    for c in capacities:
        for spec in specs:
            out.append(run(trace, c, spec))
        if with_belady:
            out.append(belady(trace, c, skip_unused=False))
            out.append(belady(trace, c, skip_unused=True))
    return out


def infinite(trace: Sequence[TraceRequest]) -> SimResult:
    """Hit rate of an unbounded cache (the ceiling of every policy)."""
    seen: set[int] = set()
    res = SimResult("infinite", 0)
    for req in trace:
        keys = req.hash_ids
        k = 0
        while k < len(keys) and keys[k] in seen:
            res.hit_tokens += req.block_tokens(k)
            k += 1
        res.hit_blocks += k
        res.blocks += len(keys)
        res.tokens += req.input_length
        res.written += sum(1 for key in keys[k:] if key not in seen)
        seen.update(keys)
    return res


MIN_GAP = 0.001  # below 0.1 point LRU is as good as Belady: a share of that gap means nothing


def gap_closed(res: SimResult, lru: SimResult, best: SimResult) -> float | None:
    """Share of the LRU -> Belady hit-rate gap that ``res`` closes (None if there is no gap)."""
    gap = best.hit_rate - lru.hit_rate
    return None if gap < MIN_GAP else (res.hit_rate - lru.hit_rate) / gap


def as_rows(results: Sequence[SimResult]) -> list[dict]:
    """JSON rows with the derived columns of the table (gap closed, writes vs LRU)."""
    by_c: dict[int, list[SimResult]] = {}
    for r in results:
        by_c.setdefault(r.capacity, []).append(r)
    rows = []
    for rs in by_c.values():
        lru = next((r for r in rs if r.policy == "lru"), None)
        best = next((r for r in rs if r.policy.startswith("belady")), None)
        for r in rs:
            d = r.as_dict()
            d["gap_closed"] = gap_closed(r, lru, best) if lru and best else None
            d["writes_vs_lru"] = r.written / lru.written if lru and lru.written else None
            rows.append(d)
    return rows


def check_specs(specs: Sequence[str]) -> list[str]:
    """Validate ``eviction[+admission]`` names before a long run; ValueError names the allowed
    ones."""
    out = []
    for spec in specs:
        spec = spec.strip()
        if not spec:
            continue
        eviction, admission = parse_spec(spec)
        if eviction not in policy_names():
            raise ValueError(f"unknown eviction policy {eviction!r} in {spec!r}; allowed: "
                             f"{', '.join(policy_names())}")
        if admission not in admission_names():
            raise ValueError(f"unknown admission policy {admission!r} in {spec!r}; allowed: "
                             f"{', '.join(admission_names())}")
        out.append(spec)
    if not out:
        raise ValueError("no policy given")
    return out


DEFAULT_CAPACITY_SHARES = (0.05, 0.2, 0.5)


def default_capacities(trace: Sequence[TraceRequest]) -> list[int]:
    """5, 20 and 50 % of the trace's distinct blocks (two significant digits). Fixed sizes
    can hold a small trace whole at every size, and then every policy prints the same rows;
    shares of the trace tell policies apart on any trace."""
    distinct = len({h for r in trace for h in r.hash_ids})
    out = []
    for share in DEFAULT_CAPACITY_SHARES:
        c = max(1, round(distinct * share))
        c = int(float(f"{c:.2g}"))
        if c not in out:
            out.append(c)
    return out
