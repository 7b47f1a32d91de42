"""Per-request counters of ``vllm_e2e.py`` runs, side by side: where a slow request's time went.

Every timed request of a marked run (``--timeline``: the kvtier configs always, none and native
with ``--vllm-marks``) leaves a ``client_done`` mark with its wall time, the CPU time of each
busy thread (``thread_cpu_ms``) and the engine thread's own counters (``engine``: page faults,
voluntary / involuntary context switches, garbage-collector time) and, with ``--quiet-core``,
the probe of the vCPU it ran on. This prints their medians
per configuration, prompt length and kind of request (hit, paired recompute, miss), so "the
same request is slower in process A than in B" comes with "and A's engine thread was on a
core as long / faulted more / gave up its core more often".

    python benchmarks/diagnostics/request_counters.py OUT/a/timeline.jsonl OUT/b/timeline.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

COLUMNS = ("ms", "core_probe_ms", "engine_cpu", "engine_wait", "others_cpu", "minflt", "vcsw", "ivcsw", "gc_ms",
           "gc_passes")


def kind(mark: dict) -> str:
    if mark.get("miss"):
        return "miss"
    if mark.get("recompute"):
        return "recompute"
    return "hit" if mark.get("cached") else "computed"


def row(mark: dict) -> dict[str, float]:
    threads = mark.get("thread_cpu_ms") or {}
    main = threads.get("MainThread", [0.0, 0.0])
    out = {"ms": mark["ms"], "engine_cpu": main[0], "engine_wait": main[1],
           **({"core_probe_ms": mark["core_probe_ms"]} if "core_probe_ms" in mark else {}),
           "others_cpu": sum(v[0] for k, v in threads.items() if k != "MainThread")}
    out.update({k: v for k, v in (mark.get("engine") or {}).items() if k in COLUMNS})
    return out


def table(paths: list[str]) -> list[str]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for path in paths:
        with open(path) as f:
            for line in f:
                mark = json.loads(line) if line.strip() else {}
                if mark.get("ev") == "client_done" and "ms" in mark:
                    label = mark.get("connector", f"pid{mark.get('pid')}")
                    groups[(label, mark.get("length"), kind(mark))].append(row(mark))
    lines = ["| config | tokens | request | n | " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * (len(COLUMNS) + 4)]
    for (label, length, what), rows in sorted(groups.items(), key=lambda kv: (kv[0][1] or 0,
                                                                               kv[0][0], kv[0][2])):
        cells = []
        for col in COLUMNS:
            values = [r[col] for r in rows if col in r]
            cells.append(f"{statistics.median(values):.2f}" if values else "-")
        lines.append(f"| {label} | {length} | {what} | {len(rows)} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("timelines", nargs="+", help="timeline.jsonl files of vllm_e2e.py runs")
    print("\n".join(table(p.parse_args(argv).timelines)))


if __name__ == "__main__":
    main()
