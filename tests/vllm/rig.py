"""A kvtier rig on top of the harness: real vLLM Scheduler + KVTierConnector workers on CPU.

Sizes: the harness model has 2 layers, 2 KV heads, head_dim 32, float32, so one engine block
of 16 tokens is 8 KiB per layer and one kvtier block (= one vLLM block) is 16 KiB.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import vllm_harness as vh

BS = 16
BLOCK_BYTES = 2 * BS * 2 * 64 * 4  # layers * tokens * heads * (K+V dims) * float32
MODULE = "kvtier.connectors.vllm"


def kvtier_config(cpu_blocks: int, disk_dir: Any = None, disk_blocks: int = 64,
                  block_tokens: int = BS, **extra: Any) -> dict:
    cfg: dict[str, Any] = {"block_tokens": block_tokens,
                           "tiers": {"cpu": {"capacity": cpu_blocks * BLOCK_BYTES * block_tokens // BS}}}
    if disk_dir is not None:
        cfg["tiers"]["disk"] = {"path": str(disk_dir),
                                "capacity": disk_blocks * BLOCK_BYTES * block_tokens // BS,
                                "fsync": False}
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
             kv_events: bool = False, after_forward=None) -> Rig:
    """Scheduler first (as in vLLM with multiprocessing on, it then reads the disk index
    itself), then one worker per rank with its own KV caches and fake forward."""
    vc = vh.make_vllm_config(model_dir, connector="KVTierConnector", module_path=MODULE,
                             extra_config=extra, block_size=BS, world_size=world_size,
                             max_num_batched_tokens=max_num_batched_tokens, kv_events=kv_events)
    kcc = vh.make_kv_cache_config(vc, num_blocks=num_blocks)
    sched = vh.make_scheduler(vc, kcc)
    caches, workers, forwards = [], [], []
    for rank in range(world_size):
        wvc = vc
        if world_size > 1:  # each worker its own rank (its own disk directory)
            wvc = copy.copy(vc)
            wvc.parallel_config = copy.copy(vc.parallel_config)
            wvc.parallel_config.rank = rank
        c = vh.make_kv_caches(kcc)
        caches.append(c)
        workers.append(vh.make_worker_connector(wvc, kcc, c))
        forwards.append(vh.FakeForward(c, vh.ModelShape(), BS))
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

    rig.loop = vh.EngineLoop(sched, workers, forwards, after_forward=check)
    return rig


def bad_checks(rig: Rig) -> list:
    return [c for c in rig.checks if c[2]]


def settle(rig: Rig, max_steps: int = 50) -> None:
    """Run (empty) steps until no kvtier transfer is in flight."""
    for _ in range(max_steps):
        if not rig.loop.busy():
            return
        rig.loop.step()
    raise AssertionError("kvtier still has work in flight")
