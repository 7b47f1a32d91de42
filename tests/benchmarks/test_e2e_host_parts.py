"""The host-side instruments of the real-vLLM harness, without a GPU: the engine thread's
per-request counters (``host_probe.engine_counters``), the quiet-core pin, and the two
tabulators that turn a run's marks and py-spy profiles into comparisons."""

from __future__ import annotations

import gc
import json
import os
import sys

import pytest


import host_probe
import pyspy_summary
import request_counters
import request_phases

LINUX = sys.platform.startswith("linux") and os.path.exists("/proc/thread-self/stat")


@pytest.mark.skipif(not LINUX, reason="reads /proc/thread-self")
def test_engine_counters_see_this_threads_page_faults_and_the_collectors_passes():
    before = host_probe.engine_counters()
    assert {"minflt", "majflt", "vcsw", "ivcsw", "gc_ms", "gc_passes"} <= before.keys()
    buf = bytearray(32 << 20)  # fresh pages: faulted in by this thread
    buf[::4096] = b"x" * len(buf[::4096])
    gc.collect()
    gc.collect()
    delta = host_probe.engine_delta(before)
    assert delta["minflt"] >= 1000  # 32 MiB is 8192 pages of 4 KiB (fewer if huge pages)
    assert delta["gc_passes"] >= 2 and delta["gc_ms"] >= 0.0


def test_gc_marks_import_nothing_and_may_come_while_this_thread_is_inside_a_mark(
        tmp_path, monkeypatch):
    """The collector's callback can run anywhere: inside importlib while it holds a module
    lock half taken (an import from the callback then broke CPython's lock bookkeeping: a CI
    child died with ``KeyError`` in ``_ModuleLock.acquire``), or inside the timeline's own
    ``mark`` (a plain lock would wait for itself forever). The callback is called here as the
    collector calls it, around a pass of 200 ms (a full pass's census included)."""
    import builtins
    import threading

    from kvtier.observe import timeline as tl_module

    tl = tl_module.Timeline(str(tmp_path / "tl.jsonl"))
    monkeypatch.setattr(tl_module, "_timeline", tl)
    timer = host_probe._GcTimer()
    timer.mark_min_ms = 1.0
    timer.install()
    gc.callbacks.remove(timer)  # called by hand below, not by real passes

    def long_pass() -> None:
        timer("start", {"generation": 2})
        timer.started -= 0.2
        timer("stop", {"generation": 2, "collected": 0})

    real_import = builtins.__import__

    def no_import(*args, **kwargs):
        raise AssertionError("the GC callback imported something")

    builtins.__import__ = no_import
    try:
        long_pass()
    finally:
        builtins.__import__ = real_import
    done = threading.Event()

    def pass_inside_a_mark() -> None:
        with tl._lock:  # as if the pass started inside mark()
            long_pass()
        done.set()

    worker = threading.Thread(target=pass_inside_a_mark, daemon=True)
    worker.start()
    worker.join(10)
    assert done.is_set(), "a GC mark waited for the timeline lock its own thread holds"
    tl.flush()
    marks = [json.loads(line) for line in open(tmp_path / "tl.jsonl") if line.strip()]
    gcs = [m for m in marks if m["ev"] == "gc"]
    assert len(gcs) == 2 and all(m["ms"] >= 200 for m in gcs)
    assert gcs[0]["tracked"] > 0 and gcs[0]["top"]  # the census ran, without an import


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_quiet_core_pins_this_thread_to_one_allowed_cpu_and_reports_its_probe():
    allowed = sorted(os.sched_getaffinity(0))
    try:
        cpu, ms = host_probe.quiet_core(allowed)
        assert cpu in allowed and os.sched_getaffinity(0) == {cpu}
        assert 0 < ms < 1000
    finally:
        os.sched_setaffinity(0, allowed)


def _mark(**kw):
    return json.dumps({"t": 1.0, "pid": 1, "who": "client", "ev": "client_done", **kw}) + "\n"


def test_request_counters_group_by_configuration_length_and_kind(tmp_path):
    path = tmp_path / "timeline.jsonl"
    path.write_text(
        _mark(connector="none", length=16, ms=7.0, cached=0, core_probe_ms=0.4,
              thread_cpu_ms={"MainThread": [8.0, 0.1]}, engine={"minflt": 3, "gc_ms": 0.5})
        + _mark(connector="none", length=16, ms=9.0, cached=0, core_probe_ms=0.6,
                thread_cpu_ms={"MainThread": [10.0, 0.3], "kvtier-stats": [0.7, 0.0]},
                engine={"minflt": 5, "gc_ms": 0.0})
        + _mark(connector="kvtier", length=16, ms=6.0, cached=15)
        + _mark(connector="kvtier", length=16, ms=8.0, cached=0, recompute=True)
        + _mark(connector="kvtier", length=16, ms=11.0, cached=0, miss=True)
        + json.dumps({"ev": "client_submit", "length": 16}) + "\n")
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line.split("|")[4:-1]
            for line in request_counters.table([str(path)])[2:]}
    assert set(rows) == {("none", "16", "computed"), ("kvtier", "16", "hit"),
                         ("kvtier", "16", "recompute"), ("kvtier", "16", "miss")}
    n, ms, probe, cpu, _wait, others, minflt = (c.strip() for c in rows[("none", "16", "computed")][:7])
    assert (n, ms, probe, cpu, others, minflt) == ("2", "8.00", "0.50", "9.00", "0.35", "4.00")
    assert rows[("kvtier", "16", "hit")][1].strip() == "6.00"
    assert rows[("kvtier", "16", "hit")][2].strip() == "-"  # no probe on that mark


def test_request_phases_sum_each_requests_time_inside_vllms_phases(tmp_path):
    """Only marks of the request's own process and window (from its submit mark, which can
    come before its TTFT clock starts) count; a phase re-entered while open (nested marks)
    counts once; per (run, config, tokens, kind) medians."""
    def vllm(pid, t, ev):
        return json.dumps({"t": t, "pid": pid, "who": "vllm", "ev": ev}) + "\n"

    def done(pid, t, ms, **kw):
        return json.dumps({"t": t, "pid": pid, "who": "client", "ev": "client_done",
                           "length": 16, "ms": ms, **kw}) + "\n"

    lines = [
        vllm(1, 0.5, "Scheduler.schedule>"), vllm(1, 0.6, "Scheduler.schedule<"),  # before
        json.dumps({"t": 0.990, "pid": 1, "who": "client", "ev": "client_submit"}) + "\n",
        vllm(1, 0.991, "Scheduler.schedule>"), vllm(1, 0.992, "Scheduler.schedule<"),  # lookup
        vllm(1, 1.000, "Scheduler.schedule>"), vllm(1, 1.001, "Scheduler.schedule>"),
        vllm(1, 1.002, "Scheduler.schedule<"), vllm(1, 1.003, "Scheduler.schedule<"),
        vllm(1, 1.004, "ActiveKVConnector.pre_forward>"),
        vllm(1, 1.0055, "ActiveKVConnector.pre_forward<"),
        vllm(2, 1.004, "ActiveKVConnector.pre_forward>"),  # another process
        vllm(2, 1.009, "ActiveKVConnector.pre_forward<"),
        done(1, 1.010, 10.0, connector="kvtier", miss=True, cached=0),
        vllm(1, 2.000, "Scheduler.schedule>"), vllm(1, 2.001, "Scheduler.schedule<"),
        done(1, 2.010, 10.0, connector="kvtier", recompute=True, cached=0),
    ]
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(reversed(lines)))  # order in the file does not matter
    rows = {tuple(c.strip() for c in line.split("|")[1:5]): [c.strip() for c in
                                                              line.split("|")[5:-1]]
            for line in request_phases.table([("new", str(path))])[2:]}
    assert set(rows) == {("16", "new", "kvtier", "miss"), ("16", "new", "kvtier", "recompute")}
    n, ttft, schedule, pre, post, update, total = rows[("16", "new", "kvtier", "miss")]
    assert (n, ttft, schedule, pre, post, update, total) == (
        "1", "10.00", "4.00", "1.50", "0.00", "0.00", "5.50")
    assert rows[("16", "new", "kvtier", "recompute")][2] == "1.00"


def test_pyspy_summary_counts_one_threads_leaf_and_inclusive_frames(tmp_path):
    path = tmp_path / "1b-none.txt"
    path.write_text(
        "thread (11): MainThread;main (x.py:3);step (engine.py:10);cuLaunchKernel (libcuda.so) 7\n"
        "thread (11): MainThread;main (x.py:3);step (engine.py:12) 3\n"
        "thread (11): MainThread;main (x.py:3);0x7f00 (libc.so.6) 2\n"
        "thread (12): kvtier-stats;run (snapshot.py:5) 50\n"
        "not a profile line\n")
    leaf, inclusive, total = pyspy_summary.load(str(path), "MainThread")
    assert total == 12
    assert leaf == {"cuLaunchKernel (libcuda.so)": 7, "step (engine.py)": 3, "[libc.so.6]": 2}
    assert inclusive["main (x.py)"] == 12 and inclusive["step (engine.py)"] == 10
    assert pyspy_summary.load(str(path), "kvtier-stats")[2] == 50
