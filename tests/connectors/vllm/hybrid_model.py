"""A tiny Gemma-3-style hybrid model for engine tests: sliding-window and full-attention layers
alternate (``layer_types``), so vLLM's hybrid allocator gives it one full-attention and one
sliding-window KV cache group. Weights are seeded random values with a real spread (the
attention is sharp), saved as safetensors: KV from the wrong place changes the outputs.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

WINDOW = 64  # tokens: two engine blocks of 32


def write_gemma3(path: str, seed: int = 0, layers: int = 2) -> str:
    """``layers`` alternating sliding/full layers (hidden 128, 4 heads, 2 KV heads,
    head_dim 32, vocab 1000), window ``WINDOW``."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    os.makedirs(path, exist_ok=True)
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    cfg = Gemma3TextConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        sliding_window=WINDOW, layer_types=types, query_pre_attn_scalar=32,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in Gemma3ForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in names.items():
        if "norm" in name:
            weights[name] = torch.zeros(shape)  # Gemma's RMSNorm scales by (1 + weight)
        elif name.endswith("embed_tokens.weight"):  # Gemma scales it by sqrt(hidden)
            weights[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
        elif name == "lm_head.weight":
            weights[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5 * 4.0
        else:
            w = torch.randn(shape, generator=g) / shape[1] ** 0.5
            if "q_proj" in name or "k_proj" in name:
                w *= 3.0  # sharp attention: the context matters
            weights[name] = w
    return save_model(path, cfg, weights)


def save_model(path: str, cfg, weights: dict[str, torch.Tensor]) -> str:
    """A model folder vLLM loads: ``weights`` as safetensors, the transformers config ``cfg``
    and a generation config; returns ``path``."""
    save_file({k: v.contiguous() for k, v in weights.items()},
              os.path.join(path, "model.safetensors"))
    cfg.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return path
