"""How fast this process runs plain Python and touches memory, and where its memory lives.

In real vLLM on the H100 every vLLM phase of the engine thread (add_requests, schedule,
update_from_output) took 1.5-2.5x longer in a process that had loaded kvtier, with CPU time equal
to wall time, while the same code on a CPU-only host ran at the same speed with and without
kvtier. A process-wide slowdown of that kind (memory placed on a far NUMA node, a CPU shared with
a busy thread, a tracing hook) shows in a fixed workload timed in the same process before and
after the engine starts, side by side with the no-connector process: that is this probe.
``thread_cpu_seconds`` says which of the process's threads burned CPU meanwhile.
"""

from __future__ import annotations

import os
import threading
import time


def python_ms(rounds: int = 7) -> float:
    """Best of ``rounds`` of a fixed pure-Python workload (dicts, lists, calls), milliseconds."""
    def work() -> int:
        total = 0
        for i in range(200):
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


def thread_cpu_seconds() -> dict:
    """CPU seconds so far of each of this process's threads that used 10 ms or more, as
    ``"<Python name or OS name>/<tid>"`` (Linux ``/proc``): which threads burn CPU beside the
    engine thread (a spinning wait shows here, not in a GIL profile)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        if cpu >= 0.01:
            name = names.get(int(tid)) or stat[stat.index("(") + 1:stat.rindex(")")]
            out[f"{name}/{tid}"] = round(cpu, 2)
    return out
