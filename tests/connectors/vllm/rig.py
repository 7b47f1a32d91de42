"""A kvtier rig on top of the harness: real vLLM Scheduler + KVTierConnector workers on CPU.

Sizes: the harness model has 2 layers, 2 KV heads, head_dim 32, float32, so one engine block
of 16 tokens is 8 KiB per layer and one kvtier block (= one vLLM block) is 16 KiB.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import vllm_harness as vh
from async_loop import AsyncEngineLoop

from kvtier.manager.specs import Medium

BS = 16
BLOCK_BYTES = 2 * BS * 2 * 64 * 4  # layers * tokens * heads * (K+V dims) * float32
MODULE = "kvtier.connectors.vllm"


def kvtier_config(cpu_blocks: int, disk_dir: Any = None, disk_blocks: int = 64,
                  block_tokens: int = BS, io_process: bool = True, **extra: Any) -> dict:
    cfg: dict[str, Any] = {"block_tokens": block_tokens,
                           "tiers": {"cpu": {"capacity": cpu_blocks * BLOCK_BYTES * block_tokens // BS}}}
    if disk_dir is not None:
        cfg["tiers"]["disk"] = {"path": str(disk_dir),
                                "capacity": disk_blocks * BLOCK_BYTES * block_tokens // BS,
                                "fsync": False, "io_process": io_process}
    cfg.update(extra)
    return {"kvtier": cfg}


@dataclass
class Rig:
    vc: Any
    kcc: Any
    sched: Any
    caches: list
    workers: list
    forwards: list
    loop: Any = None
    checks: list = field(default_factory=list)

    @property
    def connector(self):
        return self.sched.connector

    @property
    def side(self):
        return self.sched.connector._sched

    def worker_side(self, i: int = 0):
        return self.workers[i]._worker

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()


def make_rig(model_dir: str, extra: dict, *, num_blocks: int = 64, world_size: int = 1,
             max_num_batched_tokens: int = 512, check_kv: bool = True,
             kv_events: bool = False, after_forward=None,
             async_scheduling: bool = False) -> Rig:
    """Scheduler first (as in vLLM with multiprocessing on, it then reads the disk index
    itself), then one worker per rank with its own KV caches and fake forward."""
    vc = vh.make_vllm_config(model_dir, connector="KVTierConnector", module_path=MODULE,
                             extra_config=extra, block_size=BS, world_size=world_size,
                             max_num_batched_tokens=max_num_batched_tokens, kv_events=kv_events)
    kcc = vh.make_kv_cache_config(vc, num_blocks=num_blocks)
    sched = vh.make_scheduler(vc, kcc, async_scheduling)
    caches, workers, forwards = vh.rank_workers(
        vc, kcc, world_size, lambda c: vh.FakeForward(c, vh.ModelShape(), BS))
    rig = Rig(vc, kcc, sched, caches, workers, forwards)

    def check(i, w, so):
        if check_kv:  # every scheduled request's computed tokens hold exactly the right KV
            for rid in so.num_scheduled_tokens:
                req = sched.requests[rid]
                n = min(req.num_computed_tokens, req.num_tokens)
                bad = forwards[i].mismatches(req.all_token_ids, vh.block_ids_of(sched, rid), n)
                rig.checks.append((rid, i, bad))
        if after_forward is not None:
            after_forward(i, w, so)

    loop_cls = AsyncEngineLoop if async_scheduling else vh.EngineLoop
    rig.loop = loop_cls(sched, workers, forwards, after_forward=check)
    return rig


def bad_checks(rig: Rig) -> list:
    return [c for c in rig.checks if c[2]]


def settle(rig: Rig) -> None:
    """Run (empty) steps until no kvtier transfer is in flight."""
    rig.loop.run_until_idle()


def resident(manager: Any, keys: Any) -> tuple[Medium, ...]:
    """Where the leading run of ``keys`` is held (READY in CPU memory, else on disk), read
    from the manager's tier indexes. Unlike ``lookup``, it promotes nothing: a lookup that
    finds blocks on disk starts their promotion into the CPU tier."""
    cpu, disk = manager.tier(Medium.CPU), manager.tier(Medium.DISK)
    out: list[Medium] = []
    for key in keys:
        if cpu.is_ready(key):
            out.append(Medium.CPU)
        elif disk is not None and disk.is_ready(key) and key not in cpu:
            out.append(Medium.DISK)
        else:
            break
    return tuple(out)


def tiered_manager(manager: Any) -> Any:
    """The manager under admission wrappers (``inner``) and test proxies (``_inner``): the one
    that calls its own methods (``record_promotion`` at a promotion's settling, say)."""
    while True:
        own = vars(manager)
        if "_inner" in own:
            manager = own["_inner"]
        elif "inner" in own:
            manager = own["inner"]
        else:
            return manager


def record_hit_sources(rig: Rig) -> dict[str, dict]:
    """Wrap the connector's ``get_external_cache_hit_sources``: request id -> the hit's tokens
    per source (vLLM's ``CacheHitSource`` names) as vLLM's scheduler got them."""
    conn = rig.connector
    seen: dict[str, dict] = {}
    original = conn.get_external_cache_hit_sources

    def wrapped(request, num_external_tokens):
        got = original(request, num_external_tokens)
        seen[request.request_id] = {k.name: v for k, v in got.items()}
        return got

    conn.get_external_cache_hit_sources = wrapped
    return seen


def promotions_in(records) -> list:
    """The background jobs of ``records``' steps that promote blocks into the CPU tier."""
    return [j for r in records for j in r.scheduler_output.kv_connector_metadata.background
            if j.dst.medium is Medium.CPU and j.src.medium in (Medium.DISK, Medium.REMOTE)]


def push_to_disk(rig: Rig, make: Any, seed: int, blocks: int = 4) -> tuple[Any, list]:
    """Run a 70-token prompt, then another that pushes it out of a ``blocks``-block CPU tier:
    the first one's blocks end on disk only. Returns its request and its first keys."""
    a = make(vh.random_tokens(70, seed=seed), max_tokens=3)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    rig.loop.add(make(vh.random_tokens(70, seed=seed + 1), max_tokens=3))
    rig.loop.run_until_idle()
    settle(rig)
    keys = [bytes(h) for h in a.block_hashes[:blocks]]
    assert resident(rig.side.manager, keys) == (Medium.DISK,) * blocks
    return a, keys


class StoreGate:
    """Holds every GPU->CPU copy of a worker until released, so stores are deterministically
    in flight across steps. ``open()`` releases them (also done around fenced waits, where
    the worker must be able to finish the fenced stores)."""

    def __init__(self, worker_connector) -> None:
        import asyncio
        import threading

        from kvtier.manager.specs import Medium

        self.event = threading.Event()
        ws = worker_connector._worker
        handler = ws.runtime.engine._handlers[(Medium.GPU, Medium.CPU)]
        original = handler.run
        gate = self.event

        async def gated_run(src, dst):
            await asyncio.get_running_loop().run_in_executor(None, gate.wait)
            return await original(src, dst)

        handler.run = gated_run
        self.flushes = 0
        orig_hp = ws.handle_preemptions

        def handle_preemptions(meta):
            if getattr(meta, "flush", ()):
                self.flushes += 1
                was = gate.is_set()
                gate.set()
                try:
                    orig_hp(meta)
                finally:
                    if not was:
                        gate.clear()
            else:
                orig_hp(meta)

        ws.handle_preemptions = handle_preemptions

    def open(self) -> None:
        self.event.set()

    def close(self) -> None:
        self.event.clear()


def assert_cpu_tier_exact(rig: Rig, requests, worker: int = 0) -> int:
    """Every READY block in the CPU tier holds exactly the KV of its tokens; returns how many
    blocks were checked (the tier's bytes are compared to the fake model's values)."""
    import torch

    known = {}
    for req in requests:
        for i, h in enumerate(req.block_hashes):
            known[bytes(h)] = (list(req.all_token_ids), i)
    pool = rig.worker_side(worker).runtime.pool
    tier = rig.side.manager.tier(Medium.CPU)
    checked = 0
    for key, entry in tier.entries.items():
        if entry.state.name != "READY" or key not in known:
            continue
        tokens, index = known[key]
        slot = pool.slot_view(entry.slot).view(torch.float32)  # [layer, 1, 1, page floats]
        for layer in range(slot.shape[0]):
            page = slot[layer, 0, 0].view(2, BS, 64)  # [H, N, 2D]
            for t in range(BS):
                want = vh.token_kv_value(tokens, index * BS + t, layer)
                assert torch.all(page[:, t, :] == want), (key.hex()[:8], layer, t)
        checked += 1
    return checked
