"""Manager cost per block: lookup / prepare_store / complete_store / touch / load round trip.

Fills a CPU-only TieredOffloadingManager with N resident blocks, then times batches of 64
blocks against it (half hits, half new stores that evict). Reports microseconds per block and
the slowest single batch, per policy and size. Baseline in the same run: a plain dict lookup
of the same keys (the floor any Python manager pays), printed as a ratio.

Policies are ``eviction[+admission]`` specs. Each batch looks up its whole "prompt" (64 hits
then 64 new keys); with an admission plug-in the new keys were also sighted once before (untimed,
as by an earlier request), so the gate admits them and every batch does the full store + evict
work (the worst case: a refused block only makes a batch cheaper).

    python benchmarks/manager_overhead.py [--sizes 10000,100000,1000000]
        [--policies lru,arc,lru+reuse_gate,arc+reuse_gate] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

from kvtier.manager.admission import make_admission
from kvtier.manager.tiered import TieredOffloadingManager

BATCH = 64


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"kvtier-block-hash-pad-24"  # 32-byte keys like real hashes


def measure(policy: str, resident: int, batches: int) -> dict:
    eviction, _, admission = policy.partition("+")
    adm = make_admission(admission, capacity_blocks=resident) if admission else None
    m = TieredOffloadingManager(cpu_blocks=resident, cpu_eviction=eviction, cpu_admission=adm)
    for start in range(0, resident, 4096):
        ks = [key(i) for i in range(start, min(resident, start + 4096))]
        plan = m.prepare_store(ks)
        m.complete_store(plan.keys)
    ops = {"lookup": 0.0, "prepare_store": 0.0, "complete_store": 0.0, "touch": 0.0,
           "prepare+complete_load": 0.0, "dict_baseline": 0.0}
    worst = 0.0
    stored = 0
    nxt = resident
    step = max(1, resident // batches)
    for b in range(batches):
        hits = [key((b * step + j) % resident) for j in range(BATCH)]
        new = [key(nxt + j) for j in range(BATCH)]
        nxt += BATCH
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
        live = hits[: m.lookup(hits).num_hits]
        lp = m.prepare_load(live)
        m.complete_load(lp.keys)
        t5 = time.perf_counter()
        entries = m.cpu.entries
        for k in hits:
            entries.get(k)
        t6 = time.perf_counter()
        for name, dt in zip(ops, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
            ops[name] += dt
        worst = max(worst, t5 - t0)
    per_block = {k: v / (batches * BATCH) * 1e6 for k, v in ops.items()}
    assert m.pins() == 0
    return {"policy": policy, "resident": resident, "us_per_block": per_block,
            "worst_batch_ms": worst * 1e3, "stored_share": stored / (batches * BATCH),
            "lookup_vs_dict": per_block["lookup"] / max(per_block["dict_baseline"], 1e-9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--policies", default="lru,arc,lru+reuse_gate,arc+reuse_gate")
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [measure(p, int(n), args.batches) for p in args.policies.split(",") for n in args.sizes.split(",")]
    if args.json:
        print(json.dumps(rows))
        return
    cols = ["lookup", "prepare_store", "complete_store", "touch", "prepare+complete_load"]
    print(f"{'policy':14} {'resident':>9} " + " ".join(f"{c:>22}" for c in cols) + f" {'worst 64-batch ms':>18} {'lookup/dict':>11}")
    for r in rows:
        print(f"{r['policy']:14} {r['resident']:>9} " + " ".join(f"{r['us_per_block'][c]:>20.2f}us" for c in cols)
              + f" {r['worst_batch_ms']:>18.3f} {r['lookup_vs_dict']:>11.1f}")


if __name__ == "__main__":
    main()
