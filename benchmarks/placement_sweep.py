"""Capacity sweep of the placement policies on every trace we have (issue 15).

For each trace and capacity: block hit rate and blocks written for LRU, ARC, the recommended
default (``lru+reuse_gate``) and Belady's offline optimum, all replayed in the same run by
``policy_sim.py`` (the same numbers ``kvtier bench --compare`` prints through the real
manager). The ``check`` column applies the target: the default is never more than 0.1 point below
LRU, and where it is more than 0.1 point above LRU it writes at most half of LRU's blocks.

Run: ``python benchmarks/placement_sweep.py [--trace FILE] [--shapes zipf,chat,docs,mixed,
multiturn] [--seeds 1,2,3] [--extra multiturn:3:5000,...] [--capacity-blocks 500,...,64000]
[--jobs 2] [--out FILE.md]``. A summary table comes first: per trace, the default's worst
difference to LRU, its largest share of LRU's writes where it is above LRU, and the share of
the LRU -> Belady gap it closes at C = 4k.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy_sim import simulate  # noqa: E402
from trace_gen import generate  # noqa: E402

from kvtier.bench.belady import belady  # noqa: E402
from kvtier.bench.compare import infinite  # noqa: E402
from kvtier.bench.trace import load_trace  # noqa: E402

POLICIES = ("lru", "arc", "lru+reuse_gate")
DEFAULT = "lru+reuse_gate"
REQUESTS = {"multiturn": 12000}  # generated shapes: 4,000 requests unless listed here
EXTRA = "multiturn:3:5000,multiturn:4:5000"  # shorter multi-turn traces (a tier fills late)
GAP_AT = 4000
MAX_BELOW_LRU = 0.001  # 0.1 point
MAX_WRITE_SHARE = 0.5


def _trace(name: str):
    """``file:PATH`` or ``shape:seed:requests``."""
    if name.startswith("file:"):
        return load_trace(name[5:])
    shape, seed, requests = name.split(":")
    return generate(shape, int(requests), int(seed))


def _label(name: str, trace) -> str:
    if name.startswith("file:"):
        return Path(name[5:]).name
    shape, seed, _ = name.split(":")
    return f"{shape} (seed {seed}, {len(trace):,} requests)"


def _row(job: tuple[str, int]) -> tuple[str, int, dict]:
    name, c = job
    trace = _trace(name)
    out = {p: simulate(trace, c, p) for p in POLICIES}
    out["belady"] = belady(trace, c, skip_unused=False)
    return name, c, {p: (r.hit_rate, r.written) for p, r in out.items()}


def summary_row(label: str, rows: dict[int, dict]) -> str:
    """Worst difference to LRU, largest write share where above LRU, gap closed at 4k."""
    worst = min(((r[DEFAULT][0] - r["lru"][0], c) for c, r in rows.items()))
    above = [(r[DEFAULT][1] / r["lru"][1], c) for c, r in rows.items()
             if r[DEFAULT][0] - r["lru"][0] > MAX_BELOW_LRU and r["lru"][1]]
    writes = f"{max(above)[0]:.0%} (C={max(above)[1]:,})" if above else "-"
    gap = "-"
    if GAP_AT in rows:
        r = rows[GAP_AT]
        if r["belady"][0] - r["lru"][0] >= MAX_BELOW_LRU:
            gap = f"{(r[DEFAULT][0] - r['lru'][0]) / (r['belady'][0] - r['lru'][0]):.0%}"
    ok = "ok" if worst[0] >= -MAX_BELOW_LRU else "FAIL"
    return (f"| {label} | {worst[0] * 100:+.2f} (C={worst[1]:,}) | {ok} | {writes} | {gap} |")


def check(lru: tuple[float, int], default: tuple[float, int]) -> str:
    d = default[0] - lru[0]
    if d < -MAX_BELOW_LRU:
        return f"FAIL ({d * 100:+.2f} pt)"
    if d > MAX_BELOW_LRU and lru[1] and default[1] > MAX_WRITE_SHARE * lru[1]:
        return f"writes {default[1] / lru[1]:.0%}"
    return "ok"


def table(name: str, rows: dict[int, dict], ceiling: float) -> str:
    lines = [f"### {name} (infinite cache: {ceiling:.1%})", "",
             "| C | LRU | ARC | default | Belady | default - LRU | default writes / LRU | check |",
             "|---|---|---|---|---|---|---|---|"]
    for c in sorted(rows):
        r = rows[c]
        cell = {p: f"{h:.1%} / {w / 1000:.1f}k" for p, (h, w) in r.items()}
        lru, dft = r["lru"], r[DEFAULT]
        share = f"{dft[1] / lru[1]:.0%}" if lru[1] else "-"
        lines.append(f"| {c:,} | {cell['lru']} | {cell['arc']} | {cell[DEFAULT]} | "
                     f"{cell['belady']} | {(dft[0] - lru[0]) * 100:+.2f} | {share} | "
                     f"{check(lru, dft)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", action="append", default=[], help="Mooncake jsonl (repeatable)")
    ap.add_argument("--shapes", default="zipf,chat,docs,mixed,multiturn",
                    help="generated shapes (benchmarks/trace_gen.py); '' for none")
    ap.add_argument("--seeds", default="1,2,3", help="seeds of every generated shape")
    ap.add_argument("--extra", default=EXTRA, help="more generated traces, shape:seed:requests")
    ap.add_argument("--capacity-blocks", default="500,1000,2000,4000,8000,16000,32000,64000")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--out", help="also write the markdown here")
    a = ap.parse_args(argv)
    seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
    names = ([f"file:{t}" for t in a.trace]
             + [f"{s}:{seed}:{REQUESTS.get(s, 4000)}" for s in a.shapes.split(",") if s
                for seed in seeds]
             + [x for x in a.extra.split(",") if x.strip()])
    caps = [int(c) for c in a.capacity_blocks.split(",") if c.strip()]
    if not names or not caps:
        ap.error("nothing to run: give --trace and/or --shapes, and --capacity-blocks")
    t0 = time.perf_counter()
    jobs = [(n, c) for n in names for c in caps]
    with ProcessPoolExecutor(max(1, a.jobs)) as pool:
        results = list(pool.map(_row, jobs))
    by_name: dict[str, dict[int, dict]] = {}
    for name, c, row in results:
        by_name.setdefault(name, {})[c] = row
    labels = {name: _label(name, _trace(name)) for name in names}
    head = ["| trace | default - LRU, worst (pt) | >= LRU - 0.1 | writes / LRU where above, "
            f"largest | gap closed at C={GAP_AT:,} |", "|---|---|---|---|---|"]
    head += [summary_row(labels[n], by_name[n]) for n in names]
    parts = head + ["", "Cells: block hit rate / blocks written (512-token blocks). Default = "
             f"`{DEFAULT}`; check: >= LRU - 0.1 pt, and <= 50 % of LRU's writes where > LRU "
             "+ 0.1 pt.", ""]
    for name in names:
        parts += [table(labels[name], by_name[name], infinite(_trace(name)).hit_rate), ""]
    fails = sum("FAIL" in p for p in parts[len(head):])
    parts.append(f"{len(jobs)} cells, {fails} tables with a FAIL; {time.perf_counter() - t0:.0f} s")
    text = "\n".join(parts)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
