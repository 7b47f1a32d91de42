"""What a running write-back costs vLLM's engine thread: the GIL, or the machine?

Session 8 measured a pure-Python loop 1.35x slower beside a busy disk writer with kvtier's
0.2 ms GIL switch interval, and at full speed with Python's 5 ms, and blamed the interval.
But at 5 ms the writer is starved (it wrote ~5x fewer blocks), so that comparison does not
separate the GIL from plain CPU and memory contention. This benchmark does: it times a fixed
pure-Python workload (the engine thread's kind of work) alone, beside the production write-back
path (``WorkerRuntime`` CPU -> DISK jobs of 64 blocks of 512 KiB, fsync on) running in a thread
of the same process, and beside the same writer in **another process**, which shares no GIL.
If the other-process ratio matches the same-process one, the slowdown is the machine's.

Reported per ``gil_switch_interval_ms``: the workload's median time alone and its ratios beside
each writer (baseline measured in the same run), with each writer's blocks/s.

    PYTHONPATH=. python benchmarks/diagnostics/writeback_contention.py [--settings 0.2,0] [--seconds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import signal
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gil_starvation import BLOCKS, make_runtime  # noqa: E402

from kvtier.manager.specs import LoadStoreSpec  # noqa: E402


def workload_ms() -> float:
    """A fixed pure-Python workload (ms): the engine thread's kind of work."""
    t = time.perf_counter()
    s = 0
    for i in range(200_000):
        s += i & 7
    return (time.perf_counter() - t) * 1e3


def median_workload(reps: int = 31) -> float:
    return statistics.median(workload_ms() for _ in range(reps))


def write_loop(rt, stop: threading.Event, go: threading.Event, done: list[int]) -> None:
    """CPU -> DISK jobs of BLOCKS blocks through the runtime's engine, keys cycling over 4
    sets (a rewritten key's old record turns dead; the tier never fills). Between jobs it
    waits while ``go`` is clear (paused)."""
    i = 0
    while not stop.is_set():
        go.wait()
        keys = [f"w{i % 4}-{j}".encode() for j in range(BLOCKS)]
        (res,) = rt.engine.wait([rt.engine.submit(LoadStoreSpec.cpu(range(BLOCKS)),
                                                  LoadStoreSpec.disk(keys))])
        if not res.ok:
            raise RuntimeError(f"write-back job failed: {res}")
        done[0] += BLOCKS
        i += 1


class ThreadWriter:
    """The writer in a thread of this process (shares the GIL with the workload)."""

    def __init__(self, rt) -> None:
        self.stop, self.go, self.done = threading.Event(), threading.Event(), [0]
        self.go.set()
        self.thread = threading.Thread(target=write_loop, args=(rt, self.stop, self.go, self.done),
                                       daemon=True)
        self.thread.start()

    def pause(self) -> None:
        self.go.clear()
        n = self.done[0]
        while self.done[0] == n and self.thread.is_alive():  # the job in flight ends
            time.sleep(0.005)

    def resume(self) -> None:
        self.go.set()

    def close(self) -> float:
        self.stop.set()
        self.go.set()
        self.thread.join()
        return float(self.done[0])


class ProcessWriter:
    """The same writer in another process (no GIL shared); paused with SIGSTOP."""

    def __init__(self, ms: float, path: str) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(os.path.dirname(here)), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                                      str(ms), path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        if self.proc.stdout.readline().strip() != "writing":
            raise RuntimeError("writer process did not start")

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> float:
        self.resume()
        out, _ = self.proc.communicate("stop\n", timeout=120)
        if self.proc.returncode != 0:
            raise RuntimeError(f"writer process exited with {self.proc.returncode}")
        return float(out.split()[-1])


def child(ms: float, path: str) -> None:
    """The writer alone in this process until a line on stdin; prints the blocks written."""
    rt = make_runtime(ms, path)
    w = ThreadWriter(rt)
    print("writing", flush=True)
    sys.stdin.readline()
    print(w.close(), flush=True)
    rt.close()


def paired(writer, rounds: int) -> tuple[float, float, float]:
    """Workload medians (ms) with the writer paused and running, alternated ``rounds`` times
    (a VM's speed drifts between windows: each pair shares one), and writer blocks/s."""
    alone, beside, running = [], [], 0.0
    for _ in range(rounds):
        writer.pause()
        alone.append(statistics.median(workload_ms() for _ in range(3)))
        writer.resume()
        time.sleep(0.05)
        t = time.perf_counter()
        beside.append(statistics.median(workload_ms() for _ in range(3)))
        running += time.perf_counter() - t + 0.05
    return statistics.median(alone), statistics.median(beside), running


def run_setting(ms: float, root: str, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(dir=root) as path:  # GBs of records: never left behind
        return _run_setting(ms, path, rounds)


def _run_setting(ms: float, path: str, rounds: int) -> dict:
    own, other = os.path.join(path, "thread"), os.path.join(path, "process")
    rt = make_runtime(ms, own)  # sets the process's switch interval while it is open
    try:
        out: dict = {"ms": ms}
        for name, make in (("thread", lambda: ThreadWriter(rt)),
                           ("process", lambda: ProcessWriter(ms, other))):
            w = make()
            try:
                a, b, running = paired(w, rounds)
            finally:
                blocks = w.close()
            out[name] = {"alone_ms": a, "beside_ms": b, "x": b / a}
            out[name + "_blocks"] = blocks
    finally:
        rt.close()
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(float(argv[1]), argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="0.2,0",
                   help="gil_switch_interval_ms values (0 = Python's default, 5 ms)")
    p.add_argument("--rounds", type=int, default=15, help="paused/running pairs per writer")
    p.add_argument("--dir", default=None, help="where the disk tiers go (default: /tmp)")
    a = p.parse_args(argv)
    if a.rounds < 3:
        p.error("--rounds must be >= 3")
    root = a.dir or tempfile.gettempdir()
    print("| gil_switch_interval_ms | writer thread: paused / running ms (x) | blocks written "
          "| writer process: paused / running ms (x) | blocks written |")
    print("|---|---|---|---|---|")
    for ms in a.settings.split(","):
        r = run_setting(float(ms), root, a.rounds)
        label = "0 (Python's 5 ms)" if r["ms"] == 0 else f"{r['ms']:g}"
        cells = [f"{r[w]['alone_ms']:.1f} / {r[w]['beside_ms']:.1f} ({r[w]['x']:.2f}x) "
                 f"| {r[w + '_blocks']:.0f}" for w in ("thread", "process")]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
