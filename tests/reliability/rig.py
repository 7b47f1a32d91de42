"""A full stack driven like the vLLM connector drives it, with every served block checked.

Engine KV lives in host tensors (the "GPU"), then a real CPU pool, a real DiskStore, the real
transfer engine (one worker per route) and the real TieredOffloadingManager. The rig plays the
scheduler: it asks the manager, submits the jobs the plans call for, keeps many of them in
flight at once, and settles every prepare with exactly one complete. Each block's bytes name
their key (reliability.blocks), so a load that puts anything but that key's bytes into the
engine is counted in ``wrong_blocks``: the one number that must always be zero.

It makes the calls the connector makes, in the connector's order: ``lookup`` until it no longer
answers "not yet" (a disk hit is promoted into CPU memory by a background move first, which the
rig runs and settles meanwhile, as engine steps would), ``prepare_load`` and one CPU -> GPU job,
results read with ``kvtier.transfer.jobs`` (the worker side's own functions), ``record_load``
from what each load and promotion measured, stores and background moves as plain
``engine.submit`` of the plans' specs. Only the OffloadingManager contract is used.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from reliability.blocks import GEO, block

from kvtier.manager.disk_health import DiskHealth
from kvtier.manager.specs import LoadPlan, LoadStoreSpec, Medium
from kvtier.manager.tiered import TieredOffloadingManager
from kvtier.transfer.jobs import (gpu_untrusted, is_promotion, measured_hops,
                                  promotion_outcome)
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.transfer import TransferEngine
from kvtier.transfer.cpu_copy import CpuToGpuHandler, GpuToCpuHandler
from kvtier.transfer.disk_io import CpuToDiskHandler, DiskDropHandler, DiskToCpuHandler


@dataclass
class RigCounters:
    stores: int = 0
    stored_blocks: int = 0
    loads: int = 0
    loaded_blocks: Counter = field(default_factory=Counter)  # by source tier
    failed_load_blocks: int = 0
    wrong_blocks: int = 0
    failed_jobs: Counter = field(default_factory=Counter)  # by kind of job
    load_truncated: int = 0
    promoted_blocks: int = 0  # read into CPU memory by promotions (disk -> CPU)


@dataclass
class _Op:
    kind: str  # "store", "load", "bg"
    keys: tuple[bytes, ...] = ()
    gpu_ids: list[int] = field(default_factory=list)
    plan: LoadPlan | None = None
    bg_id: int = 0  # background: the manager's transfer id; load: the load's number
    src: Medium | None = None
    dst: Medium | None = None


class StackRig:
    def __init__(self, root: Path, *, cpu_blocks: int = 16, disk_blocks: int = 64,
                 gpu_blocks: int = 96, compression: str = "zstd", fsync: bool = False,
                 segment_bytes: int = 16 * (56 + 16 + 2048), flush_reserve: int | None = None,
                 health: DiskHealth | None = None, disk_write_jobs: int = 2,
                 compressible: bool = False) -> None:
        g = GEO
        self.compressible = compressible  # block bytes zstd can shrink (stored compressed)
        self.gpu = {f"layer.{i}": torch.zeros((g.kv_parts, gpu_blocks, g.page_bytes), dtype=torch.uint8)
                    for i in range(g.num_layers)}
        self.view = GpuKvView(self.gpu, layout="kv_first")
        self.pool = CpuBlockPool(g, cpu_blocks, pin=False, background=False)
        self.store = DiskStore(root, g, compression=compression, fsync=fsync,
                               segment_bytes=segment_bytes, compact_budget_bytes=segment_bytes // 2)
        self.engine = TransferEngine([
            GpuToCpuHandler(self.view, self.pool, concurrency=2),
            CpuToGpuHandler(self.view, self.pool, concurrency=2),
            CpuToDiskHandler(self.pool, self.store, concurrency=disk_write_jobs),
            DiskToCpuHandler(self.pool, self.store, concurrency=4, read_threads=2),
            DiskDropHandler(self.store),
        ])
        self.manager = TieredOffloadingManager(
            cpu_blocks=cpu_blocks, disk_blocks=disk_blocks, flush_reserve=flush_reserve,
            initial_disk_keys=self.store.keys_by_age(), disk_health=health,
        )
        self.free_gpu = list(range(gpu_blocks))
        self.ops: dict[int, _Op] = {}
        self.c = RigCounters()
        self.events: deque = deque(maxlen=4096)  # the latest events, for tests to inspect

    # -- the engine's own KV (host tensors standing in for GPU memory) -------------------------
    def _write_gpu(self, key: bytes, b: int) -> None:
        data = torch.frombuffer(bytearray(block(key, compressible=self.compressible)),
                                dtype=torch.uint8).view(
            GEO.num_layers, GEO.kv_parts, GEO.page_bytes)
        for layer, t in enumerate(self.gpu.values()):
            t[:, b] = data[layer]

    def _gpu_holds(self, key: bytes, b: int) -> bool:
        got = torch.stack([t[:, b] for t in self.gpu.values()]).reshape(-1)
        return bytes(got.numpy()) == block(key, compressible=self.compressible)

    def _take_gpu(self, n: int) -> list[int] | None:
        if len(self.free_gpu) < n:
            self.drain()
            if len(self.free_gpu) < n:
                return None
        ids, self.free_gpu = self.free_gpu[:n], self.free_gpu[n:]
        return ids

    # -- requests -------------------------------------------------------------------------------
    def store_blocks(self, keys: Sequence[bytes]) -> None:
        """The engine computed ``keys``: offer them to kvtier (asynchronous GPU -> CPU copy)."""
        ids = self._take_gpu(len(keys))
        if ids is None:
            return
        for k, b in zip(keys, ids):
            self._write_gpu(k, b)
        plan = self.manager.prepare_store(list(keys))
        by_key = dict(zip(keys, ids))
        used = [by_key[k] for k in plan.keys]
        self.free_gpu.extend(b for b in ids if b not in used)
        self.c.stores += 1
        if plan.keys:
            job = self.engine.submit(LoadStoreSpec.gpu(used), plan.dst)
            self.ops[job] = _Op("store", plan.keys, used)

    def lookup(self, keys: Sequence[bytes], timeout: float = 60.0) -> int:
        """Hits of ``keys``, asked again (while the rig pumps, as engine steps would) until the
        manager no longer answers "not yet" (a promotion in flight)."""
        deadline = time.monotonic() + timeout
        found = self.manager.lookup(list(keys))
        while found.pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"a lookup still pending after {timeout}s")
            time.sleep(0.0002)
            self.pump()
            found = self.manager.lookup(list(keys), sighting=False)
        return found.num_hits

    def load_blocks(self, keys: Sequence[bytes]) -> int:
        """Look ``keys`` up and start loading the hit prefix; returns how many are loading."""
        hits = self.lookup(keys)
        if not hits:
            return 0
        if len(self.free_gpu) < hits:
            self.drain()
        plan = self.manager.prepare_load(list(keys[:hits]))
        if len(plan.keys) < hits:
            self.c.load_truncated += 1
        if not plan.keys:
            return 0
        ids = self._take_gpu(len(plan.keys))
        assert ids is not None, "rig bug: drained, yet no engine blocks for a load"
        self.c.loads += 1
        job = self.engine.submit(plan.src, LoadStoreSpec.gpu(ids))
        self.ops[job] = _Op("load", plan.keys, ids, plan)
        return len(plan.keys)

    # -- completions ------------------------------------------------------------------------------
    def pump(self) -> None:
        for res in self.engine.get_finished():
            op = self.ops.pop(res.job_id)
            if op.kind == "store":
                if not res.ok:
                    self.c.failed_jobs["store"] += 1
                self.manager.complete_store(op.keys, res.ok)
                self.c.stored_blocks += len(op.keys) if res.ok else 0
                self.free_gpu.extend(op.gpu_ids)
            elif op.kind == "load":
                self._settle_load(op, res)
            elif is_promotion(op.src, op.dst):
                out = promotion_outcome(res, op.keys)
                if res.error is not None:
                    self.c.failed_jobs["promotion"] += 1
                for medium, nbytes, seconds in out.measured:
                    self.manager.record_load(medium, nbytes, seconds)
                self.c.failed_load_blocks += len(out.failed)
                self.c.promoted_blocks += len(op.keys) - len(out.failed)
                self.manager.complete_background(op.bg_id, res.error is None, out.failed,
                                                 out.transient)  # failed keys alone: a partial read
            else:
                if not res.ok:
                    self.c.failed_jobs[f"bg->{op.dst.value}"] += 1
                self.manager.complete_background(op.bg_id, res.ok)
        for t in self.manager.take_background_transfers():
            job = self.engine.submit(t.src, t.dst)
            self.ops[job] = _Op("bg", t.keys, bg_id=t.id, src=t.src.medium, dst=t.dst.medium)
        self.events.extend(self.manager.take_events())  # the connector forwards these each step

    def _settle_load(self, op: _Op, res) -> None:
        plan = op.plan
        untrusted = gpu_untrusted(res)  # the copy raised: no engine block is trusted
        if res.error is not None:
            self.c.failed_jobs["load"] += 1
        for medium, nbytes, seconds in measured_hops(res):
            self.manager.record_load(medium, nbytes, seconds)
        sources = plan.sources or (Medium.CPU,) * len(plan.keys)
        for k, b, source in zip(op.keys, op.gpu_ids, sources):
            if untrusted:
                break
            self.c.loaded_blocks[source.value] += 1
            if not self._gpu_holds(k, b):
                self.c.wrong_blocks += 1
        self.manager.complete_load(op.keys)  # a failed copy fails no key: the CPU copy is intact
        self.free_gpu.extend(op.gpu_ids)

    def in_flight(self) -> int:
        return len(self.ops)

    def throttle(self, max_in_flight: int, timeout: float = 60.0) -> None:
        """Pump until at most ``max_in_flight`` jobs are running (an engine step's cadence)."""
        deadline = time.monotonic() + timeout
        self.pump()
        while len(self.ops) > max_in_flight:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.ops)} jobs still in flight after {timeout}s")
            time.sleep(0.0002)
            self.pump()

    def drain(self, timeout: float = 60.0) -> None:
        """Run until no job is in flight and the manager wants nothing more moved."""
        deadline = time.monotonic() + timeout
        while True:
            self.pump()
            if not self.ops:  # pump submits what the manager queued
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.ops)} jobs still in flight after {timeout}s")
            time.sleep(0.0005)

    def leaks(self) -> dict[str, int]:
        """After ``drain``: everything that should be back to zero."""
        return {"pins": self.manager.pins(), "engine_pending": self.engine.pending(),
                "ops": len(self.ops),
                "protocol_errors": self.manager.stats.protocol_errors,
                "gpu_blocks_missing": len(self.gpu["layer.0"][0]) - len(self.free_gpu)}

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.engine.close()
            self.store.close()
