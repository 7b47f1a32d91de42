"""The host's raw Redis / Valkey ceiling: what the server serves to many plain clients at once.

The shared tier's speed is only meaningful as a share of what its store can serve on the same
host and server layout, so this measures that ceiling in the same run: ``clients`` processes
(redis-py with hiredis, one connection each, or a Cluster client), each SETting then GETting its
share of ``blocks`` values of ``value_bytes`` in pipelines of ``pipeline``, all started at one
barrier. GB/s = all bytes / (last finish - common start). Nothing else runs in the clients:
no checksums, no copies into CPU slots.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from dataclasses import dataclass

from kvtier.config.remote import RemoteTierConfig


@dataclass(frozen=True)
class Ceiling:
    clients: int
    value_bytes: int
    blocks: int
    set_gbps: float
    get_gbps: float


def _client(cfg: RemoteTierConfig):
    import redis

    if cfg.cluster:
        from redis.cluster import ClusterNode, RedisCluster

        nodes = [ClusterNode(h, int(p)) for h, _, p in (n.rpartition(":") for n in cfg.nodes)]
        return RedisCluster(startup_nodes=nodes, socket_timeout=30)
    return redis.Redis.from_url(cfg.url, socket_timeout=30)


def _run_client(cfg: RemoteTierConfig, keys: list[bytes], value_bytes: int, pipeline: int,
                barrier, out) -> None:
    client = _client(cfg)
    value = os.urandom(value_bytes)
    client.ping()
    barrier.wait()
    t0 = time.perf_counter()
    for i in range(0, len(keys), pipeline):
        p = client.pipeline(transaction=False)
        for k in keys[i:i + pipeline]:
            p.set(k, value)
        p.execute()
    t_set = time.perf_counter()
    barrier.wait()  # every client's SETs are in before any GET starts
    t1 = time.perf_counter()
    got = 0
    for i in range(0, len(keys), pipeline):
        p = client.pipeline(transaction=False)
        for k in keys[i:i + pipeline]:
            p.get(k)
        got += sum(len(v) for v in p.execute() if v is not None)
    t_get = time.perf_counter()
    p = client.pipeline(transaction=False)  # untimed: the next round starts from the same state
    for k in keys:
        p.delete(k)
    p.execute()
    out.put((t0, t_set, t1, t_get, got))


def measure_ceiling(cfg: RemoteTierConfig, value_bytes: int, total_bytes: int,
                    clients: int, pipeline: int = 8) -> Ceiling:
    """SET then GET ``total_bytes`` in values of ``value_bytes`` from ``clients`` processes."""
    blocks = max(clients * pipeline, total_bytes // value_bytes)
    run = uuid.uuid4().hex[:8]
    keys = [f"ceiling:{run}:{i}".encode() for i in range(blocks)]
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(clients), ctx.Queue()
    procs = [ctx.Process(target=_run_client, args=(cfg, keys[c::clients], value_bytes,
                                                   pipeline, barrier, out), daemon=True)
             for c in range(clients)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    nbytes = blocks * value_bytes
    set_s = max(r[1] for r in results) - min(r[0] for r in results)
    get_s = max(r[3] for r in results) - min(r[2] for r in results)
    if sum(r[4] for r in results) != nbytes:
        raise RuntimeError("the ceiling's GETs did not read back every value it SET")
    return Ceiling(clients, value_bytes, blocks, round(nbytes / set_s / 1e9, 3),
                   round(nbytes / get_s / 1e9, 3))
