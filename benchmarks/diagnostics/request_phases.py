"""Host time of each timed request inside vLLM's phases, side by side: what a connector adds.

With ``--vllm-marks`` every configuration of a ``vllm_e2e.py`` run marks the entry and exit of
vLLM's scheduler and connector phases (``Scheduler.schedule``, ``ActiveKVConnector.pre_forward``
/ ``post_forward``, ``Scheduler.update_from_output``, ...) in its timeline. This sums, for each
timed request, the time spent inside each phase between the client's ``client_submit`` and
its ``client_done`` (nested calls of one phase count once), and prints the medians per
configuration, prompt length and kind of request. A request's TTFT on the lent hosts moves by
several ms with the vCPU it ran on; the time inside the phases a connector runs in does not,
so "kvtier's miss pays 1.3 ms more in ``schedule`` + ``pre_forward`` than the request it
skips" is visible where the TTFTs only scatter. ``LABEL=PATH`` compares runs (e.g. two commits
on one machine).

    python benchmarks/diagnostics/request_phases.py new=OUT/a/timeline.jsonl old=OUT/before/timeline.jsonl
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from collections import defaultdict

from request_counters import kind

PHASES = ("Scheduler.schedule", "ActiveKVConnector.pre_forward",
          "ActiveKVConnector.post_forward", "Scheduler.update_from_output")


def phase_ms(marks: list[dict]) -> dict[str, float]:
    """Milliseconds inside each of ``PHASES`` (``Name>`` enters, ``Name<`` leaves)."""
    total = dict.fromkeys(PHASES, 0.0)
    depth: dict[str, int] = defaultdict(int)
    entered: dict[str, float] = {}
    for m in marks:
        ev = m.get("ev", "")
        name, edge = ev[:-1], ev[-1:]
        if name not in total:
            continue
        if edge == ">":
            if depth[name] == 0:
                entered[name] = m["t"]
            depth[name] += 1
        elif edge == "<" and depth[name] > 0:
            depth[name] -= 1
            if depth[name] == 0:
                total[name] += (m["t"] - entered.pop(name)) * 1e3
    return total


def requests(path: str) -> list[tuple[tuple, float, dict[str, float]]]:
    """(configuration, prompt tokens, kind), TTFT ms and phase ms of every timed request."""
    by_pid: dict[int, list[dict]] = defaultdict(list)
    submits: dict[int, list[float]] = defaultdict(list)
    done = []
    with open(path) as f:
        for line in f:
            m = json.loads(line) if line.strip() else {}
            if m.get("ev") == "client_done" and "ms" in m:
                done.append(m)
            elif m.get("ev") == "client_submit":
                submits[m.get("pid")].append(m["t"])
            elif m.get("who") == "vllm":
                by_pid[m.get("pid")].append(m)
    for marks in by_pid.values():
        marks.sort(key=lambda m: m["t"])
    for ts in submits.values():
        ts.sort()
    times = {pid: [m["t"] for m in marks] for pid, marks in by_pid.items()}
    out = []
    for d in done:
        marks, ts = by_pid.get(d.get("pid"), []), times.get(d.get("pid"), [])
        # from the request's submit mark (its TTFT clock starts a little later, after the
        # lookup's schedule() may already have run), else from the start of its TTFT
        sub = submits.get(d.get("pid"), [])
        i = bisect.bisect_right(sub, d["t"]) - 1
        start = sub[i] if i >= 0 and sub[i] >= d["t"] - d["ms"] / 1e3 - 1.0 else \
            d["t"] - d["ms"] / 1e3
        lo = bisect.bisect_left(ts, start)
        hi = bisect.bisect_right(ts, d["t"])
        key = (d.get("connector", f"pid{d.get('pid')}"), d.get("length"), kind(d))
        out.append((key, d["ms"], phase_ms(marks[lo:hi])))
    return out


def table(labelled: list[tuple[str, str]]) -> list[str]:
    groups: dict[tuple, list[tuple[float, dict]]] = defaultdict(list)
    for label, path in labelled:
        for (config, length, what), ms, phases in requests(path):
            groups[(length or 0, label, config, what)].append((ms, phases))
    short = [p.split(".")[-1] for p in PHASES]
    lines = ["| tokens | run | config | request | n | TTFT ms | " + " | ".join(short)
             + " | sum |", "|" + "---|" * (len(PHASES) + 7)]
    for (length, label, config, what), rows in sorted(groups.items()):
        med = [statistics.median(p[name] for _, p in rows) for name in PHASES]
        total = statistics.median(sum(p.values()) for _, p in rows)
        lines.append(f"| {length} | {label} | {config} | {what} | {len(rows)} | "
                     f"{statistics.median(ms for ms, _ in rows):.2f} | "
                     + " | ".join(f"{v:.2f}" for v in med) + f" | {total:.2f} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("timelines", nargs="+", help="timeline.jsonl files, optionally LABEL=PATH")
    a = p.parse_args()
    labelled = [tuple(x.split("=", 1)) if "=" in x else (x, x) for x in a.timelines]
    print("\n".join(table(labelled)))


if __name__ == "__main__":
    main()
