"""Where one profiled hit spends its time: a summary of ``vllm_e2e.py --profile`` traces.

Why: kvtier's timeline marks show host hooks only; whether the GPU sat idle, which copies ran
how long, and whether the host blocked in a CUDA sync are in the torch.profiler trace. This
reads a chrome trace (``.json`` or ``.json.gz``) and prints, in ms from the first event:
GPU busy time per kind (kernels, host->device and device->host copies, with bytes), the GPU's
idle gaps, host CUDA runtime calls that took long (syncs, 2D copies), and the annotations
vLLM records (``record_function`` ranges).

    python benchmarks/diagnostics/profile_summary.py TRACE [TRACE ...] [--gap-ms 0.3] [--call-ms 0.2]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def summarize(path: str, gap_ms: float, call_ms: float) -> str:
    events = load(path)
    if not events:
        return f"{path}: no events"
    t0 = min(e["ts"] for e in events)
    t_end = max(e["ts"] + e["dur"] for e in events)
    ms = lambda us: (us - t0) / 1e3  # noqa: E731
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    lines = [f"# {path}: {len(events)} events over {(t_end - t0) / 1e3:.2f} ms"]
    kinds: dict[str, list] = defaultdict(lambda: [0, 0.0, 0, None, None])
    for e in gpu:
        name = e.get("name", "")
        kind = ("HtoD" if "HtoD" in name else "DtoH" if "DtoH" in name else "DtoD"
                if "DtoD" in name else e["cat"])
        k = kinds[kind]
        k[0] += 1
        k[1] += e["dur"]
        k[2] += int(e.get("args", {}).get("bytes", 0) or 0)
        k[3] = e["ts"] if k[3] is None else min(k[3], e["ts"])
        k[4] = e["ts"] + e["dur"] if k[4] is None else max(k[4], e["ts"] + e["dur"])
    for kind, (n, dur, nbytes, first, last) in sorted(kinds.items()):
        rate = f", {nbytes / dur / 1e3:.1f} GB/s busy" if nbytes and dur else ""
        lines.append(f"GPU {kind:10} n={n:5} busy {dur / 1e3:8.3f} ms  bytes {nbytes / 2**20:9.1f} MiB"
                     f"  span {ms(first):8.3f} .. {ms(last):8.3f}{rate}")
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    if busy:
        lines.append(f"GPU busy (union) {sum(e - s for s, e in busy) / 1e3:.3f} ms, first "
                     f"{ms(busy[0][0]):.3f}, last end {ms(busy[-1][1]):.3f}")
        gaps = [(e0, s1) for (_, e0), (s1, _) in zip(busy, busy[1:]) if s1 - e0 >= gap_ms * 1e3]
        for e0, s1 in gaps[:40]:
            lines.append(f"  GPU idle {ms(e0):8.3f} .. {ms(s1):8.3f}  ({(s1 - e0) / 1e3:.3f} ms)")
    calls: dict[str, list] = defaultdict(lambda: [0, 0.0])
    long_calls = []
    for e in events:
        if e.get("cat") != "cuda_runtime" and e.get("cat") != "cuda_driver":
            continue
        c = calls[e["name"]]
        c[0] += 1
        c[1] += e["dur"]
        if e["dur"] >= call_ms * 1e3:
            long_calls.append(e)
    lines.append("CUDA runtime calls (host): " + ", ".join(
        f"{name} n={n} {dur / 1e3:.2f} ms" for name, (n, dur) in
        sorted(calls.items(), key=lambda kv: -kv[1][1])[:10]))
    for e in sorted(long_calls, key=lambda e: e["ts"])[:40]:
        lines.append(f"  host {ms(e['ts']):8.3f} +{e['dur'] / 1e3:7.3f} ms  {e['name']}")
    ops: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e["name"]][0] += 1
            ops[e["name"]][1] += e["dur"]
    lines.append("host ops (inclusive): " + ", ".join(
        f"{name} n={n} {dur / 1e3:.2f} ms" for name, (n, dur) in
        sorted(ops.items(), key=lambda kv: -kv[1][1])[:14]))
    notes = sorted((e for e in events if e.get("cat") in ("user_annotation", "gpu_user_annotation")
                    and e["dur"] >= 50), key=lambda e: e["ts"])
    for e in notes[:60]:
        lines.append(f"  {e['cat'][:8]:8} {ms(e['ts']):8.3f} +{e['dur'] / 1e3:7.3f} ms  {e['name'][:80]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--gap-ms", type=float, default=0.3, help="GPU idle gaps shown from (ms)")
    p.add_argument("--call-ms", type=float, default=0.2, help="host CUDA calls shown from (ms)")
    a = p.parse_args(argv)
    for path in a.traces:
        print(summarize(path, a.gap_ms, a.call_ms))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
