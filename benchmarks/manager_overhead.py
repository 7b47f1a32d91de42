"""Manager cost per block: lookup / prepare_store / complete_store / touch / load round trip.

Fills a CPU-only TieredOffloadingManager with N resident blocks, then times batches of 64
blocks against it (half hits, half new stores that evict). Reports microseconds per block and
the slowest single batch, per policy and size. Baseline in the same run: a plain dict lookup
of the same keys (the floor any Python manager pays), printed as a ratio.

Policies are ``eviction[+admission]`` specs. Each batch looks up its whole "prompt" (64 hits
then 64 new keys); with an admission plug-in the new keys were also sighted once before (untimed,
as by an earlier request), so the gate admits them and every batch does the full store + evict
work (the worst case: a refused block only makes a batch cheaper).

The slowest batch is the figure that matters for a scheduler step, and it only shows up
once the cache has churned: a dict of 1M keys rebuilds its table every ~0.5M inserts and a
full garbage collection comes every few 100k new objects. So the number of timed batches
defaults to ``--churn 1.0`` times the resident count (every resident block replaced once),
with garbage collection left on, as in a server. Also printed: the 99th-percentile batch, and
a noise floor measured in the same run: a fixed pure-Python workload (``NOISE_OPS`` dict reads
on a small dict) timed once per batch, whose slowest run shows what the machine itself adds
(preemption, frequency changes) to any batch.

With ``--disk-lag L`` the manager also has a disk tier (``--disk-ratio`` x the CPU blocks) and
write-back runs as in a server: every batch hands out its demotions, and each one completes
``L`` batches later (a disk slower than the stores; ``complete_background`` is timed as a step
of its own). Without a disk tier nothing is ever being demoted, so eviction never meets the
pinned and dirty blocks a slow disk leaves at the cold end of the CPU order (issue 14.9).
The same batches are then run again with no disk tier, in the same run, and the ratio of the
two is printed: what write-back adds to a scheduler step. ``--batch 512`` is one 8k-token
prompt of 16-token blocks, the store that cost 10.5 ms of a vLLM step in the disk
configuration (issue 11).

``--resync N`` instead times an event resync over N resident CPU blocks: the old one-shot walk
(``resident_blocks``, one call) against the chunked walk the publisher now does, one chunk per
``publish`` call (issue 14.10).

    python benchmarks/manager_overhead.py [--sizes 10000,100000,1000000]
        [--policies lru,arc,lru+reuse_gate,arc+reuse_gate] [--churn 1.0]
        [--disk-lag L [--disk-ratio 4]] [--batch 64] [--json]
    python benchmarks/manager_overhead.py --resync 1000000
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque

from kvtier.manager.admission import make_admission
from kvtier.manager.tiered import TieredOffloadingManager

BATCH = 64
NOISE_OPS = 4096


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"kvtier-block-hash-pad-24"  # 32-byte keys like real hashes


def measure(policy: str, resident: int, batches: int, disk_lag: int | None = None,
            disk_ratio: float = 4.0, batch: int = BATCH) -> dict:
    baseline = {key(i): i for i in range(resident)}  # the plain-dict floor, same keys
    eviction, _, admission = policy.partition("+")
    adm = make_admission(admission, capacity_blocks=resident) if admission else None
    disk = int(disk_ratio * resident) if disk_lag is not None else 0
    m = TieredOffloadingManager(cpu_blocks=resident, cpu_eviction=eviction, cpu_admission=adm,
                                disk_blocks=disk, disk_eviction=eviction)
    for start in range(0, resident, 4096):
        ks = [key(i) for i in range(start, min(resident, start + 4096))]
        plan = m.prepare_store(ks)
        m.complete_store(plan.keys)
        for t in m.take_background_transfers():  # the fill is untimed: the disk keeps up
            m.complete_background(t.id, True)
    m.take_events()  # the fill's events are not part of any timed batch
    in_flight: deque = deque()  # (batch it completes in, transfer)
    ops = {"lookup": 0.0, "prepare_store": 0.0, "complete_store": 0.0, "touch": 0.0,
           "prepare+complete_load": 0.0, "background": 0.0, "dict_baseline": 0.0}
    worst = 0.0
    batch_ms: list[float] = []
    noise_ms: list[float] = []
    small = {key(i): i for i in range(256)}
    probe = [key(i % 256) for i in range(NOISE_OPS)]
    stored = 0
    nxt = resident
    worst_split: dict[str, float] = {}
    for b in range(batches):
        back = min(resident // 2, nxt)  # a prefix stored half a cache ago: resident, not hot
        hits = [key(nxt - back + j) for j in range(min(batch, back))]
        new = [key(nxt + j) for j in range(batch)]
        nxt += batch
        if adm is not None:
            adm.record_lookup(new)  # an earlier request's sighting (see the module docstring)
        t0 = time.perf_counter()
        m.lookup(hits + new)  # the whole prompt, as a connector looks it up
        t1 = time.perf_counter()
        plan = m.prepare_store(new)
        t2 = time.perf_counter()
        stored += len(plan.keys)
        m.complete_store(plan.keys)
        t3 = time.perf_counter()
        m.touch(hits)
        t4 = time.perf_counter()
        # the CPU run loads now; hits held on disk only are promoted by the lookup (background
        # transfers, settled with the demotions below) and load from CPU memory once there
        live = hits[: m.lookup(hits).num_hits]
        lp = m.prepare_load(live)
        m.complete_load(lp.keys)
        m.take_events()  # the connector drains them every step
        t5 = time.perf_counter()
        if disk_lag is not None:  # the demotions handed out now complete disk_lag batches later
            for t in m.take_background_transfers():
                in_flight.append((b + disk_lag, t))
            while in_flight and in_flight[0][0] <= b:
                m.complete_background(in_flight.popleft()[1].id, True)
        t6 = time.perf_counter()
        for k in hits:
            baseline.get(k)
        t7 = time.perf_counter()
        for k in probe:
            small.get(k)
        noise_ms.append((time.perf_counter() - t7) * 1e3)
        split = dict(zip(ops, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6)))
        for name, dt in split.items():
            ops[name] += dt
        if t6 - t0 > worst:
            worst, worst_split = t6 - t0, {k: round(v * 1e3, 3) for k, v in split.items()}
        batch_ms.append((t6 - t0) * 1e3)
    batch_ms.sort()
    noise_ms.sort()
    per_block = {k: v / (batches * batch) * 1e6 for k, v in ops.items()}
    for _, t in in_flight:
        m.complete_background(t.id, True)
    for t in m.take_background_transfers():
        m.complete_background(t.id, True)
    assert m.pins() == 0
    s = m.stats
    return {"policy": policy, "resident": resident, "disk_lag": disk_lag,
            "us_per_block": per_block, "stored_to_disk": s.stored_blocks["DISK"],
            "evicted_unwritten": getattr(s, "evicted_unwritten", None),
            "store_skipped_no_space": s.store_skipped_no_space,
            "worst_batch_ms": worst * 1e3, "worst_batch_split_ms": worst_split,
            "p99_batch_ms": batch_ms[int(0.99 * (len(batch_ms) - 1))],
            "noise_median_ms": noise_ms[len(noise_ms) // 2], "noise_worst_ms": noise_ms[-1],
            "batches": batches, "batch": batch, "stored_share": stored / (batches * batch),
            "lookup_vs_dict": per_block["lookup"] / max(per_block["dict_baseline"], 1e-9)}


def measure_resync(resident: int) -> dict:
    from kvtier.observe.events import resident_blocks
    from kvtier.observe.events.resync import DEFAULT_CHUNK, ChunkedWalk, walk_resident

    m = TieredOffloadingManager(cpu_blocks=resident)
    for start in range(0, resident, 8192):
        plan = m.prepare_store([key(i) for i in range(start, min(resident, start + 8192))])
        m.complete_store(plan.keys)
    t0 = time.perf_counter()
    resident_blocks(m)
    one_shot = time.perf_counter() - t0
    walk, calls = ChunkedWalk(walk_resident(m)), []
    while not walk.done:
        t0 = time.perf_counter()
        walk.next_chunk()
        calls.append((time.perf_counter() - t0) * 1e3)
    assert walk.blocks == resident
    calls.sort()
    return {"resident": resident, "one_shot_ms": one_shot * 1e3, "chunk": DEFAULT_CHUNK,
            "calls": len(calls), "median_call_ms": calls[len(calls) // 2],
            "slowest_call_ms": calls[-1], "total_ms": sum(calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--policies", default="lru,arc,lru+reuse_gate,arc+reuse_gate")
    ap.add_argument("--churn", type=float, default=1.0,
                    help="timed batches = churn x resident / 64 (at least 300)")
    ap.add_argument("--batches", type=int, default=0, help="fixed number of timed batches")
    ap.add_argument("--disk-lag", type=int, default=None,
                    help="add a disk tier whose demotions complete this many batches late")
    ap.add_argument("--disk-ratio", type=float, default=4.0, help="disk blocks per CPU block")
    ap.add_argument("--batch", type=int, default=BATCH,
                    help="new blocks per timed batch (a request's store; 512 = 8k tokens)")
    ap.add_argument("--resync", type=int, default=0, help="time a resync over N blocks instead")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.resync:
        r = measure_resync(args.resync)
        print(json.dumps(r) if args.json else
              f"resync of {r['resident']} CPU blocks: one-shot {r['one_shot_ms']:.0f} ms in one call; "
              f"chunked {r['calls']} calls of <= {r['chunk']} units, median "
              f"{r['median_call_ms']:.2f} ms, slowest {r['slowest_call_ms']:.2f} ms, "
              f"total {r['total_ms']:.0f} ms")
        return

    def batches(n: int) -> int:
        return args.batches or max(300, int(args.churn * n / args.batch))

    if args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    rows = [measure(p, int(n), batches(int(n)), args.disk_lag, args.disk_ratio, args.batch)
            for p in args.policies.split(",") for n in args.sizes.split(",")]
    if args.disk_lag is not None:  # the baseline, same run: the same batches with no disk tier
        for r in rows:
            base = measure(r["policy"], r["resident"], r["batches"], None, batch=args.batch)
            r["no_disk_us_per_block"] = base["us_per_block"]
    if args.json:
        print(json.dumps(rows))
        return
    cols = ["lookup", "prepare_store", "complete_store", "touch", "prepare+complete_load"]
    if args.disk_lag is not None:
        cols.append("background")
    print(f"{'policy':14} {'resident':>9} " + " ".join(f"{c:>22}" for c in cols) + f" {'p99 batch ms':>13} {'worst 64-batch ms':>18} {'lookup/dict':>11}")
    for r in rows:
        print(f"{r['policy']:14} {r['resident']:>9} " + " ".join(f"{r['us_per_block'][c]:>20.2f}us" for c in cols)
              + f" {r['p99_batch_ms']:>13.3f} {r['worst_batch_ms']:>18.3f} {r['lookup_vs_dict']:>11.1f}")
        print(f"{'':25}slowest batch, ms per step: {r['worst_batch_split_ms']}")
        if args.disk_lag is not None:
            print(f"{'':25}disk lag {args.disk_lag} batches: {r['stored_to_disk']} blocks demoted, "
                  f"{r['evicted_unwritten']} evicted unwritten, "
                  f"{r['store_skipped_no_space']} store blocks refused (no space)")
            us, base = r["us_per_block"], r["no_disk_us_per_block"]
            print(f"{'':25}vs no disk tier, same run: prepare_store {us['prepare_store']:.2f} / "
                  f"{base['prepare_store']:.2f} us = {us['prepare_store'] / base['prepare_store']:.2f}x"
                  f", load {us['prepare+complete_load']:.2f} / {base['prepare+complete_load']:.2f}"
                  f" us = {us['prepare+complete_load'] / base['prepare+complete_load']:.2f}x")
        print(f"{'':25}noise floor ({NOISE_OPS} dict reads per batch): median "
              f"{r['noise_median_ms']:.3f} ms, slowest {r['noise_worst_ms']:.3f} ms")


if __name__ == "__main__":
    main()
