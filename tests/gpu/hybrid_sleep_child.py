"""A hybrid model and a sleep/wake cycle in a real vLLM engine on the GPU, one process.

Gemma-3-style model (tests/connectors/vllm/hybrid_model.py, 4 layers: sliding/full alternating, seeded
weights), bf16, block size 16, hybrid allocator on (kvtier is SupportsHMA), sleep mode on.
Prompts are generated once (kvtier stores every group's blocks), again (vLLM's own GPU
prefix-cache hit: the reference), then after a prefix-cache reset (kvtier hit), then after
``sleep(level=1)`` / ``wake_up()`` (the GPU KV cache is discarded; kvtier's CPU and disk
tiers are not). Prints ``RESULT {json}``; tests/gpu/test_vllm_hybrid_sleep.py judges it.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "connectors", "vllm"))

BLOCK = 16


def generate(llm, prompts):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, detokenize=False,
                        ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
             "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                          o.outputs[0].token_ids)]}
            for o in outs]


def compare(ref, got):
    return {"cached": [g["cached"] for g in got], "ref_cached": [r["cached"] for r in ref],
            "tokens_equal": all(r["tokens"] == g["tokens"] for r, g in zip(ref, got)),
            "max_logprob_diff": max(abs(a - b) for r, g in zip(ref, got)
                                    for a, b in zip(r["logprobs"], g["logprobs"]))}


def drain(llm, connector, steps=10_000):
    for _ in range(steps):
        if not connector.has_pending_push_work():
            return
        llm.llm_engine.step()


def kvtier_transfer(workdir: str, block: int):
    """kvtier with a 256 MiB CPU tier and a 1 GiB disk tier under ``workdir``."""
    from vllm.config import KVTransferConfig

    tiers = {"cpu": {"capacity": 256 << 20},
             "disk": {"path": os.path.join(workdir, "disk"), "capacity": 1 << 30,
                      "fsync": False}}
    return KVTransferConfig(
        kv_connector="KVTierConnector", kv_connector_module_path="kvtier.connectors.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"kvtier": {"block_tokens": block, "tiers": tiers}})


def main(workdir: str) -> None:
    import hybrid_model as hm
    import torch
    from vllm import LLM

    model = hm.write_gemma3(os.path.join(workdir, "model"), seed=0, layers=4)
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", block_size=BLOCK,
              max_model_len=1024, kv_transfer_config=kvtier_transfer(workdir, BLOCK),
              enable_sleep_mode=True,
              gpu_memory_utilization=0.3, seed=0, max_num_seqs=8)
    core = llm.llm_engine.engine_core.engine_core
    connector = core.scheduler.connector
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (300, 520, 1000)]
    generate(llm, prompts)
    drain(llm, connector)
    gpu_hit = generate(llm, prompts)
    llm.reset_prefix_cache()
    kv_hit = generate(llm, prompts)
    drain(llm, connector)
    llm.sleep(level=1)
    llm.wake_up()
    after_wake = generate(llm, prompts)
    drain(llm, connector)
    res = {
        "vllm": __import__("vllm").__version__,
        "groups": [type(x.kv_cache_spec).__name__
                   for x in core.scheduler.kv_cache_config.kv_cache_groups],
        "kvtier_hit": compare(gpu_hit, kv_hit),
        "after_wake": compare(gpu_hit, after_wake),
    }
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
