"""Disk-tier I/O beside a busy Python thread: Python's 5 ms GIL switch interval vs kvtier's.

In vLLM the engine loop is a Python thread that hardly ever blocks; while a load is in flight
it runs one step after another. kvtier's disk reads and write-backs are chains of GIL hand-offs
(engine loop -> transfer loop -> reader/writer thread -> each syscall -> completion), and each
hand-off waits until the busy thread's switch interval runs out (kvtier/runtime/gil.py). This
benchmark drives the production path (``WorkerRuntime.create`` from a config, jobs through its
``TransferEngine``) on the CPU and times, per setting of ``gil_switch_interval_ms``:

- a one-block and a 64-block DISK -> CPU read and a 64-block CPU -> DISK write (median),
- with no other thread (the baseline of the same run) and beside a thread spinning in Python,
- and how much of its solo rate the spinning thread kept (what the engine loop pays).

Reported as ratios against the idle baseline measured in the same run. Blocks are 512 KiB
(a Llama-3.2-1B-shaped 16-token block: 16 layers x K/V x 16 KiB).

    PYTHONPATH=. python benchmarks/diagnostics/gil_starvation.py [--settings 0,1,0.5,0.2] [--out F.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time

import torch

from kvtier.config import load_config
from kvtier.manager.specs import LoadStoreSpec
from kvtier.runtime.worker import WorkerRuntime
from kvtier.tiers.gpu_view import GpuKvView

BLOCKS = 64


class Spinner:
    """A Python thread that never blocks (vLLM's engine loop while a load is in flight)."""

    def __init__(self) -> None:
        self.count = 0
        self._run = True
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while self._run:
            x = 0
            for i in range(1000):
                x += i
            self.count += 1

    def stop(self) -> None:
        self._run = False
        self._thread.join()


def solo_rate(seconds: float = 0.5) -> float:
    s = Spinner()
    time.sleep(seconds)
    s.stop()
    return s.count / seconds


def measure(rt: WorkerRuntime, keys: list[bytes], reps: int) -> dict[str, float]:
    engine = rt.engine

    def timed(src: LoadStoreSpec, dst: LoadStoreSpec) -> float:
        t = time.perf_counter()
        (res,) = engine.wait([engine.submit(src, dst)])
        if not res.ok:
            raise RuntimeError(f"job failed: {res}")
        return (time.perf_counter() - t) * 1e3

    out = {
        "read 1": statistics.median(
            timed(LoadStoreSpec.disk(keys[:1]), LoadStoreSpec.cpu([BLOCKS])) for _ in range(reps)),
        f"read {BLOCKS}": statistics.median(
            timed(LoadStoreSpec.disk(keys), LoadStoreSpec.cpu(range(BLOCKS, 2 * BLOCKS)))
            for _ in range(reps)),
    }
    writes = []
    for r in range(max(3, reps // 2)):
        fresh = [f"w{r}-{time.perf_counter_ns()}-{j}".encode() for j in range(BLOCKS)]
        writes.append(timed(LoadStoreSpec.cpu(range(BLOCKS)), LoadStoreSpec.disk(fresh)))
    out[f"write {BLOCKS}"] = statistics.median(writes)
    return out


def make_runtime(ms: float, path: str) -> WorkerRuntime:
    """The production worker runtime over 2 x BLOCKS host "GPU" blocks of 512 KiB, a CPU tier
    and an fsync'd disk tier in ``path`` (the caller removes it)."""
    layers = {f"l{i}": torch.zeros(2 * BLOCKS, 2, 8192, dtype=torch.bfloat16) for i in range(16)}
    view = GpuKvView(layers, "block_pages")
    cfg = load_config(data={"gil_switch_interval_ms": ms,
                            "tiers": {"cpu": {"capacity": "256MiB"},
                                      "disk": {"path": path,
                                               "capacity": "8GiB", "fsync": True}}})
    return WorkerRuntime.create(cfg, view, view.geometry(1))


def run_setting(ms: float, reps: int, root: str) -> dict:
    with tempfile.TemporaryDirectory(dir=root) as path:  # GBs of records: never left behind
        return _run_setting(ms, reps, path)


def _run_setting(ms: float, reps: int, path: str) -> dict:
    rt = make_runtime(ms, path)
    try:
        keys = [f"b-{j}".encode() for j in range(BLOCKS)]
        rt.engine.wait([rt.engine.submit(LoadStoreSpec.cpu(range(BLOCKS)), LoadStoreSpec.disk(keys))])
        idle = measure(rt, keys, reps)
        alone = solo_rate()
        spin = Spinner()
        time.sleep(0.05)
        c0, t0 = spin.count, time.perf_counter()
        busy = measure(rt, keys, reps)
        kept = (spin.count - c0) / (time.perf_counter() - t0) / alone
        spin.stop()
    finally:
        rt.close()
    return {"ms": ms, "idle": idle, "busy": busy, "spinner_kept": kept}


def table(results: list[dict]) -> str:
    ops = list(results[0]["idle"])
    head = "| gil_switch_interval_ms | " + " | ".join(
        f"{op}: idle / busy ms (x idle)" for op in ops) + " | busy thread kept |"
    lines = [head, "|" + "---|" * (len(ops) + 2)]
    for r in results:
        label = "0 (Python's 5 ms)" if r["ms"] == 0 else f"{r['ms']:g}"
        cells = [f"{r['idle'][op]:.2f} / {r['busy'][op]:.2f} ({r['busy'][op] / r['idle'][op]:.1f}x)"
                 for op in ops]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {r['spinner_kept']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="0,1,0.5,0.2",
                   help="gil_switch_interval_ms values to compare (0 = Python's default)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dir", default=None, help="where the disk tiers go (default: /tmp)")
    p.add_argument("--out", default=None, help="also write the table to this Markdown file")
    a = p.parse_args(argv)
    before = sys.getswitchinterval()
    results = [run_setting(float(ms), a.reps, a.dir or tempfile.gettempdir())
               for ms in a.settings.split(",")]
    assert sys.getswitchinterval() == before, "the runtime must restore the interval"
    text = table(results)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
