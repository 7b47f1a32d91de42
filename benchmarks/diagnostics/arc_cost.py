"""kvtier's ARC against vLLM's ARC, side by side in one process: cost per block of a whole
request, and the slowest request (issue 15, item 3).

Both managers are CPU-only and filled with N resident blocks (untimed), then serve the same
stream of requests, alternating one request each (so machine noise lands on both alike). A
request is a prompt of 64 blocks stored half a cache ago (resident, not hot) followed by 64
new blocks, done the way each manager's API does it:

* kvtier ``TieredOffloadingManager``: ``lookup(prompt)``, ``prepare_store(new)`` (evicts 64),
  ``complete_store``, ``touch(hits)``, ``prepare_load(hits)``, ``complete_load``,
  ``take_events``.
* vLLM 0.32 ``CPUOffloadingManager(cache_policy="arc")``: ``on_new_request``, ``lookup`` per
  block until the first miss, ``prepare_load(hits)``, ``complete_load``,
  ``prepare_store(new)`` (evicts 64), ``complete_store``, ``on_request_finished`` (where vLLM's
  ARC applies reuse), ``take_events``.

Per block = total timed request time / (requests x 128 prompt blocks). The number of requests
defaults to ``--churn 1.0`` x N / 64 (every resident block replaced once), with garbage
collection on, as in a server: the slowest request only shows up once the cache has churned
(an ``OrderedDict`` of 1M keys rebuilds its table every ~0.5M inserts). Keys are 32-byte
hashes (+ the 4-byte group index vLLM appends).

    .venv/bin/python benchmarks/diagnostics/arc_cost.py [--sizes 10000,100000,1000000] [--churn 1.0]
        [--policy arc] [--json]

``--policy lru`` runs the same protocol for both managers' LRU. The default run (three sizes,
ARC) takes about 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from kvtier.manager.tiered import TieredOffloadingManager

BATCH = 64


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"kvtier-block-hash-pad-24" + b"\0\0\0\0"


def _kvtier(policy: str, n: int):
    m = TieredOffloadingManager(cpu_blocks=n, cpu_eviction=policy)
    for start in range(0, n, 4096):
        plan = m.prepare_store([key(i) for i in range(start, min(n, start + 4096))])
        m.complete_store(plan.keys)
    m.take_events()

    def request(hits: list, new: list) -> None:
        m.lookup(hits + new)
        plan = m.prepare_store(new)
        m.complete_store(plan.keys)
        m.touch(hits)
        lp = m.prepare_load(hits)
        m.complete_load(lp.keys)
        m.take_events()

    return request


def _vllm(policy: str, n: int):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    m = CPUOffloadingManager(n, cache_policy=policy, enable_events=True)
    for start in range(0, n, 4096):
        ctx = ReqContext(req_id=f"fill-{start}")
        m.on_new_request(ctx)
        out = m.prepare_store([key(i) for i in range(start, min(n, start + 4096))], ctx)
        m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)
    list(m.take_events())
    hit, counter = LookupResult.HIT, [0]

    def request(hits: list, new: list) -> None:
        counter[0] += 1
        ctx = ReqContext(req_id=str(counter[0]))
        m.on_new_request(ctx)
        n_hit = 0
        for k in hits + new:
            if m.lookup(k, ctx) is not hit:
                break
            n_hit += 1
        live = hits[:n_hit]
        m.prepare_load(live, ctx)
        m.complete_load(live, ctx)
        out = m.prepare_store(new, ctx)
        m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)
        list(m.take_events())

    return request


def measure(policy: str, n: int, requests: int) -> dict:
    gc.collect()
    sides = {"kvtier": _kvtier(policy, n), "vllm": _vllm(policy, n)}
    total = dict.fromkeys(sides, 0.0)
    worst = dict.fromkeys(sides, 0.0)
    times: dict[str, list[float]] = {s: [] for s in sides}
    nxt = n
    perf = time.perf_counter
    for r in range(requests):
        back = n // 2
        hits = [key(nxt - back + j) for j in range(BATCH)]
        new = [key(nxt + j) for j in range(BATCH)]
        nxt += BATCH
        order = ("kvtier", "vllm") if r % 2 == 0 else ("vllm", "kvtier")
        for side in order:
            t0 = perf()
            sides[side](hits, new)
            dt = perf() - t0
            total[side] += dt
            times[side].append(dt)
            if dt > worst[side]:
                worst[side] = dt
    out = {"policy": policy, "resident": n, "requests": requests}
    for side in sides:
        ts = sorted(times[side])
        out[side] = {"us_per_block": total[side] / (requests * 2 * BATCH) * 1e6,
                     "p99_request_ms": ts[int(0.99 * (len(ts) - 1))] * 1e3,
                     "worst_request_ms": worst[side] * 1e3}
    out["ratio"] = out["kvtier"]["us_per_block"] / out["vllm"]["us_per_block"]
    del sides
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--policy", default="arc", choices=("arc", "lru"))
    ap.add_argument("--churn", type=float, default=1.0,
                    help="timed requests = churn x resident / 64 (at least 300)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [measure(args.policy, int(n), max(300, int(args.churn * int(n) / BATCH)))
            for n in args.sizes.split(",")]
    if args.json:
        print(json.dumps(rows))
        return
    print(f"| policy | resident | kvtier us/block | vLLM us/block | kvtier/vLLM | "
          f"kvtier p99 / slowest request ms | vLLM p99 / slowest request ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        k, v = r["kvtier"], r["vllm"]
        print(f"| {r['policy']} | {r['resident']:,} | {k['us_per_block']:.2f} | "
              f"{v['us_per_block']:.2f} | {r['ratio']:.2f} | {k['p99_request_ms']:.2f} / "
              f"{k['worst_request_ms']:.2f} | {v['p99_request_ms']:.2f} / "
              f"{v['worst_request_ms']:.2f} |")


if __name__ == "__main__":
    main()
