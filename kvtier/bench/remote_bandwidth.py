"""Shared-tier bandwidth against a raw client, isolated from any replay.

The tier path is the real one: CPU pool slots -> ``CpuToRemoteHandler`` (record encoding,
checksums) -> Redis/Valkey, and back through ``RemoteToCpuHandler`` (every value verified,
copied into its slot), driven through the ``TransferEngine`` in jobs of ``batch`` blocks. The
raw client is redis-py's asyncio client SETting and GETting the same blocks' bytes (one value
per block, record-sized, built before the clock starts) in the same batches, with the same
number of commands in flight, and nothing else; both delete their keys after each round,
untimed. Tier and raw rounds alternate ``repeats`` times; the GB/s are medians, each ratio is
the median of the per-pair ratios (a tier round against the raw round right after it), which
keeps the slow swings of a shared machine's load out of the comparison.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from dataclasses import replace

import torch

from kvtier.config import KvtierConfig
from kvtier.manager.specs import LoadStoreSpec
from kvtier.runtime.worker import WorkerRuntime
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.tiers.layout import BlockGeometry
from kvtier.tiers.remote.client import make_client
from kvtier.tiers.remote.store import IN_FLIGHT
from kvtier.transfer.remote_io import WRITE_JOBS

RECORD_OVERHEAD = 128  # header + key of one value, about


def _runtime(config: KvtierConfig, block_bytes: int, blocks: int) -> WorkerRuntime:
    page = block_bytes // 2
    geo = BlockGeometry(num_layers=1, kv_parts=2, engine_blocks_per_block=1, page_bytes=page,
                        model=f"bandwidth-{uuid.uuid4().hex[:8]}")
    gpu = {"layer.0": torch.zeros((2, 1, page), dtype=torch.uint8)}
    cfg = replace(config, cpu=replace(config.cpu, capacity=blocks * block_bytes, pin=False),
                  disk=None)
    return WorkerRuntime.create(cfg, GpuKvView(gpu, layout="kv_first"), geo)


def _tier_round(rt: WorkerRuntime, blocks: int, batch: int) -> tuple[float, float, int]:
    keys = [f"bw-{uuid.uuid4().hex}".encode() for _ in range(blocks)]
    jobs = [(keys[i:i + batch], list(range(i, min(blocks, i + batch))))
            for i in range(0, blocks, batch)]
    t0 = time.perf_counter()
    ids = [rt.engine.submit(LoadStoreSpec.cpu(s), LoadStoreSpec.remote(k)) for k, s in jobs]
    stored = rt.engine.wait(ids)
    t_set = time.perf_counter() - t0
    t0 = time.perf_counter()
    ids = [rt.engine.submit(LoadStoreSpec.remote(k), LoadStoreSpec.cpu(s)) for k, s in jobs]
    loaded = rt.engine.wait(ids)
    t_get = time.perf_counter() - t0
    bad = sum(not r.ok for r in stored) + sum(len(r.failed_keys) for r in loaded)
    # dropped like the raw round's keys: the next rounds' SETs then find the server's memory
    # in the same state for both (never-freed keys made the tier's SETs ~20 % slower)
    store = rt.remote
    store.run(store.delete([store.keys.server_key(k) for k in keys]))
    return t_set, t_get, bad


def _raw_round(config: KvtierConfig, values: list[bytes], batch: int,
               jobs_in_flight: int) -> tuple[float, float]:
    async def run() -> tuple[float, float]:
        client = make_client(config.remote)
        if config.remote.cluster:
            await client.initialize()
        sem = asyncio.Semaphore(IN_FLIGHT)
        jobs = asyncio.Semaphore(jobs_in_flight)
        blocks = len(values)
        keys = [f"bw-raw-{uuid.uuid4().hex}" for _ in range(blocks)]
        value_of = dict(zip(keys, values))

        async def one(fn, *args):
            async with sem:
                return await fn(*args)

        async def job(fn, chunk, set_values=False):
            async with jobs:
                return await asyncio.gather(*(one(fn, k, value_of[k]) if set_values else
                                              one(fn, k) for k in chunk))

        chunks = [keys[i:i + batch] for i in range(0, blocks, batch)]
        t0 = time.perf_counter()
        await asyncio.gather(*(job(client.set, c, set_values=True) for c in chunks))
        t_set = time.perf_counter() - t0
        t0 = time.perf_counter()
        await asyncio.gather(*(job(client.get, c) for c in chunks))
        t_get = time.perf_counter() - t0
        await asyncio.gather(*(one(client.delete, k) for k in keys))
        await client.aclose()
        return t_set, t_get

    return asyncio.run(run())


def tier_vs_raw(config: KvtierConfig, block_bytes: int, total_bytes: int = 64 << 20,
                batch: int = 8, repeats: int = 7) -> dict:
    blocks = max(batch, total_bytes // block_bytes)
    rt = _runtime(config, block_bytes, blocks)
    try:
        g = torch.Generator().manual_seed(0)
        for s in range(blocks):
            rt.pool.slot(s).copy_(torch.randint(0, 256, (block_bytes,), dtype=torch.uint8,
                                                generator=g))
        # the raw client SETs the same bytes, each block its own value (record-sized)
        values = [bytes(RECORD_OVERHEAD) + rt.pool.slot(s).numpy().tobytes()
                  for s in range(blocks)]
        samples = {"tier_set": [], "tier_get": [], "raw_set": [], "raw_get": []}
        bad = 0
        for _ in range(repeats):
            t_set, t_get, b = _tier_round(rt, blocks, batch)
            bad += b
            samples["tier_set"].append(t_set), samples["tier_get"].append(t_get)
            t_set, t_get = _raw_round(config, values, batch, WRITE_JOBS)
            samples["raw_set"].append(t_set), samples["raw_get"].append(t_get)
    finally:
        rt.close()
    gbps = {k: round(blocks * block_bytes / statistics.median(v) / 1e9, 4)
            for k, v in samples.items()}
    pairs = {what: [raw / tier for tier, raw in zip(samples[f"tier_{op}"], samples[f"raw_{op}"])]
             for what, op in (("store", "set"), ("load", "get"))}  # times: raw/tier = GB/s ratio
    return {"block_bytes": block_bytes, "blocks": blocks, "batch": batch, "repeats": repeats,
            "gbps": gbps, "failed": bad,
            "ratio": {k: round(statistics.median(v), 3) for k, v in pairs.items()},
            "ratio_range": {k: [round(min(v), 3), round(max(v), 3)] for k, v in pairs.items()}}
