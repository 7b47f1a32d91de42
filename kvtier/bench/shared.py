"""``kvtier bench --shared``: what sharing the tier across instances buys, and what it costs.

Two instances (each its own manager, CPU pool, transfer engine and server connection, as two
vLLM processes would have) replay the two halves of a trace, request by request in turn,
against one shared tier; one instance with twice the CPU capacity and the same shared tier
replays the whole trace as the baseline. Each run writes under its own fresh namespace, so
neither sees the other's blocks. Reported: both hit rates and their ratio (how much of a
single big instance's reuse two sharing instances keep), the second instance's REMOTE hits
and the load/store GB/s the replay's REMOTE hops saw.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Sequence

from kvtier.bench.replay import CallTimer, Replay
from kvtier.bench.trace import TraceRequest
from kvtier.config import KvtierConfig

HIT_TIERS = ("GPU", "CPU", "DISK", "REMOTE")


def _with_namespace(config: KvtierConfig, cpu_factor: int = 1) -> KvtierConfig:
    remote = replace(config.remote, namespace=f"bench-{uuid.uuid4().hex[:12]}")
    cpu = replace(config.cpu, capacity=config.cpu.capacity * cpu_factor)
    return replace(config, remote=remote, cpu=cpu)


def _hit_rate(blocks: dict) -> float:
    total = sum(blocks.values())
    return sum(blocks.get(t, 0) for t in HIT_TIERS) / total if total else 0.0


def _gbps(report: dict, route: str) -> float:
    t = report["transfers"].get(route) or {}
    return round(t.get("gbps", 0.0), 4)


def run_shared(config: KvtierConfig, trace: Sequence[TraceRequest], block_bytes: int,
               gpu_blocks: int, call_timer: CallTimer | None = None) -> dict:
    """``call_timer``: times the scheduler-side calls of both sharing instances (one thread
    runs both, so one timer holds them all); its summary is then in the report."""
    if config.remote is None:
        raise ValueError("--shared needs tiers.remote in the config")
    shared_cfg = _with_namespace(config)
    a, b = (Replay(shared_cfg, block_bytes, gpu_blocks, call_timer=call_timer)
            for _ in range(2))
    start = time.perf_counter()
    try:
        for i, req in enumerate(trace):
            (a if i % 2 == 0 else b).run_request(req)
            a.drain() if i % 2 == 0 else b.drain()
        a.drain(), b.drain()
        seconds = time.perf_counter() - start
        ra, rb = a.report(), b.report()
    finally:
        a.close(), b.close()
    single = Replay(_with_namespace(config, cpu_factor=2), block_bytes, gpu_blocks)
    try:
        single.run(trace)
        rs = single.report()
    finally:
        single.close()
    blocks = {k: ra["blocks"][k] + rb["blocks"][k] for k in ra["blocks"]}
    shared_rate, single_rate = _hit_rate(blocks), _hit_rate(rs["blocks"])
    out = {
        "requests": len(trace), "block_bytes": block_bytes, "seconds": round(seconds, 3),
        "shared": {"blocks": blocks, "hit_rate": round(shared_rate, 4),
                   "instances": [{"blocks": r["blocks"], "wrong_blocks": r["wrong_blocks"],
                                  "remote": r.get("remote"), "transfers": r["transfers"]}
                                 for r in (ra, rb)]},
        "single_2x_cpu": {"blocks": rs["blocks"], "hit_rate": round(single_rate, 4),
                          "wrong_blocks": rs["wrong_blocks"]},
        "hit_rate_ratio": round(shared_rate / single_rate, 4) if single_rate else None,
        "second_instance_remote_hits": rb["blocks"]["REMOTE"],
        "wrong_blocks": ra["wrong_blocks"] + rb["wrong_blocks"] + rs["wrong_blocks"],
        # GB/s the replay's REMOTE hops saw (busy time; competing with the replay itself)
        "replay_remote_gbps": {"load": max(_gbps(r, "REMOTE->CPU") for r in (ra, rb)),
                               "store": max(_gbps(r, "CPU->REMOTE") for r in (ra, rb))},
    }
    if call_timer is not None:
        out["scheduler_calls"] = call_timer.summary()
    return out
