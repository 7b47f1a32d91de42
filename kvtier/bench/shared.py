"""``kvtier bench --shared``: what sharing the tier across instances buys, and what it costs.

Two instances (each its own manager, CPU pool, transfer engine and server connection, as two
vLLM processes would have) replay the two halves of a trace, request by request in turn,
against one shared tier; one instance with twice the CPU capacity and the same shared tier
replays the whole trace as the baseline. Each run writes under its own fresh namespace, so
neither sees the other's blocks. Reported: both hit rates and their ratio (how much of a
single big instance's reuse two sharing instances keep), REMOTE hits of the second instance
from blocks the first stored, and the shared tier's load/store bandwidth next to a raw
redis-py client doing the same GET/SET of the same values (same sizes, same concurrency) in
the same run.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import replace
from typing import Sequence

from kvtier.bench.replay import Replay
from kvtier.bench.trace import TraceRequest
from kvtier.config import KvtierConfig
from kvtier.tiers.remote.client import make_client
from kvtier.tiers.remote.store import IN_FLIGHT

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


def raw_client_gbps(config: KvtierConfig, value_bytes: int, count: int) -> dict:
    """A plain redis-py asyncio client (same timeouts, same commands in flight as the tier)
    SETs then GETs ``count`` values of ``value_bytes``: the bandwidth ceiling here."""

    async def run() -> dict:
        client = make_client(config.remote)
        if config.remote.cluster:
            await client.initialize()
        sem = asyncio.Semaphore(IN_FLIGHT)
        prefix = f"kvtier-rawbench:{uuid.uuid4().hex[:8]}:"
        value = os.urandom(value_bytes)
        keys = [f"{prefix}{i}" for i in range(count)]

        async def one(fn, *args):
            async with sem:
                return await fn(*args)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(client.set, k, value) for k in keys))
        t_set = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(client.get, k) for k in keys))
        t_get = time.perf_counter() - t0
        await asyncio.gather(*(one(client.delete, k) for k in keys))
        await client.aclose()
        ok = sum(1 for g in got if g is not None and len(g) == value_bytes)
        return {"set_gbps": round(count * value_bytes / t_set / 1e9, 4),
                "get_gbps": round(ok * value_bytes / t_get / 1e9, 4), "values": count,
                "value_bytes": value_bytes}

    return asyncio.run(run())


def run_shared(config: KvtierConfig, trace: Sequence[TraceRequest], block_bytes: int,
               gpu_blocks: int) -> dict:
    if config.remote is None:
        raise ValueError("--shared needs tiers.remote in the config")
    shared_cfg = _with_namespace(config)
    a, b = Replay(shared_cfg, block_bytes, gpu_blocks), Replay(shared_cfg, block_bytes, gpu_blocks)
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
    loads = rb["transfers"].get("REMOTE->CPU") or {}
    value_bytes = block_bytes + 64 + 64  # a block plus its record header and key
    raw = raw_client_gbps(config, value_bytes, max(32, min(512, loads.get("jobs", 0) * 4)))
    tier_get = max(_gbps(ra, "REMOTE->CPU"), _gbps(rb, "REMOTE->CPU"))
    tier_set = max(_gbps(ra, "CPU->REMOTE"), _gbps(rb, "CPU->REMOTE"))
    return {
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
        "remote_gbps": {"load": tier_get, "store": tier_set},
        "raw_client_gbps": raw,
        "bandwidth_ratio": {
            "load": round(tier_get / raw["get_gbps"], 4) if raw["get_gbps"] else None,
            "store": round(tier_set / raw["set_gbps"], 4) if raw["set_gbps"] else None},
        "lookup_ms": {k: max(ra["remote"].get(k, 0), rb["remote"].get(k, 0))
                      for k in ("lookup_p50_ms", "lookup_p99_ms", "max_lookup_ms")},
    }
