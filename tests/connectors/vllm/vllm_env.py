"""Environment vLLM needs to run on a CPU-only machine; set before vLLM is imported."""

import os

ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
for _k, _v in ENV.items():
    os.environ.setdefault(_k, _v)
