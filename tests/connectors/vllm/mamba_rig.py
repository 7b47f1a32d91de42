"""A rig with a Mamba/SSM state group: vLLM's real Scheduler with two KV cache groups (group 0
a MambaSpec in prefix-caching "align" mode, layer 0; group 1 full attention, layer 1), as the
engine orders a hybrid model's groups, both overlaying one page pool (the state page padded
to the attention page, as vLLM pads it). The fake forward plays the model: each step reads the
request's initial state from the slot vLLM's align mode puts it in (the slot of the block
ending at the step's first token) and checks it is the state of exactly the tokens before;
it then writes the state after the step's last token into the slot of the block holding it,
and every attention token's KV through group 1's table. A state loaded from the wrong prefix,
or missing, shows up as a bad check."""

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
    MambaSpec,
)

STATE_FLOATS = 16  # the fake state: this many float32 at the start of the slot's page
MAMBA_LAYER = "model.layers.0.mixer"
ATTN_LAYER = "model.layers.1.self_attn.attn"


def mamba_spec(page: int, *, mode: str = "align", speculative: int = 0) -> MambaSpec:
    return MambaSpec(block_size=BS, shapes=((4, 8), (2, 16, 8)),
                     dtypes=(torch.float32, torch.float32), page_size_padded=page,
                     mamba_cache_mode=mode, num_speculative_blocks=speculative)


def make_mamba_kv_cache_config(vc: Any, num_blocks: int, **spec_args: Any) -> KVCacheConfig:
    shape = vh.ModelShape()
    full = FullAttentionSpec(block_size=BS, num_kv_heads=shape.num_kv_heads,
                             head_size=shape.head_dim, dtype=shape.dtype)
    page = full.page_size_bytes
    size = page * num_blocks  # both layers overlay one pool: a block id has one owner group
    tensors = [KVCacheTensor(size=size, layers=[n], layer_stride=size, block_stride=page)
               for n in (MAMBA_LAYER, ATTN_LAYER)]
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                        kv_cache_groups=[KVCacheGroupSpec([MAMBA_LAYER],
                                                          mamba_spec(page, **spec_args)),
                                         KVCacheGroupSpec([ATTN_LAYER], full)])
    vc.cache_config.num_gpu_blocks = num_blocks
    vc.cache_config.mamba_cache_mode = "align"
    vc.cache_config.mamba_block_size = BS
    return cfg


def state_value(token_ids: Any, n: int) -> float:
    """The fake recurrent state after the first ``n`` tokens (a function of all of them)."""
    return vh.token_kv_value(token_ids, n - 1, 100)


class MambaForward:
    """Writes each step's state and attention KV; records wrong initial states as it goes."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], page: int) -> None:
        raw = kv_caches[MAMBA_LAYER]
        pool = torch.empty(0, dtype=torch.uint8).set_(
            raw.untyped_storage(), raw.storage_offset(), (raw.shape[0], page), (page, 1))
        self.states = pool.view(torch.float32)[:, :STATE_FLOATS]
        self.attn = kv_caches[ATTN_LAYER].view(torch.float32)
        self.bad: list[tuple[str, int, str]] = []  # (request, position, what was wrong)

    def write(self, scheduler: Any, so: Any, tokens: Any = None) -> None:
        starts = vh.scheduled_starts(so)
        for req_id, n in so.num_scheduled_tokens.items():
            req = scheduler.requests[req_id]
            ids = req.all_token_ids
            states, attn = scheduler.kv_cache_manager.get_block_ids(req_id)
            start, end = starts[req_id], min(starts[req_id] + n, len(ids))
            if start > 0:  # the model starts from the state after exactly `start` tokens
                slot = states[(start - 1) // BS]
                if slot == 0:
                    self.bad.append((req_id, start, "initial state slot is null"))
                elif not torch.all(self.states[slot] == state_value(ids, start)):
                    self.bad.append((req_id, start, "wrong initial state"))
            for pos in range(start, end):
                self.attn[attn[pos // BS], :, pos % BS, :] = vh.token_kv_value(ids, pos, 1)
            slot = states[-(-end // BS) - 1]
            assert slot != 0, (req_id, end, states)
            self.states[slot] = state_value(ids, end)

    def attention_mismatches(self, scheduler: Any, req_id: str) -> list[int]:
        req = scheduler.requests[req_id]
        attn = scheduler.kv_cache_manager.get_block_ids(req_id)[1]
        return [pos for pos in range(min(req.num_computed_tokens, req.num_tokens))
                if not torch.all(self.attn[attn[pos // BS], :, pos % BS, :]
                                 == vh.token_kv_value(req.all_token_ids, pos, 1))]


def make_mamba_rig(model_dir: str, extra: dict, *, num_blocks: int = 64,
                   max_num_batched_tokens: int = 512) -> Rig:
    vc = vh.make_vllm_config(model_dir, connector="KVTierConnector", module_path=MODULE,
                             extra_config=extra, block_size=BS,
                             disable_hybrid_kv_cache_manager=False,
                             max_num_batched_tokens=max_num_batched_tokens)
    kcc = make_mamba_kv_cache_config(vc, num_blocks)
    sched = vh.make_scheduler(vc, kcc)
    caches = vh.make_kv_caches(kcc)
    worker = vh.make_worker_connector(vc, kcc, caches)
    forward = MambaForward(caches, kcc.kv_cache_groups[1].kv_cache_spec.page_size_bytes)
    rig = Rig(vc, kcc, sched, [caches], [worker], [forward])

    def check(i, w, so):
        for rid in so.num_scheduled_tokens:
            rig.checks.append((rid, i, forward.attention_mismatches(sched, rid)))

    rig.loop = vh.EngineLoop(sched, [worker], [forward], after_forward=check)
    return rig
