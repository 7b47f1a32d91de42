"""A hybrid Mamba2 + attention model (Mamba state group + attention group) with kvtier in a
real vLLM engine on the GPU (skipped without CUDA or vLLM; vLLM 0.33 is the target). Runs
tests/gpu/mamba_child.py in its own process. After vLLM's prefix cache is reset, kvtier's hit
(attention blocks and the state at the hit's end) must give the tokens, logprobs and cached
token counts of vLLM's own GPU prefix-cache hit. Here prefills run in one chunk, so the
states kvtier stores are vLLM's prefill checkpoints (exported from inside a chunk), the path
the CPU engine test cannot run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from test_vllm_hybrid_sleep import LOGPROB_TOL, ROOT, _vllm_before_033

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
    pytest.mark.skipif(not torch.cuda.is_available() or _vllm_before_033(),
                       reason="targets vLLM 0.33 (HMA connectors); not run on 0.32"),
]


def test_mamba_hybrid_hits_match_vllms_own_prefix_hit(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "mamba_child.py"),
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"no result (exit {p.returncode}):\n{p.stderr[-4000:]}"
    res = json.loads(lines[-1][7:])
    assert res["groups"] == ["MambaSpec", "FullAttentionSpec"], res
    assert res["mamba_cache_mode"] == "align" and res["block_size"] == 64, res
    ref = res["first_vs_gpu_hit"]
    assert all(c > 0 for c in ref["cached"]), res  # vLLM's own hit happened
    r = res["kvtier_hit"]
    assert r["cached"] == r["ref_cached"], res  # the same hit lengths as vLLM's own
    assert r["tokens_equal"], res
    assert r["max_logprob_diff"] <= LOGPROB_TOL, res
    loaded = res["loaded_groups"]  # one state (group 0), every attention block (group 1)
    assert [g.count(0) for g in loaded] == [1, 1, 1], res
    assert sorted(g.count(1) for g in loaded) == sorted(c // 64 for c in r["cached"]), res
