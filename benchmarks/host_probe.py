"""How fast this process runs plain Python and touches memory, and where its memory lives.

In real vLLM on the H100 every vLLM phase of the engine thread (add_requests, schedule,
update_from_output) took 1.5-2.5x longer in a process that had loaded kvtier, with CPU time equal
to wall time, while the same code on a CPU-only host ran at the same speed with and without
kvtier. A process-wide slowdown of that kind (memory placed on a far NUMA node, a CPU shared with
a busy thread, a tracing hook) shows in a fixed workload timed in the same process before and
after the engine starts, side by side with the no-connector process: that is this probe.
``thread_cpu`` / ``thread_cpu_delta`` say which of the process's threads ran during one
request, for how long, and whether the engine thread waited for a core (``/proc/<tid>/
schedstat``, nanoseconds); ``engine_counters`` / ``engine_delta`` add what the engine thread
itself went through during a request (page faults, context switches given up and taken away,
garbage-collector passes of every length); ``mark_gc_pauses`` puts the garbage collector's
long passes on the timeline, with a census of what a long full pass walked.
"""

from __future__ import annotations

import collections
import gc
import os
import threading
import time
from typing import Any


def python_ms(rounds: int = 7, size: int = 200) -> float:
    """Best of ``rounds`` of a fixed pure-Python workload (dicts, lists, calls), milliseconds."""
    def work() -> int:
        total = 0
        for i in range(size):
            d = {j: j * 2 for j in range(100)}
            total += sum(v for v in d.values() if v % 3) + len([k for k in d if k & 1])
        return total

    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


def memory_ms(mib: int = 64, rounds: int = 5) -> float:
    """Best of ``rounds`` copies of a freshly allocated buffer (where new memory lands)."""
    best = float("inf")
    for _ in range(rounds):
        buf = bytearray(mib << 20)
        t0 = time.perf_counter()
        bytes(buf)
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


def quiet_core(allowed: list[int]) -> tuple[int, float]:
    """Pin the calling thread to the fastest of ``allowed`` CPUs right now and return (cpu,
    its probe in ms). The lent machines' vCPUs run the same Python 1.5-1.9x apart, and which
    ones are slow changes within a minute (measured: ``vllm_e2e.py --cpu-scan``; a neighbour
    on the physical core, no steal or run-queue wait visible inside the guest), so a short
    request's time says more about where it ran than about the configuration under test.
    Probing every CPU costs ~10 ms; the pin stays until the next call."""
    best = (allowed[0], float("inf"))
    for cpu in allowed:
        os.sched_setaffinity(0, {cpu})  # this thread only; it moves before the call returns
        ms = python_ms(2, 40)
        if ms < best[1]:
            best = (cpu, ms)
    os.sched_setaffinity(0, {best[0]})
    return best


def add_host_flags(p: Any) -> None:
    """The host instruments' options, one definition for ``vllm_e2e.py`` (which passes them on to
    each configuration's process) and ``vllm_e2e_child.py`` (which uses them)."""
    p.add_argument("--quiet-core", action="store_true",
                   help="before each timed request, pin the engine thread to the vCPU that runs "
                        "a short Python probe fastest at that moment (quiet_core; the lent "
                        "machines' vCPUs differ 1.5-1.9x and change within a minute): "
                        "configurations compared on equally quiet cores")
    p.add_argument("--cpu-scan", type=int, default=0,
                   help="after each sweep, this many 16-token requests computed with the engine "
                        "thread pinned to each allowed CPU in turn (vCPUs differ in speed)")
    p.add_argument("--pyspy", type=int, default=0,
                   help="after each sweep, this many 16-token requests computed under py-spy "
                        "(native frames; --pyspy-bin); vllm_e2e.py keeps the profiles in "
                        "OUT_DIR/pyspy")
    p.add_argument("--pyspy-bin", default="py-spy")


def numa_pages() -> dict:
    """Resident pages per NUMA node of the heap and anonymous mappings (``/proc/self/numa_maps``),
    plus the CPUs and memory nodes this process may use."""
    nodes: dict = {}
    try:
        with open("/proc/self/numa_maps") as f:
            for line in f:
                if "heap" not in line and "anon=" not in line:
                    continue
                for field in line.split():
                    if field.startswith("N") and "=" in field:
                        node, _, n = field.partition("=")
                        nodes[node] = nodes.get(node, 0) + int(n)
    except OSError:
        pass
    status = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Cpus_allowed_list", "Mems_allowed_list", "VmLck", "VmRSS"):
                    status[key] = value.strip()
    except OSError:
        pass
    return {"pages_per_node": nodes, **status, "affinity": len(os.sched_getaffinity(0))}


def probe(label: str) -> dict:
    """One labelled measurement (both timings and the memory placement)."""
    return {"at": label, "python_ms": python_ms(), "memory_ms": memory_ms(), **numa_pages()}


def thread_cpu() -> dict[int, tuple[float, float]]:
    """Per Linux thread id: (seconds on a CPU, seconds runnable but waiting for one), from
    the scheduler's nanosecond counters (``/proc/<tid>/schedstat``; {} where absent)."""
    out: dict[int, tuple[float, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait = f.read().split()[:2]
        except (OSError, ValueError):
            continue
        out[int(tid)] = (int(run) / 1e9, int(wait) / 1e9)
    return out


def thread_cpu_delta(before: dict, min_ms: float = 0.5) -> dict[str, list[float]]:
    """Threads that ran at least ``min_ms`` since ``before``: {Python thread name (the
    engine's own is "MainThread"): [ms on a CPU, ms waiting for a CPU]}. Who competed for
    the host during a request, and whether the engine thread was starved of a core."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid, (run, wait) in thread_cpu().items():
        r0, w0 = before.get(tid, (0.0, 0.0))
        if (run - r0) * 1e3 >= min_ms:
            out[names.get(tid, f"tid{tid}")] = [round((run - r0) * 1e3, 2),
                                                round((wait - w0) * 1e3, 2)]
    return out


class _GcTimer:
    """The one garbage-collector callback of this process: times every pass, adds it to the
    totals ``engine_counters`` reads, and marks passes of at least ``mark_min_ms`` on the
    timeline once ``mark_gc_pauses`` asked for it (a long full pass with a census of what it
    walked)."""

    def __init__(self) -> None:
        self.started = 0.0
        self.ms = 0.0
        self.passes = 0
        self.mark_min_ms: float | None = None
        self.censuses = 0
        self._timeline: Any = None

    def install(self) -> None:
        if self in gc.callbacks:  # engine_counters asks before every timed request
            return
        # Everything the callback needs is imported here, never inside it: a pass can start
        # while importlib holds a module lock half taken, and an import from the callback then
        # breaks that lock's bookkeeping (CPython: ``KeyError`` in ``_ModuleLock.acquire``,
        # seen once in CI as a child dying while it imported torch)
        from kvtier.observe.timeline import timeline

        self._timeline = timeline
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        ms = (time.perf_counter() - self.started) * 1e3
        self.ms += ms
        self.passes += 1
        if self.mark_min_ms is not None and ms >= self.mark_min_ms:
            self._mark(ms, info)

    def _mark(self, ms: float, info: dict) -> None:
        fields = {}
        if info.get("generation") == 2 and ms >= 100 and self.censuses < 4:
            self.censuses += 1  # what a long full pass walked (taken after it was timed)
            objs = gc.get_objects()
            counts = collections.Counter(type(o).__qualname__ for o in objs)
            top = sorted(counts.items(), key=lambda kv: -kv[1])[:8]  # most_common imports
            fields = {"tracked": len(objs), "top": top}
            del objs
        self._timeline().mark("python", "gc", generation=info.get("generation"),
                              ms=round(ms, 2), collected=info.get("collected"), **fields)


_GC = _GcTimer()


def engine_counters() -> dict[str, float]:
    """The calling thread's (the engine's, in-process) page faults, voluntary and involuntary
    context switches (``/proc/thread-self``) and the process's garbage-collector time so far.
    A thread that ran as long as the wall clock but slower shows here why: faults (kernel
    time), involuntary switches (a core taken away), or collections."""
    _GC.install()
    out = {"gc_ms": _GC.ms, "gc_passes": _GC.passes}
    try:
        with open("/proc/thread-self/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name
        # fields[0] is the state (field 3): minflt is field 10, majflt field 12
        out.update(minflt=int(fields[7]), majflt=int(fields[9]))
        with open("/proc/thread-self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == "voluntary_ctxt_switches":
                    out["vcsw"] = int(value)
                elif key == "nonvoluntary_ctxt_switches":
                    out["ivcsw"] = int(value)
    except (OSError, ValueError, IndexError):
        pass
    return out


def engine_delta(before: dict) -> dict[str, float]:
    """``engine_counters()`` now minus ``before`` (GC time rounded to 0.01 ms)."""
    now = engine_counters()
    out = {k: now[k] - before[k] for k in now if k in before}
    out["gc_ms"] = round(out.get("gc_ms", 0.0), 2)
    return out


def mark_gc_pauses(min_ms: float = 1.0) -> None:
    """Timeline marks for garbage-collector passes longer than ``min_ms`` (a pause of the
    engine thread that would look like a slow hit)."""
    _GC.mark_min_ms = min_ms
    _GC.install()
