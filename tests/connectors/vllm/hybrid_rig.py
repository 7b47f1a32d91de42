"""A hybrid-allocator rig: vLLM's real Scheduler with two KV cache groups (layer 0 full
attention, layer 1 sliding window), KVTierConnector workers on CPU tensors, and a fake
forward that writes each group's layer into that group's own block table."""

from __future__ import annotations

from typing import Any

import torch
import vllm_harness as vh
from rig import BS, MODULE, Rig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

WINDOW = 2 * BS  # tokens


def make_hybrid_kv_cache_config(vc: Any, num_blocks: int) -> KVCacheConfig:
    shape = vh.ModelShape()
    full = FullAttentionSpec(block_size=BS, num_kv_heads=shape.num_kv_heads,
                             head_size=shape.head_dim, dtype=shape.dtype)
    sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=shape.num_kv_heads,
                                head_size=shape.head_dim, dtype=shape.dtype,
                                sliding_window=WINDOW)
    page = full.page_size_bytes
    names = shape.layer_names
    tensors = [KVCacheTensor(size=page * num_blocks, layers=[n], layer_stride=page * num_blocks,
                             block_stride=page) for n in names]
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                        kv_cache_groups=[KVCacheGroupSpec([names[0]], full),
                                         KVCacheGroupSpec([names[1]], sliding)])
    vc.cache_config.num_gpu_blocks = num_blocks
    return cfg


class HybridForward:
    """Writes every scheduled token's KV: layer g through group g's block table."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        shape = vh.ModelShape()
        self.layers = [kv_caches[n].view(shape.dtype) for n in shape.layer_names]

    def write(self, scheduler: Any, so: Any, tokens: Any = None) -> None:
        """``tokens`` (the loop's known tokens of a request): only the sync loop drives this."""
        starts = vh.scheduled_starts(so)
        for req_id, n in so.num_scheduled_tokens.items():
            req = scheduler.requests[req_id]
            tables = scheduler.kv_cache_manager.get_block_ids(req_id)
            for pos in range(starts[req_id], min(starts[req_id] + n, req.num_tokens)):
                for g, layer in enumerate(self.layers):
                    b = tables[g][pos // BS]
                    layer[b, :, pos % BS, :] = vh.token_kv_value(req.all_token_ids, pos, g)

    def mismatches(self, scheduler: Any, req_id: str) -> list[tuple[int, int]]:
        """(group, position) of computed tokens whose KV is wrong: every position in a live
        block, and the window before the next token must be live in the sliding group."""
        req = scheduler.requests[req_id]
        n = min(req.num_computed_tokens, req.num_tokens)
        tables = scheduler.kv_cache_manager.get_block_ids(req_id)
        bad = []
        for g, layer in enumerate(self.layers):
            for pos in range(n):
                b = tables[g][pos // BS]
                if b == 0:
                    if g == 0 or pos >= n - WINDOW:
                        bad.append((g, pos))
                    continue
                if not torch.all(layer[b, :, pos % BS, :] == vh.token_kv_value(
                        req.all_token_ids, pos, g)):
                    bad.append((g, pos))
        return bad


def make_hybrid_rig(model_dir: str, extra: dict, *, num_blocks: int = 64,
                    kv_events: bool = False, world_size: int = 1) -> Rig:
    """One worker per rank (``world_size``), each with its own KV caches and fake forward."""
    vc = vh.make_vllm_config(model_dir, connector="KVTierConnector", module_path=MODULE,
                             extra_config=extra, block_size=BS,
                             disable_hybrid_kv_cache_manager=False, kv_events=kv_events,
                             world_size=world_size)
    kcc = make_hybrid_kv_cache_config(vc, num_blocks)
    sched = vh.make_scheduler(vc, kcc)
    caches, workers, forwards = vh.rank_workers(vc, kcc, world_size, HybridForward)
    rig = Rig(vc, kcc, sched, caches, workers, forwards)

    def check(i, w, so):
        for rid in so.num_scheduled_tokens:
            rig.checks.append((rid, i, forwards[i].mismatches(sched, rid)))

    rig.loop = vh.EngineLoop(sched, workers, forwards, after_forward=check)
    return rig
