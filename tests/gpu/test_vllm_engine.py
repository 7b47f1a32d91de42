"""kvtier inside a real vLLM engine on the GPU (skipped without CUDA or without vLLM).

Runs ``benchmarks/vllm_e2e_child.py --connector check`` in its own process (an engine per
process): a Llama-3.2-1B-shaped random-weight model, bf16, block size 16, CUDA graphs on.
After kvtier loads a prompt's blocks, their GPU pages must hash exactly like the pages vLLM
computed for them, and greedy tokens/logprobs must equal those of vLLM's own prefix-cache hit.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_kvtier_hits_in_real_vllm_hold_vllms_bytes_and_outputs(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "benchmarks"),
                                         env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "vllm_e2e_child.py"),
           "--shape", "1b", "--connector", "check", "--lengths", "1024,4096",
           "--cpu-bytes", str(4 << 30), "--gpu-kv-bytes", str(4 << 30),
           "--workdir", str(tmp_path), "--disk-dir", str(tmp_path / "disk")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"no result (exit {p.returncode}):\n{p.stderr[-4000:]}"
    res = json.loads(lines[-1][7:])
    for page in res["pages"]:
        assert page["loaded_blocks"] >= page["tokens"] // 16 - 1, page
        assert page["identical"] == page["loaded_blocks"], page
        assert page["control_clashes"] == 0, page
    for out in res["outputs"]:
        assert out["kvtier_hit_cached"] == out["gpu_hit_cached"] > 0, out
        assert out["tokens_equal_gpu_hit"], out
        assert out["max_logprob_diff_gpu_hit"] == 0.0, out
