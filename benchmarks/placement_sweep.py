"""Capacity sweep of the placement policies on every trace we have (issue 15).

For each trace and capacity: block hit rate and blocks written for LRU, ARC, the recommended
default (``lru+reuse_gate``) and Belady's offline optimum, all replayed in the same run by
``kvtier.bench.policy_sim`` (the same numbers ``kvtier bench --compare`` prints through the real
manager). The ``check`` column applies the target: the default is never more than 0.1 point below
LRU, and where it is more than 0.1 point above LRU it writes at most half of LRU's blocks.

Run: ``python benchmarks/placement_sweep.py [--trace FILE] [--shapes zipf,chat,docs,mixed,
multiturn] [--capacity-blocks 500,1000,4000,16000,64000] [--jobs 2] [--out FILE.md]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.bench.belady import belady  # noqa: E402
from kvtier.bench.policy_sim import infinite, simulate  # noqa: E402
from kvtier.bench.trace import load_trace  # noqa: E402
from kvtier.bench.trace_gen import generate  # noqa: E402

POLICIES = ("lru", "arc", "lru+reuse_gate")
DEFAULT = "lru+reuse_gate"
REQUESTS = {"multiturn": 12000}  # generated shapes: 4,000 requests unless listed here
MAX_BELOW_LRU = 0.001  # 0.1 point
MAX_WRITE_SHARE = 0.5


def _trace(name: str, seed: int):
    if name.startswith("file:"):
        return load_trace(name[5:])
    return generate(name, REQUESTS.get(name, 4000), seed)


def _row(job: tuple[str, int, int]) -> tuple[str, int, dict]:
    name, seed, c = job
    trace = _trace(name, seed)
    out = {p: simulate(trace, c, p) for p in POLICIES}
    out["belady"] = belady(trace, c, skip_unused=False)
    return name, c, {p: (r.hit_rate, r.written) for p, r in out.items()}


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
                    help="generated shapes (kvtier/bench/trace_gen.py); '' for none")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--capacity-blocks", default="500,1000,4000,16000,64000")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--out", help="also write the markdown here")
    a = ap.parse_args(argv)
    names = [f"file:{t}" for t in a.trace] + [s for s in a.shapes.split(",") if s]
    caps = [int(c) for c in a.capacity_blocks.split(",") if c.strip()]
    if not names or not caps:
        ap.error("nothing to run: give --trace and/or --shapes, and --capacity-blocks")
    t0 = time.perf_counter()
    jobs = [(n, a.seed, c) for n in names for c in caps]
    with ProcessPoolExecutor(max(1, a.jobs)) as pool:
        results = list(pool.map(_row, jobs))
    by_name: dict[str, dict[int, dict]] = {}
    for name, c, row in results:
        by_name.setdefault(name, {})[c] = row
    parts = ["Cells: block hit rate / blocks written (512-token blocks). Default = "
             f"`{DEFAULT}`; check: >= LRU - 0.1 pt, and <= 50 % of LRU's writes where > LRU "
             "+ 0.1 pt.", ""]
    for name in names:
        trace = _trace(name, a.seed)
        label = (Path(name[5:]).name if name.startswith("file:")
                 else f"{name} (seed {a.seed}, {len(trace):,} requests)")
        parts += [table(label, by_name[name], infinite(trace).hit_rate), ""]
    fails = sum("FAIL" in p for p in parts)
    parts.append(f"{len(jobs)} cells, {fails} tables with a FAIL; {time.perf_counter() - t0:.0f} s")
    text = "\n".join(parts)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
