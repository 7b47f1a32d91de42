"""The benchmarks' timing of the scheduler thread's calls into kvtier (``lookup`` and
``prepare_load``): every call counted, results passed through, instances merged;
``kvtier bench`` itself runs the calls untimed."""

from __future__ import annotations

from step_timer import SchedulerCallTimer

from kvtier.bench.replay import Replay
from kvtier.bench.trace import load_trace
from kvtier.config import load_config


def test_call_passes_arguments_and_result_through_and_counts_it():
    timer = SchedulerCallTimer()
    assert timer.summary() == {"calls": 0}
    assert timer.call(lambda a, b=0: a + b, 2, b=3) == 5
    assert timer.call(sorted, [3, 1]) == [1, 3]
    s = timer.summary()
    assert s["calls"] == 2 and s["preempted_calls"] + (s["max_not_preempted_ms"] is not None) >= 1
    assert s["max_ms"] >= s["p99_ms"] >= s["p50_ms"] >= 0
    merged = SchedulerCallTimer.merged(timer, timer).summary()
    assert merged["calls"] == 4 and merged["max_ms"] == s["max_ms"]


def test_replay_times_every_lookup_and_prepare_of_the_scheduler():
    trace = load_trace(limit=40)
    cfg = load_config(data={"tiers": {"cpu": {"capacity": "4MiB"}}}, env={})
    replay = Replay(cfg, 64 << 10, gpu_blocks=max(len(r.hash_ids) for r in trace) + 1,
                    call_timer=SchedulerCallTimer())
    counts = {"lookup": 0, "prepare_load": 0}
    for name in counts:
        original = getattr(replay.manager, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(replay.manager, name, counted)
    try:
        replay.run(trace)
        calls = replay.report()["scheduler_calls"]
    finally:
        replay.close()
    assert counts["prepare_load"] > 0  # the trace reuses prefixes: loads were prepared
    assert calls["calls"] == counts["lookup"] + counts["prepare_load"]


def test_replay_without_a_timer_reports_no_call_times():
    trace = load_trace(limit=5)
    cfg = load_config(data={"tiers": {"cpu": {"capacity": "4MiB"}}}, env={})
    replay = Replay(cfg, 64 << 10, gpu_blocks=max(len(r.hash_ids) for r in trace) + 1)
    try:
        replay.run(trace)
        report = replay.report()
    finally:
        replay.close()
    assert report["requests"] == 5 and "scheduler_calls" not in report
