"""KVTierConnector under vLLM's real Scheduler, worker half on CPU tensors (no model).

Each test drives full engine steps (see vllm_harness) and checks, every step, that every
scheduled request's computed tokens hold exactly the KV the fake model wrote for them — so a
load of the wrong block, into the wrong block, or a store that read a reused block fails.
"""

from __future__ import annotations

import vllm_harness as vh
from rig import BS, bad_checks, kvtier_config, make_rig, settle

from kvtier.connectors.metadata import KVTierConnectorMetadata


def test_store_then_reload_after_prefix_cache_reset(model_dir):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=1)
    a = make(prompt, max_tokens=3)
    rig.loop.add(a)
    records = rig.loop.run_until_idle()
    metas = [r.scheduler_output.kv_connector_metadata for r in records]
    assert all(isinstance(m, KVTierConnectorMetadata) for m in metas)
    stored = [j for m in metas for j in m.stores]
    assert sum(len(j.keys) for j in stored) == 4  # 70 prompt + 2 decoded tokens: 4 full blocks
    assert rig.side.manager.lookup([bytes(h) for h in a.block_hashes[:4]]).num_hits == 4
    assert rig.sched.reset_prefix_cache()

    b = make(prompt, max_tokens=3)
    c = make(vh.random_tokens(70, seed=2), max_tokens=3)  # control: nothing cached
    rig.loop.add(b, c)
    rig.loop.run_until_idle()
    assert rig.loop.prefill[b.request_id] == (0, 64)
    assert rig.loop.prefill[c.request_id] == (0, 0)
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert any(rid == b.request_id for rid, _, _ in rig.checks)
    assert bad_checks(rig) == []
    vh.assert_no_leaks(rig.sched)
    assert rig.side.manager.pins() == 0 and not rig.connector.has_pending_push_work()
    rig.close()
