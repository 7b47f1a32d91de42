"""``kvtier bench``: replay a request trace through the real manager, transfer engine and tiers.

Each trace block (512 tokens) is one kvtier block of synthetic KV bytes (bf16 noise seeded by
the block's key, so every load can be checked byte for byte). A simulated engine keeps an LRU
prefix cache of ``gpu_blocks`` engine blocks in front of kvtier (the "GPU" is host memory on a
machine without CUDA: GPU<->CPU figures are then memcpy figures). Per request:

1. the longest prefix already in the engine cache is a GPU hit;
2. the next run is looked up in kvtier and loaded from CPU memory (blocks held on disk or in
   the shared tier are promoted into it first: the lookup answers "not yet" until then);
3. the rest is "computed" (written into engine blocks) and offered to kvtier for storing.

Stores, promotions, demotions and deletions run asynchronously, as in the engine; loads are
waited for. Every job is planned and submitted with the calls the vLLM connector makes
(``prepare_load``, ``kvtier.transfer.jobs``, ``TransferEngine.submit`` of the same specs,
``record_load`` from the job's measured hops), so the figures, ``wrong_blocks`` included, are
about the path vLLM runs.
"""

from __future__ import annotations

import os
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence, TypeVar

import torch
import xxhash

from kvtier.bench.trace import TRACE_BLOCK_TOKENS, TraceRequest
from kvtier.config import KvtierConfig
from kvtier.observe.events import EventPublisher, ManagerFeed, MetadataCache
from kvtier.manager.factory import build_manager
from kvtier.manager.host import open_host_tier
from kvtier.manager.specs import BackgroundTransfer, LoadStoreSpec, Medium, RequestContext
from kvtier.observe.metrics import MetricsExporter
from kvtier.transfer.jobs import (gpu_untrusted, is_promotion, measured_hops,
                                  promotion_outcome)
from kvtier.runtime.snapshot import SnapshotWriter
from kvtier.runtime.worker import WorkerRuntime
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.tiers.layout import BlockGeometry
from kvtier.tiers.remote.presence import open_remote_directory

BENCH_LAYERS = 4
TIERS = ("GPU", "CPU", "DISK", "REMOTE")  # where a block's hit came from
T = TypeVar("T")


class CallTimer(Protocol):
    """Times the calls the simulated scheduler thread makes into the manager (a scheduler
    step must never wait on a tier); a benchmark passes one, the CLI runs the calls as they
    are."""

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...

    def summary(self) -> dict[str, Any]: ...


def _untimed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return fn(*args, **kwargs)


def bench_geometry(block_bytes: int) -> BlockGeometry:
    page = block_bytes // (BENCH_LAYERS * 2)
    if page <= 0 or page * BENCH_LAYERS * 2 != block_bytes or page % 2:
        raise ValueError(f"block size must be a multiple of {BENCH_LAYERS * 4} bytes, got {block_bytes}")
    return BlockGeometry(num_layers=BENCH_LAYERS, kv_parts=2, engine_blocks_per_block=1,
                         page_bytes=page, dtype="bfloat16", model="kvtier-bench-synthetic")


def block_key(hash_id: int) -> bytes:
    return hash_id.to_bytes(8, "little")


def synth_tokens(hash_id: int, n: int) -> array:
    """Stand-in token ids for a trace block (traces carry hashes, not tokens), for events."""
    base = (hash_id * 7919) % 1_000_000
    return array("q", range(base, base + n))


def synth_block(key: bytes, block_bytes: int) -> torch.Tensor:
    """Deterministic KV-like bytes for ``key`` (bf16 noise: compresses like real KV)."""
    g = torch.Generator().manual_seed(xxhash.xxh64_intdigest(key) & (2**63 - 1))
    return torch.randn(block_bytes // 2, generator=g, dtype=torch.float32).to(torch.bfloat16).view(torch.uint8)


@dataclass
class BenchResult:
    requests: int = 0
    blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS + ("MISS",), 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS + ("MISS",), 0))
    wrong_blocks: int = 0
    failed_loads: int = 0
    failed_jobs: int = 0
    seconds: float = 0.0

    def rates(self, what: dict[str, int]) -> dict[str, float]:
        total = sum(what.values()) or 1
        return {k: v / total for k, v in what.items()}


class EngineCache:
    """The simulated engine's own prefix cache: LRU over engine block ids, with pins."""

    def __init__(self, num_blocks: int) -> None:
        self.lru: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(num_blocks))
        self.pins: dict[int, int] = {}

    def prefix_hits(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if key not in self.lru:
                break
            self.lru.move_to_end(key)
            n += 1
        return n

    def allocate(self, keys: Sequence[bytes]) -> list[int] | None:
        """Engine blocks for ``keys``, returned pinned (the caller unpins); None if every
        candidate is pinned by an in-flight transfer (the caller waits and retries)."""
        ids: list[int] = []
        for key in keys:
            block = self.lru.get(key)
            if block is None:  # not resident further along the prompt: take a block
                if not self.free:
                    victim = next((k for k, b in self.lru.items() if not self.pins.get(b)), None)
                    if victim is None:
                        self.pin(ids, -1)
                        return None
                    self.free.append(self.lru.pop(victim))
                block = self.free.pop()
                self.lru[key] = block
            self.lru.move_to_end(key)
            self.pin([block], 1)
            ids.append(block)
        return ids

    def release(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            block = self.lru.pop(key, None)
            if block is not None:
                self.free.append(block)

    def pin(self, ids: Sequence[int], delta: int) -> None:
        for b in ids:
            self.pins[b] = self.pins.get(b, 0) + delta


class Replay:
    def __init__(self, config: KvtierConfig, block_bytes: int, gpu_blocks: int,
                 overlap: bool = False, call_timer: CallTimer | None = None) -> None:
        self.overlap = overlap
        self.geometry = bench_geometry(block_bytes)
        g = self.geometry
        self.gpu = {f"layer.{i}": torch.zeros((2, gpu_blocks, g.page_bytes), dtype=torch.uint8)
                    for i in range(g.num_layers)}
        self.view = GpuKvView(self.gpu, layout="kv_first")
        instance = f"bench-{os.getpid()}-{id(self):x}"  # the host tier's name for this run
        self.worker = WorkerRuntime.create(config, self.view, g, instance=instance)
        # a trace block is one kvtier block of 512 tokens, whatever block_tokens the YAML says
        # (the manager's cost model prices recompute per block with it)
        # the presence directory on its own connection, as the connector's scheduler side opens
        # it; the worker's I/O processes move the bytes
        self.remote = open_remote_directory(config.remote, g, world_size=1, replicated=False)
        self.host = (open_host_tier(config, g.fingerprint(), g.block_bytes, instance)
                     if config.host is not None else None)
        self.manager = build_manager(replace(config, block_tokens=TRACE_BLOCK_TOKENS),
                                     g.block_bytes, self.worker.disk_keys(), remote=self.remote,
                                     host=self.host)
        self.lookup_wait_s = 0.0  # time lookups answered "not yet" (presence, promotions)
        self.call_timer = call_timer
        self._scheduler_call = call_timer.call if call_timer is not None else _untimed
        self.engine_cache = EngineCache(gpu_blocks)
        self.result = BenchResult()
        self._stores: dict[int, tuple[tuple[bytes, ...], list[int]]] = {}
        self._background: dict[int, BackgroundTransfer] = {}  # engine job -> transfer
        self.metadata: MetadataCache | None = None
        self.events: ManagerFeed | None = None
        if config.events is not None:  # full payloads: synthetic tokens, parents from the trace
            self.metadata = MetadataCache(config.cpu_slots(g.block_bytes)
                                          + config.disk_blocks(g.block_bytes) + gpu_blocks)
            publisher = EventPublisher(config.events, block_tokens=TRACE_BLOCK_TOKENS,
                                       metadata=self.metadata)
            self.events = ManagerFeed(self.manager, publisher)
        self.metrics = MetricsExporter(config.metrics, self.live_stats) if config.metrics else None
        path = config.snapshot_path()
        self.snapshot = SnapshotWriter(path, self.live_stats, config.stats.interval_s) if path else None

    def _tier_stats(self) -> dict:
        """Manager, tier and transfer counters: shared by the live stats and the final report."""
        out = {
            "block_bytes": self.geometry.block_bytes,
            "transfers": {k: v.to_dict() for k, v in self.worker.engine.stats().items()},
            "manager": self.manager.stats.snapshot(),
            "usage": self.manager.usage(),
        }
        if self.worker.store is not None:
            out["disk"] = self.worker.store.stats().to_dict()
        if self.worker.remote is not None:
            out["remote"] = {**self.worker.remote.stats().to_dict(),
                             "lookup_wait_s": round(self.lookup_wait_s, 4)}
        if self.call_timer is not None:
            out["scheduler_calls"] = self.call_timer.summary()
        return out

    def live_stats(self) -> dict:
        """What ``kvtier stats`` shows for this running instance (and its metrics endpoint)."""
        r = self.result
        blocks, tokens = dict(r.blocks), dict(r.tokens)
        out = self._tier_stats()
        out["requests"] = {"hit_blocks": {t: blocks[t] for t in TIERS},
                           "hit_tokens": {t: tokens[t] for t in TIERS},
                           "miss_blocks": blocks["MISS"], "miss_tokens": tokens["MISS"]}
        if self.events is not None:
            pub = self.events.publisher
            out["events"] = {**pub.stats().to_dict(), "endpoint": pub.endpoint,
                             "replay_endpoint": pub.replay_endpoint}
        if self.metrics is not None:
            out["metrics_url"] = self.metrics.url
        return out

    # -- the simulated engine's side of the data
    def _write_gpu(self, key: bytes, block: int) -> None:
        data = synth_block(key, self.geometry.block_bytes).view(self.geometry.num_layers, 2, -1)
        for layer, t in enumerate(self.gpu.values()):
            t[:, block] = data[layer]

    def _gpu_matches(self, key: bytes, block: int) -> bool:
        data = synth_block(key, self.geometry.block_bytes).view(self.geometry.num_layers, 2, -1)
        return all(torch.equal(t[:, block], data[layer]) for layer, t in enumerate(self.gpu.values()))

    # -- asynchronous completions
    def pump(self) -> None:
        for t in self.manager.take_background_transfers():
            self._background[self.worker.engine.submit(t.src, t.dst)] = t
        for res in self.worker.poll():
            self.result.failed_jobs += not res.ok
            if res.job_id in self._stores:
                keys, ids = self._stores.pop(res.job_id)
                self.manager.complete_store(keys, res.ok)
                self.engine_cache.pin(ids, -1)
            elif res.job_id in self._background:
                t = self._background.pop(res.job_id)
                if is_promotion(t.src.medium, t.dst.medium):
                    out = promotion_outcome(res, t.keys)
                    for medium, nbytes, seconds in out.measured:
                        self.manager.record_load(medium, nbytes, seconds)
                    self.result.failed_loads += len(out.failed)
                    # a read that reported unreadable keys is not ok, but only they failed
                    self.manager.complete_background(t.id, res.error is None, out.failed,
                                                     out.transient)
                else:
                    self.manager.complete_background(t.id, res.ok)
        if self.events is not None:
            self.events.pump()

    def drain(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self._stores or self._background or self.worker.engine.pending():
            self.pump()
            if time.monotonic() > deadline:
                raise TimeoutError("transfers did not finish")
            time.sleep(0.001)
        self.pump()

    def _allocate(self, keys: Sequence[bytes]) -> list[int]:
        ids = self.engine_cache.allocate(keys)
        if ids is None:  # every engine block is held by an in-flight store: let them finish
            self.drain()
            ids = self.engine_cache.allocate(keys)
            if ids is None:
                raise RuntimeError(f"engine cache of {len(self.engine_cache.free)} free blocks "
                                   f"cannot hold a {len(keys)}-block request; raise --gpu-blocks")
        return ids

    def _count(self, tier: str, req: TraceRequest, first: int, n: int) -> None:
        self.result.blocks[tier] += n
        self.result.tokens[tier] += sum(req.block_tokens(i) for i in range(first, first + n))

    def _lookup(self, keys: Sequence[bytes]) -> int:
        """Hits of ``keys``. A lookup never blocks; while the shared tier's answer is pending
        the simulated scheduler steps (pumps completions) and asks again, as vLLM does after
        a ``None`` from the connector."""
        first = None
        while True:
            t0 = time.perf_counter()
            found = self._scheduler_call(self.manager.lookup, keys, sighting=first is None)
            now = time.perf_counter()
            if not found.pending:
                if first is not None:
                    self.lookup_wait_s += now - first
                return found.num_hits
            first = first or t0
            self.pump()
            time.sleep(0.0005)

    def run_request(self, req: TraceRequest) -> None:
        keys = [block_key(h) for h in req.hash_ids]
        n_gpu = self.engine_cache.prefix_hits(keys)
        self._count("GPU", req, 0, n_gpu)
        rest = keys[n_gpu:]
        loaded = 0
        if rest:
            hits = self._lookup(rest)
            plan = (self._scheduler_call(self.manager.prepare_load, rest[:hits])
                    if hits else None)
            if plan is not None and plan.keys:
                ids = self._allocate(plan.keys)
                job = self.worker.engine.submit(plan.src, LoadStoreSpec.gpu(ids))
                res = self.worker.engine.wait([job])[0]
                for medium, nbytes, seconds in measured_hops(res):
                    self.manager.record_load(medium, nbytes, seconds)
                self.engine_cache.pin(ids, -1)
                self.manager.complete_load(plan.keys)  # a copy that failed fails no key
                self.result.failed_jobs += not res.ok
                good = 0
                sources = plan.sources or (Medium.CPU,) * len(plan.keys)
                for key, block, source in zip(plan.keys, ids, sources):
                    if gpu_untrusted(res):  # the copy raised: recompute every block
                        break
                    self.result.wrong_blocks += not self._gpu_matches(key, block)
                    self._count(source.value, req, n_gpu + good, 1)
                    good += 1
                loaded = good
                self.result.failed_loads += len(plan.keys) - good
                self.engine_cache.release(plan.keys[good:])  # recomputed below
        first_miss = n_gpu + loaded
        misses = keys[first_miss:]
        self._count("MISS", req, first_miss, len(misses))
        if misses:
            if self.metadata is not None:
                for i in range(first_miss, len(keys)):
                    if req.block_tokens(i):
                        self.metadata.remember(keys[i], synth_tokens(req.hash_ids[i], req.block_tokens(i)),
                                               keys[i - 1] if i else None)
            ids = self._allocate(misses)
            for key, block in zip(misses, ids):
                self._write_gpu(key, block)
            ctx = RequestContext(first_block_index=first_miss, num_prompt_blocks=len(keys),
                                 block_tokens=TRACE_BLOCK_TOKENS,
                                 parent_key=keys[first_miss - 1] if first_miss else None)
            plan = self.manager.prepare_store(misses, ctx)
            if plan.keys:
                by_key = dict(zip(misses, ids))
                store_ids = [by_key[k] for k in plan.keys]
                self.engine_cache.pin(store_ids, 1)
                job = self.worker.engine.submit(LoadStoreSpec.gpu(store_ids), plan.dst)
                self._stores[job] = (plan.keys, store_ids)
            self.engine_cache.pin(ids, -1)
        # the request finished: its chain head-most-recent, as the vLLM connector ranks it
        self.manager.touch(keys[::-1])  # untimed: the call timer times lookups and loads
        self.result.requests += 1
        self.pump()

    def run(self, trace: Sequence[TraceRequest], progress: Callable[[int], None] | None = None) -> BenchResult:
        start = time.perf_counter()
        for i, req in enumerate(trace):
            self.run_request(req)
            if not self.overlap:
                self.drain()
            if progress is not None:
                progress(i + 1)
        self.drain()
        self.result.seconds = time.perf_counter() - start
        return self.result

    def report(self) -> dict:
        r = self.result
        out = {
            "requests": r.requests,
            "seconds": round(r.seconds, 3),
            "blocks": r.blocks,
            "tokens": r.tokens,
            "block_hit_rate": {k: round(v, 4) for k, v in r.rates(r.blocks).items()},
            "token_hit_rate": {k: round(v, 4) for k, v in r.rates(r.tokens).items()},
            **self._tier_stats(),
            "wrong_blocks": r.wrong_blocks,
            "failed_loads": r.failed_loads,
            "failed_jobs": r.failed_jobs,
            "gpu_is_simulated": self.view.device.type != "cuda",
        }
        cost = self.manager.cost
        if cost is not None:
            out["cost"] = cost.snapshot()
        return out

    def close(self) -> None:
        if self.events is not None:
            self.events.pump()
            self.events.publisher.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.snapshot is not None:
            self.snapshot.close()
        if self.remote is not None:
            self.remote.close()
            self.remote.store.close()
        if self.host is not None:
            self.host.close()
        self.worker.close()


__all__ = ["Replay", "BenchResult", "bench_geometry", "block_key", "synth_block", "Medium"]
