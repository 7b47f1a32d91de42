"""Correctness of kvtier inside a real vLLM engine on the GPU (``vllm_e2e_child --connector check``).

In-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the scheduler's plans and the
worker's KV pages are both reachable from here:

1. Page bytes: a prompt is computed by vLLM; the pages of its blocks (the store jobs' engine
   blocks) are copied when the store is planned (the step after, the blocks still held). The GPU prefix cache is reset, the prompt runs
   again and kvtier loads those blocks into other pages: each loaded block's pages must equal
   the pages vLLM computed (but the prompt's last token, which the hit's step recomputes). A
   different prompt's blocks must not hash the same (control).
2. Outputs: greedy tokens and logprobs of a kvtier hit against vLLM's own GPU prefix-cache
   hit of the same prompt (a prompt one token past whole blocks: both compute that one token
   over the same cached prefix, one prompt at a time), and, for information, against a full recompute.
"""

from __future__ import annotations

import hashlib
import os


def _worker_view():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker.view


def _prefetches() -> dict:
    """The worker's prefetch outcomes so far (a hit's first pieces copied at the lookup)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker.runtime.engine.prefetch_counts()


def _hash_blocks(view, gpu_ids_per_key: dict) -> dict:
    out = {}
    for key, ids in gpu_ids_per_key.items():
        h = hashlib.sha256()
        for layer in view.layers:
            for b in ids:
                h.update(layer.pages[:, b].contiguous().cpu().numpy().tobytes())
        out[key] = h.hexdigest()
    return out


def _copy_pages(view, gpu_ids_per_key: dict) -> dict:
    return {key: [layer.pages[:, b].clone() for layer in view.layers for b in ids]
            for key, ids in gpu_ids_per_key.items()}


def _same_pages(view, gpu_ids_per_key: dict, computed: dict, tail_key,
                block_size: int) -> tuple[int, int]:
    """(keys whose pages equal vLLM's computed pages, bytes that differ in the tail block).

    The block holding the prompt's last token is loaded whole when the hit reaches that token
    (scheduler_side._claim); the forward then rewrites that one token's KV, maybe with other
    bits (a one-token forward): outside that token's slots its bytes must be identical, so at
    most 1/block_size of each of its pages may differ."""
    same, tail_diff = 0, 0
    for key, ids in gpu_ids_per_key.items():
        mine = [layer.pages[:, b] for layer in view.layers for b in ids]
        theirs = computed.get(key)
        if theirs is None:
            continue
        if key != tail_key:
            same += all(torch_equal(x, y) for x, y in zip(mine, theirs))
            continue
        ok = True
        for i, (x, y) in enumerate(zip(mine, theirs)):
            if i % len(ids) != len(ids) - 1:
                ok &= torch_equal(x, y)
                continue
            diff = int((x != y).sum())
            tail_diff += diff
            ok &= diff <= x.numel() // block_size
        same += ok
    return same, tail_diff


def torch_equal(x, y) -> bool:
    import torch

    return bool(torch.equal(x, y))


def _hash_pages(pages: dict) -> dict:
    """``_hash_blocks`` of pages copied earlier (same order: layer, then block)."""
    out = {}
    for key, tensors in pages.items():
        h = hashlib.sha256()
        for t in tensors:
            h.update(t.contiguous().cpu().numpy().tobytes())
        out[key] = h.hexdigest()
    return out


def _record_meta(side, sink: list, view, pages: dict) -> None:
    """Keep every step's metadata; copy the pages of each store planned after its blocks'
    forward (the scheduler plans stores one step late) when it is planned: the request still
    holds them then, whether or not it has finished."""
    original = side.build_meta

    def build_meta(so):
        meta = original(so)
        sink.append(meta)
        pages.update(_copy_pages(view, _per_key(j for j in meta.stores if not j.this_step)))
        return meta

    side.build_meta = build_meta


def _computed_pages(llm, a, view, metas: list, pages: dict, prompt) -> dict:
    """Run ``prompt`` and settle; the pages of its stored blocks as vLLM computed them."""
    from vllm_e2e_engine import gen, settle

    metas.clear()
    pages.clear()
    gen(llm, prompt)
    # stores planned in the computing step itself (sliding-window models): copy them now
    pages.update(_copy_pages(view, _per_key(j for m in metas for j in m.stores if j.this_step)))
    settle(llm, a)
    return dict(pages)


def _per_key(jobs) -> dict:
    out = {}
    for job in jobs:
        k = len(job.gpu_ids) // max(1, len(job.keys))
        for i, key in enumerate(job.keys):
            out[key] = tuple(job.gpu_ids[i * k:(i + 1) * k])
    return out


def _outputs(res) -> dict:
    c = res.outputs[0]
    return {"tokens": list(c.token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
            "cached": int(res.num_cached_tokens or 0)}


def _max_diff(x: dict, y: dict) -> float:
    return max((abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"])), default=0.0)


def run_check(a, model_dir: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_e2e_engine import gen, make_llm, reset, settle, tokens

    a.connector = "kvtier"
    llm = make_llm(a, model_dir)
    a.connector = "check"
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector._sched
    metas: list = []
    view = _worker_view()
    pages: dict = {}
    _record_meta(side, metas, view, pages)
    result: dict = {"shape": a.shape, "connector": "check", "pages": [], "outputs": []}
    for length in a.lengths:
        prompt = tokens(length, 424242 + length, a.vocab)
        computed = _computed_pages(llm, a, view, metas, pages, prompt)
        reset(llm)
        metas.clear()
        before = _prefetches()
        out = gen(llm, prompt)
        prefetched = _prefetches()["used"] - before["used"]  # the copy started at the lookup
        loads = [j for m in metas for j in m.loads]
        loaded_ids = _per_key(loads)
        loaded = _hash_blocks(view, loaded_ids)
        # a hit reaching the last token (length in whole blocks) ends with that token's block
        tail_key = loads[-1].keys[-1] if loads and out.num_cached_tokens == length - 1 else None
        same, tail_diff = _same_pages(view, loaded_ids, computed, tail_key, a.block_size)
        del computed
        other = tokens(length, 525252 + length, a.vocab)
        # control: a different prompt's blocks hash differently
        control = _hash_pages(_computed_pages(llm, a, view, metas, pages, other))
        clash = len(set(control.values()) & set(loaded.values()))
        result["pages"].append({"tokens": length, "loaded_blocks": len(loaded),
                                "identical": same, "control_clashes": clash,
                                "control_blocks": len(control), "prefetched": prefetched,
                                "last_block_loaded_whole": tail_key is not None,
                                "last_token_bytes_rewritten": tail_diff})
        settle(llm, a)

        # one token past whole blocks: vLLM's own hit and kvtier's both compute that token
        q = tokens(length + 1, 626262 + length, a.vocab)
        recompute = _outputs(gen(llm, q, 8, logprobs=True))
        gpu_hit = _outputs(gen(llm, q, 8, logprobs=True))  # vLLM's own prefix cache
        settle(llm, a)
        reset(llm)
        kv_hit = _outputs(gen(llm, q, 8, logprobs=True))
        result["outputs"].append({
            "tokens": length, "gpu_hit_cached": gpu_hit["cached"],
            "kvtier_hit_cached": kv_hit["cached"],
            "tokens_equal_gpu_hit": kv_hit["tokens"] == gpu_hit["tokens"],
            "max_logprob_diff_gpu_hit": _max_diff(kv_hit, gpu_hit),
            "tokens_equal_recompute": kv_hit["tokens"] == recompute["tokens"],
            "max_logprob_diff_recompute": _max_diff(kv_hit, recompute)})
        settle(llm, a)
    return result
