"""A hybrid Mamba2 + attention model with kvtier in a real vLLM engine on the GPU, one process.

Granite-4-style model (tests/connectors/vllm/mamba_model.py: a Mamba2 layer and an attention
layer, seeded weights), bf16, block size 64 (vLLM pads the state page to the attention page),
prefix caching on (Mamba "align" mode), hybrid allocator on. Prompts are generated once (kvtier
stores the attention blocks and the states vLLM keeps, here the prefill checkpoint exported
from inside one chunk), again (vLLM's own GPU prefix-cache hit: the reference), then after a
prefix-cache reset (kvtier's hit). Prints ``RESULT {json}``; tests/gpu/test_vllm_mamba.py
judges it.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "connectors", "vllm"))

BLOCK = 64


def main(workdir: str) -> None:
    import mamba_model as mm
    import torch
    from engine_util import record_loads
    from hybrid_sleep_child import compare, drain, generate, kvtier_transfer
    from vllm import LLM

    from kvtier.connectors.vllm.group_keys import split_group_key

    model = mm.write_granite_hybrid(os.path.join(workdir, "model"), seed=0)
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", block_size=BLOCK,
              max_model_len=1024, kv_transfer_config=kvtier_transfer(workdir, BLOCK),
              enable_prefix_caching=True,
              gpu_memory_utilization=0.3, seed=0, max_num_seqs=8)
    core = llm.llm_engine.engine_core.engine_core
    connector = core.scheduler.connector
    loads = record_loads(connector)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (300, 520, 1000)]
    first = generate(llm, prompts)
    drain(llm, connector)
    gpu_hit = generate(llm, prompts)
    drain(llm, connector)
    llm.reset_prefix_cache()
    kv_hit = generate(llm, prompts)
    drain(llm, connector)
    cc = llm.llm_engine.vllm_config.cache_config
    res = {
        "vllm": __import__("vllm").__version__,
        "block_size": cc.block_size, "mamba_cache_mode": cc.mamba_cache_mode,
        "groups": [type(x.kv_cache_spec).__name__
                   for x in core.scheduler.kv_cache_config.kv_cache_groups],
        "first_vs_gpu_hit": compare(first, gpu_hit),
        "kvtier_hit": compare(gpu_hit, kv_hit),
        "loaded_groups": [sorted(split_group_key(k)[1] for k in j.keys) for j in loads],
    }
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
