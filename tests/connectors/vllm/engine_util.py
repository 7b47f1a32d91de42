"""Helpers for the engine tests: a tiny seeded model on disk, greedy runs, engine handles.

The model's weights are seeded random values with a real spread (saved as safetensors by the
test), so outputs depend on the context: KV loaded from the wrong place changes tokens or
logprobs. ``load_format="dummy"`` weights would hardly react to the context.
"""

from __future__ import annotations

import gc
import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

BLOCK = 32  # the CPU attention backend needs a multiple of 32
BLOCK_BYTES = 2 * BLOCK * 2 * 64 * 4  # layers * tokens * kv heads * (K+V dims) * float32
LOGPROB_TOL = 1e-3


def write_model(path: str, arch: str = "llama", seed: int = 0) -> str:
    """A 2-layer model (hidden 128, 4 heads, 2 KV heads, head_dim 32, vocab 1000)."""
    os.makedirs(path, exist_ok=True)
    hidden, layers, heads, kv_heads, head_dim, vocab, inter = 128, 2, 4, 2, 32, 1000, 256
    cfg: dict[str, Any] = {
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
        "intermediate_size": inter, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    }
    if arch == "llama":
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    elif arch == "mistral-sw":
        cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    else:
        raise ValueError(arch)
    g = torch.Generator().manual_seed(seed)

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f**0.5

    w = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
         "model.norm.weight": torch.ones(hidden), "lm_head.weight": lin(vocab, hidden) * 4.0}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = lin(heads * head_dim, hidden) * 3.0  # sharp attention
        w[p + "self_attn.k_proj.weight"] = lin(kv_heads * head_dim, hidden) * 3.0
        w[p + "self_attn.v_proj.weight"] = lin(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = lin(hidden, heads * head_dim)
        w[p + "mlp.gate_proj.weight"] = lin(inter, hidden)
        w[p + "mlp.up_proj.weight"] = lin(inter, hidden)
        w[p + "mlp.down_proj.weight"] = lin(hidden, inter)
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return path


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (length,), generator=g).tolist() for _ in range(n)]


def kvtier_transfer_config(cpu_blocks: int, disk_dir: str | None = None, disk_blocks: int = 256,
                           **connector_keys: Any):
    """``connector_keys``: more ``kv_connector_extra_config`` keys (``store_every_steps``...)."""
    from vllm.config import KVTransferConfig

    tiers: dict[str, Any] = {"cpu": {"capacity": cpu_blocks * BLOCK_BYTES}}
    if disk_dir is not None:
        tiers["disk"] = {"path": disk_dir, "capacity": disk_blocks * BLOCK_BYTES, "fsync": False}
    return KVTransferConfig(
        kv_connector="KVTierConnector", kv_connector_module_path="kvtier.connectors.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"kvtier": {"block_tokens": BLOCK, "tiers": tiers},
                                   **connector_keys},
    )


def make_llm(model_dir: str, kv_transfer_config=None, **kwargs):
    from vllm import LLM

    return LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
               block_size=BLOCK, max_model_len=512, kv_transfer_config=kv_transfer_config,
               seed=0, max_num_seqs=8, **kwargs)


def generate(llm, token_prompts: list[list[int]], max_tokens: int = 8) -> list[dict]:
    """Greedy tokens, each token's logprob, and how many prompt tokens were cached."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False,
                        ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in token_prompts], sp,
                        use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
        res.append({"tokens": list(c.token_ids), "logprobs": lps, "cached": o.num_cached_tokens})
    return res


def mismatch(a: list[dict], b: list[dict], tol: float = LOGPROB_TOL) -> str | None:
    """Why two runs differ (tokens, or a logprob beyond ``tol``), or None if they agree."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x["tokens"] != y["tokens"]:
            return f"prompt {i}: tokens {x['tokens']} != {y['tokens']}"
        diff = max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"]))
        if diff > tol:
            return f"prompt {i}: logprob differs by {diff:.3g}"
    return None if len(a) == len(b) else "different number of outputs"


def scheduler_connector(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def record_loads(conn, sources: list | None = None) -> list:
    """Wrap the scheduler side's load planning; the returned list fills with each planned load
    job (one CPU -> GPU copy: its blocks, their CPU slots). ``sources``, when given, fills
    with the tokens of each planned load per tier they came from (``{"CPU": n, "DISK": n,
    "REMOTE": n}``, nonzero ones: a block promoted from disk or the shared tier for the load
    counts as that tier's), one dict per request whose load was planned, in order."""
    side = conn._sched
    loads: list = []
    original = side.plan_load

    def plan_load(request, blocks, n):
        before = len(side._step_loads)
        original(request, blocks, n)
        planned = side._step_loads[before:]
        loads.extend(planned)
        if sources is not None and planned:
            sources.append({k: v for k, v in side.hit_sources(request).items() if v})

    side.plan_load = plan_load
    return loads


def stored_then_hit(llm, token_prompts: list[list[int]], out: dict) -> list:
    """Into ``out``: the engine's KV cache group kinds, the prompts' first run (kvtier
    stores them), their run again after vLLM's prefix cache was reset (a kvtier hit) and the
    group of every block each load moved. Returns the live list of planned loads."""
    from kvtier.connectors.vllm.group_keys import split_group_key

    conn = scheduler_connector(llm)
    out["groups"] = [type(g.kv_cache_spec).__name__
                     for g in conn._kv_cache_config.kv_cache_groups]
    loads = record_loads(conn)
    out["first"] = generate(llm, token_prompts)
    drain(llm)
    llm.reset_prefix_cache()
    out["hit"] = generate(llm, token_prompts)
    out["loaded"] = [[split_group_key(k)[1] for k in j.keys] for j in loads]
    drain(llm)
    return loads


def drain(llm, max_steps: int = 10_000) -> None:
    """Step the engine until kvtier has nothing in flight (``LLM.generate`` returns as soon as
    its requests finish; demotions and stores still running settle on later steps)."""
    conn = scheduler_connector(llm)
    for _ in range(max_steps):
        if not conn.has_pending_push_work():
            return
        llm.llm_engine.step()
    raise AssertionError("kvtier work still pending")


def shutdown(llm) -> None:
    """Shut the in-process engine down (closes kvtier's stores) and free it for the next one."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
