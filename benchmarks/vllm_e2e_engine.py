"""A real vLLM engine as the e2e benchmarks drive it: model configs, connector settings,
the ``LLM``, requests and waiting for offloads to settle.

Shared by ``vllm_e2e_child.py`` (one configuration's run) and the parts it runs in its engine
(``vllm_e2e_check.py``, ``vllm_e2e_replay.py``, ``diagnostics/vllm_e2e_diag.py``), and by
``vllm_serve.py`` / ``vllm_remote_child.py`` (the same models and connector JSON): its own module
so that none of them imports the child that imports them.
"""

from __future__ import annotations

import json
import os
import random
import time

SHAPES = {  # Llama-3.1-8B and Llama-3.2-1B configs (weights random)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 tie_word_embeddings=False),
}
VOCAB = {"8b": 128256, "1b": 128256, "tiny": 1000}


def write_model(path: str, shape: str, max_len: int) -> str:
    os.makedirs(path, exist_ok=True)
    dtype = "float32" if shape == "tiny" else "bfloat16"
    cfg = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama",
               vocab_size=VOCAB[shape], max_position_embeddings=max(max_len, 131072),
               rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype=dtype, bos_token_id=1,
               eos_token_id=2, hidden_act="silu")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return path


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 1) for _ in range(n)]


def connector_json(connector: str, cpu_bytes: int, block_size: int, *, tiers: dict | None = None,
                   kvtier: dict | None = None, extra: dict | None = None) -> dict | None:
    """``--kv-transfer-config`` of a configuration as JSON (None: no connector): kvtier with a
    CPU tier of ``cpu_bytes`` (or ``tiers``; ``kvtier`` deep-merged into its section, ``extra``
    into kv_connector_extra_config), or vLLM's ``OffloadingConnector`` with the same bytes."""
    if connector == "none":
        return None
    if connector == "native":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}
    section: dict = {"tiers": tiers or {"cpu": {"capacity": cpu_bytes}}}
    if block_size:  # 0: kvtier's blocks follow vLLM's (a user who sets no --block-size)
        section["block_tokens"] = block_size
    merge(section, kvtier or {})
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": dict(extra or {}, kvtier=section)}


def transfer_config(a):
    from vllm.config import KVTransferConfig

    tiers = None
    if a.connector == "kvtier_disk":
        tiers = {"cpu": {"capacity": a.disk_cpu_bytes},
                 "disk": {"path": a.disk_dir, "capacity": a.disk_bytes, "fsync": not a.disk_no_fsync}}
    section = {"stats": {"snapshot_path": a.snapshot, "interval_s": 0.2}}
    if a.gil_switch_ms is not None:
        section["gil_switch_interval_ms"] = a.gil_switch_ms
    if a.kvtier_json:  # an A/B of one setting (pool pinning, stats thread, ...)
        merge(section, json.loads(a.kvtier_json))
    extra = {} if a.sync_budget is None else {"sync_load_budget_bytes": a.sync_budget}
    name = "native" if a.connector == "native" else "none" if a.connector == "none" else "kvtier"
    d = connector_json(name, a.cpu_bytes, a.block_size, tiers=tiers, kvtier=section, extra=extra)
    return None if d is None else KVTransferConfig(**d)


def merge(into: dict, extra: dict) -> None:
    """Deep-merge ``extra`` into ``into`` (mappings merged, anything else replaced)."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


def make_llm(a, model_dir: str):
    from vllm import LLM

    kw = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
              block_size=a.block_size, max_model_len=a.max_len, seed=0,
              enable_prefix_caching=True, kv_transfer_config=transfer_config(a),
              disable_log_stats=False, max_num_seqs=a.max_num_seqs)
    if a.shape == "tiny":
        kw.update(dtype="float32", enforce_eager=True)
    else:
        kw.update(dtype="bfloat16", kv_cache_memory_bytes=a.gpu_kv_bytes)
    return LLM(**kw)


BYPASS = {"kv_transfer_params": {"kvtier": {"skip_load": True, "skip_store": True}}}


def sampling(max_tokens: int = 1, logprobs: bool = False, extra_args: dict | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          detokenize=False, logprobs=0 if logprobs else None,
                          extra_args=extra_args)


def gen(llm, prompt: list[int], max_tokens: int = 1, logprobs: bool = False,
        extra_args: dict | None = None):
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                        sampling(max_tokens, logprobs, extra_args), use_tqdm=False)[0]


def settle(llm, a, quiet_s: float = 0.0) -> None:
    """Let offloads finish: ``generate`` returns before stores settle, and the engine keeps
    stepping while a connector has pending work. ``quiet_s``: also wait until kvtier's stats
    snapshot has not changed for that long (disk demotions)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is not None:  # in-process engine: nobody steps it but us
        connector = core.scheduler.connector
        for _ in range(100_000):
            if connector is None or not connector.has_pending_push_work():
                break
            llm.llm_engine.step()
            time.sleep(0.001)
    else:  # the engine-core process keeps stepping while a connector has pending work
        time.sleep(0.2)
        gen(llm, tokens(8, 998, a.vocab))
        time.sleep(0.1)
    if not quiet_s or not a.connector.startswith("kvtier"):
        return
    last, since, deadline = None, time.monotonic(), time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with open(a.snapshot) as f:
                usage = json.load(f).get("usage")
        except (OSError, ValueError):
            usage = None
        if usage != last:
            last, since = usage, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)


def reset(llm) -> None:
    for _ in range(200):
        if llm.reset_prefix_cache():
            return
        if getattr(llm.llm_engine.engine_core, "engine_core", None) is not None:
            llm.llm_engine.step()  # in-process: finish what holds the blocks
        time.sleep(0.05)
    raise RuntimeError("vLLM refused to reset its prefix cache (blocks still in use)")


def timed(llm, prompt: list[int], extra_args: dict | None = None) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = gen(llm, prompt, extra_args=extra_args)
    return (time.perf_counter() - t0) * 1e3, int(out.num_cached_tokens or 0)
