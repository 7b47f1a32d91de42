"""vLLM's step phases under load, per server, side by side: where a saturated step's time goes.

``serving.py --timeline DIR --vllm-marks`` has every server (no connector, native, kvtier)
mark the entry (``>``) and exit (``<``) of vLLM's step phases (``vllm_marks.py``) with the
thread's CPU time. This pairs them per thread and prints, per timeline file and phase: how
many ran per second, their wall and CPU time (median, p90) and the share of the window's wall
time they took. A phase whose wall time grows with a connector while its CPU time does not
waited (the GPU, the GIL); one whose CPU time grows too did more work. With ``--from``/``--to``
(seconds after the file's first mark) only that window counts; with ``--last S`` the file's
last S seconds (the last rate of a ``serving.py`` run: its server is stopped right after it).

    python benchmarks/diagnostics/step_phases.py DIR/1b-native-timeline.jsonl \\
        DIR/1b-kvtier_cpu-timeline.jsonl [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

# the phases worth a row, in the step's order (others are summarised too, after these)
ORDER = ("EngineCore.step", "EngineCore.step_with_batch_queue", "Scheduler.schedule",
         "GPUModelRunner.execute_model", "GPUModelRunner._model_forward",
         "GPUModelRunner.sample_tokens", "Scheduler.update_from_output", "EngineCore.post_step")


def read_spans(path: str, t_from: float | None, t_to: float | None, last: float | None = None
               ) -> tuple[dict[str, list[tuple[float, float]]], float]:
    """Phase -> [(wall s, cpu s)] of the spans that ended inside the window, and the window's
    length (s). Unpaired marks (a server killed mid-phase) are dropped."""
    marks = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                m = json.loads(line)
            except ValueError:
                continue  # a line cut by the server's kill
            if m.get("who") == "vllm" and isinstance(m.get("ev"), str):
                marks.append(m)
    if not marks:
        return {}, 0.0
    marks.sort(key=lambda m: m["t"])
    t0 = marks[0]["t"]
    lo = t0 + t_from if t_from is not None else t0
    hi = t0 + t_to if t_to is not None else marks[-1]["t"]
    if last is not None:
        lo = max(lo, hi - last)
    open_: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for m in marks:
        ev = m["ev"]
        name, edge = ev[:-1], ev[-1]
        key = (m.get("pid"), m.get("tid"), name)
        if edge == ">":
            open_[key].append((m["t"], float(m.get("cpu", 0.0))))
        elif edge == "<" and open_[key]:
            t_in, cpu_in = open_[key].pop()
            if lo <= m["t"] <= hi:
                spans[name].append((m["t"] - t_in, float(m.get("cpu", 0.0)) - cpu_in))
    return spans, max(hi - lo, 1e-9)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def table(path: str, t_from: float | None, t_to: float | None,
          last: float | None = None) -> list[str]:
    spans, window = read_spans(path, t_from, t_to, last)
    rows = [f"### {path}", "", f"window {window:.1f} s", "",
            "| phase | per s | wall p50 ms | wall p90 ms | cpu p50 ms | share of wall |",
            "|---|---|---|---|---|---|"]
    names = [n for n in ORDER if n in spans] + sorted(n for n in spans if n not in ORDER)
    for name in names:
        walls = [w for w, _ in spans[name]]
        cpus = [c for _, c in spans[name]]
        rows.append(f"| {name} | {len(walls) / window:.1f} | {statistics.median(walls) * 1e3:.2f} "
                    f"| {pct(walls, 0.9) * 1e3:.2f} | {statistics.median(cpus) * 1e3:.2f} "
                    f"| {sum(walls) / window:.0%} |")
    return rows + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("timelines", nargs="+", help="timeline files (JSON lines)")
    p.add_argument("--from", dest="t_from", type=float, default=None,
                   help="window start, seconds after each file's first mark")
    p.add_argument("--to", dest="t_to", type=float, default=None,
                   help="window end, seconds after each file's first mark")
    p.add_argument("--last", type=float, default=None,
                   help="only each file's last LAST seconds (after --from/--to)")
    p.add_argument("--md", default=None, help="also write the tables to this file")
    a = p.parse_args(argv)
    out: list[str] = []
    for path in a.timelines:
        try:
            out += table(path, a.t_from, a.t_to, a.last)
        except OSError as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            return 1
    text = "\n".join(out)
    print(text)
    if a.md:
        with open(a.md, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
