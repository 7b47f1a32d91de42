"""The shared tier's GB/s as a share of the host's raw Redis / Valkey ceiling, in one run.

The tier path is the real one: CPU pool slots -> ``CpuToRemoteHandler`` -> the tier's I/O
processes (records built, checksummed and, with a MAC key, tagged; values sent from the slots)
-> the server, and back through ``RemoteToCpuHandler`` (every value received into its slot and
verified there), driven through the ``TransferEngine`` in jobs of ``batch`` blocks, all
submitted at once. The ceiling (``remote_ceiling.py``) is ``clients`` plain client processes
doing pipelined SET / GET of values of the same size against the same server layout. Tier and
ceiling rounds alternate ``repeats`` times; GB/s are medians and each share is the median of
per-pair ratios (a tier round against the ceiling round right after it), which keeps a shared
machine's slow swings out of the comparison.
"""

from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import replace

import torch
from remote_ceiling import measure_ceiling

from kvtier.config import KvtierConfig
from kvtier.manager.specs import LoadStoreSpec
from kvtier.runtime.worker import WorkerRuntime
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.tiers.layout import BlockGeometry
from kvtier.tiers.remote.wire.connect import connect_remote

RECORD_OVERHEAD = 128  # header + key of one value, about


def block_runtime(config: KvtierConfig, block_bytes: int, blocks: int, *, pin: bool = False,
                  model: str | None = None) -> WorkerRuntime:
    """A worker runtime whose blocks are ``block_bytes`` of one layer, with a CPU pool of
    ``blocks`` of them and no disk tier. Runtimes given the same ``model`` share the shared
    tier's key space (by default each gets its own)."""
    page = block_bytes // 2
    geo = BlockGeometry(num_layers=1, kv_parts=2, engine_blocks_per_block=1, page_bytes=page,
                        model=model or f"bandwidth-{uuid.uuid4().hex[:8]}")
    gpu = {"layer.0": torch.zeros((2, 1, page), dtype=torch.uint8)}
    cfg = replace(config, cpu=replace(config.cpu, capacity=blocks * block_bytes, pin=pin),
                  disk=None)
    return WorkerRuntime.create(cfg, GpuKvView(gpu, layout="kv_first"), geo)


def fill_random(rt: WorkerRuntime, blocks: int, block_bytes: int, seed: int = 0) -> None:
    """Random bytes (seeded) into CPU slots ``0 .. blocks - 1``."""
    g = torch.Generator().manual_seed(seed)
    for s in range(blocks):
        rt.pool.slot(s).copy_(torch.randint(0, 256, (block_bytes,), dtype=torch.uint8,
                                            generator=g))


def _waves(rt: WorkerRuntime, specs: list, at_once: int | None) -> list:
    """Run ``(src, dst)`` jobs, ``at_once`` of them in flight (None: all submitted at once)."""
    step = at_once or len(specs)
    out = []
    for w in range(0, len(specs), step):
        out += rt.engine.wait([rt.engine.submit(s, d) for s, d in specs[w:w + step]])
    return out


def _tier_round(rt: WorkerRuntime, blocks: int, batch: int,
                at_once: int | None) -> tuple[float, float, int]:
    keys = [f"bw-{uuid.uuid4().hex}".encode() for _ in range(blocks)]
    jobs = [(keys[i:i + batch], list(range(i, min(blocks, i + batch))))
            for i in range(0, blocks, batch)]
    t0 = time.perf_counter()
    stored = _waves(rt, [(LoadStoreSpec.cpu(s), LoadStoreSpec.remote(k)) for k, s in jobs],
                    at_once)
    t_set = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = _waves(rt, [(LoadStoreSpec.remote(k), LoadStoreSpec.cpu(s)) for k, s in jobs],
                    at_once)
    t_get = time.perf_counter() - t0
    bad = sum(not r.ok for r in stored) + sum(len(r.failed_keys) for r in loaded)
    _drop(rt, keys)
    return t_set, t_get, bad


def _drop(rt: WorkerRuntime, keys: list[bytes]) -> None:
    """Delete a round's keys, untimed: every round then finds the server's memory alike."""
    store = connect_remote(rt.remote.cfg, rt.geometry)  # the same keys: same geometry, rank 0
    try:
        store.run(store.delete([store.keys.server_key(k) for k in keys]))
    finally:
        store.close()


def tier_vs_ceiling(config: KvtierConfig, block_bytes: int, *, clients: int,
                    total_bytes: int = 256 << 20, batch: int = 32, repeats: int = 3,
                    jobs_at_once: int | None = None) -> dict:
    """``jobs_at_once``: 1 times one hit's promotion at a time (a job of ``batch`` blocks),
    None submits every job at once (throughput)."""
    blocks = max(batch, total_bytes // block_bytes)
    rt = block_runtime(config, block_bytes, blocks)
    try:
        rt.remote.warm_up()
        fill_random(rt, blocks, block_bytes)
        samples: dict[str, list[float]] = {"tier_set": [], "tier_get": [], "raw_set": [],
                                           "raw_get": []}
        bad = 0
        nbytes = blocks * block_bytes
        for _ in range(repeats):
            t_set, t_get, b = _tier_round(rt, blocks, batch, jobs_at_once)
            bad += b
            samples["tier_set"].append(nbytes / t_set / 1e9)
            samples["tier_get"].append(nbytes / t_get / 1e9)
            c = measure_ceiling(config.remote, block_bytes + RECORD_OVERHEAD, nbytes, clients)
            samples["raw_set"].append(c.set_gbps)
            samples["raw_get"].append(c.get_gbps)
        stats = rt.remote.stats().to_dict()
    finally:
        rt.close()
    gbps = {k: round(statistics.median(v), 3) for k, v in samples.items()}
    share = {what: [t / r for t, r in zip(samples[f"tier_{op}"], samples[f"raw_{op}"])]
             for what, op in (("store", "set"), ("load", "get"))}
    return {"block_bytes": block_bytes, "blocks": blocks, "batch": batch, "repeats": repeats,
            "jobs_at_once": jobs_at_once, "connections": config.remote.connections,
            "clients": clients, "io_processes": config.remote.io_processes,
            "cluster": config.remote.cluster, "mac": config.remote.auth_key_file is not None,
            "gbps": gbps, "failed": bad, "tier_stats": stats,
            "share": {k: round(statistics.median(v), 3) for k, v in share.items()},
            "share_range": {k: [round(min(v), 3), round(max(v), 3)] for k, v in share.items()}}
