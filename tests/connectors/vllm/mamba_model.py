"""A tiny Granite-4-style hybrid model for engine tests: a Mamba2 layer then an attention layer
(``layer_types``), so vLLM's hybrid allocator gives it a Mamba state group and a full-attention
group. Weights are seeded random values with a real spread (sharp attention, a decaying but
long state), saved as safetensors: a wrong state or wrong KV changes the outputs. Used by the
CPU engine test (vLLM 0.32's CPU backend) and the GPU one (tests/gpu)."""

from __future__ import annotations

import os

import torch
from hybrid_model import save_model


def write_granite_hybrid(path: str, seed: int = 0) -> str:
    """2 layers (mamba, attention), hidden 128, 4 heads, 2 KV heads, head_dim 32, Mamba2 with
    4 heads of 32, state 16, conv 4; vocab 1000."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    os.makedirs(path, exist_ok=True)
    cfg = GraniteMoeHybridConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, shared_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, layer_types=["mamba", "attention"],
        mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4,
        mamba_expand=1, mamba_chunk_size=32, num_local_experts=0, num_experts_per_tok=0,
        position_embedding_type="rope", bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    cfg.architectures = ["GraniteMoeHybridForCausalLM"]
    with torch.device("meta"):
        shapes = {k: tuple(v.shape)
                  for k, v in GraniteMoeHybridForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("A_log"):  # decay rates 1..16: some heads remember far back
            weights[name] = torch.log(torch.linspace(1.0, 16.0, shape[0]))
        elif name.endswith("mamba.D") or "norm" in name:
            weights[name] = torch.ones(shape)
        elif name.endswith("dt_bias"):
            weights[name] = torch.randn(shape, generator=g) * 0.5 - 2.0
        elif name.endswith("conv1d.bias"):
            weights[name] = torch.zeros(shape)
        elif name.endswith("conv1d.weight"):
            weights[name] = torch.randn(shape, generator=g) / 2.0
        elif name == "model.embed_tokens.weight":
            weights[name] = torch.randn(shape, generator=g)
        else:
            w = torch.randn(shape, generator=g) / shape[1] ** 0.5
            if "q_proj" in name or "k_proj" in name:
                w *= 3.0  # sharp attention: the context matters
            elif name == "lm_head.weight":
                w *= 4.0
            weights[name] = w
    return save_model(path, cfg, weights)
