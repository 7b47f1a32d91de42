"""A hybrid model (hybrid allocator on) and a sleep/wake cycle with kvtier in a real vLLM
engine on the GPU (skipped without CUDA or vLLM; vLLM 0.33 is the target: sleep mode's
unregister/restore hooks exist from 0.33 on). Runs tests/gpu/hybrid_sleep_child.py in its
own process. kvtier's hits, before and after sleep, must give the tokens and logprobs of
vLLM's own GPU prefix-cache hit."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch



def _vllm_before_033() -> bool:
    """Sleep mode's unregister/restore hooks and HMA for connectors exist from 0.33 on."""
    if importlib.util.find_spec("vllm") is None:
        return False
    from vllm import __version__

    return tuple(int(x) for x in __version__.split(".")[:2] if x.isdigit()) < (0, 33)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
    pytest.mark.skipif(not torch.cuda.is_available() or _vllm_before_033(),
                       reason="targets vLLM 0.33 (sleep hooks); not run on 0.32"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOGPROB_TOL = 1e-3  # the same kernels run both hits; the CPU engine tests use this bound too


def test_hybrid_hits_and_sleep_wake_match_vllms_own_prefix_hit(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu",
                                                     "hybrid_sleep_child.py"), str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=900)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"no result (exit {p.returncode}):\n{p.stderr[-4000:]}"
    res = json.loads(lines[-1][7:])
    assert sorted(res["groups"]) == ["FullAttentionSpec", "SlidingWindowSpec"], res
    for phase in ("kvtier_hit", "after_wake"):
        r = res[phase]
        assert all(c > 0 for c in r["cached"]), (phase, r)
        assert r["cached"] == r["ref_cached"], (phase, r)
        assert r["tokens_equal"], (phase, r)
        assert r["max_logprob_diff"] <= LOGPROB_TOL, (phase, r)
