"""Whether a fresh runtime's first shared-tier load is slower than its next ones, outside vLLM.

In real vLLM a fresh instance's first REMOTE -> CPU job (128 blocks of 2 MiB) moved at under
4 GB/s while its later, larger jobs moved at over 13 GB/s, and the cost model learned the slow
figure. This separates a cold start (connections, socket buffers, the I/O processes' first
calls, the server's buffers) from what vLLM's process adds: one runtime stores ``--blocks``
blocks into a real ``valkey-server`` on 127.0.0.1, then each of ``--reps`` fresh runtimes
(new I/O processes, the production ``WorkerRuntime.create`` path, started ``--settle-s``
before the first job as vLLM's start-up would) loads them ``--jobs`` times into other CPU
slots. Printed: ms per job of each runtime, and the medians. ``--write-other`` has each fresh
runtime store other blocks first (its connections and the server were just busy),
``--write-first`` read blocks it stored itself, ``--server-args`` passes server settings
(results: benchmarks/results/vllm_remote_NVIDIA-H200.md, "What a 256 MiB or 1 GiB read costs").

    PYTHONPATH=.:tests python benchmarks/diagnostics/first_remote_job.py [--io-processes 8]
        [--blocks 128] [--jobs 4] [--reps 3] [--pin] [--same-slots] [--write-first]
        [--write-other] [--server-args="--events-per-io-thread 0"]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent.parent / "tests"), str(HERE.parent)]

from remote_bandwidth import block_runtime, fill_random  # noqa: E402
from kvtier.config import load_config  # noqa: E402
from kvtier.manager.specs import LoadStoreSpec  # noqa: E402
from support.valkey_servers import Server  # noqa: E402

BLOCK = 2 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--io-processes", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=128, help="blocks of 2 MiB per job")
    ap.add_argument("--jobs", type=int, default=4, help="jobs per fresh runtime")
    ap.add_argument("--reps", type=int, default=3, help="fresh runtimes")
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--pin", action="store_true", help="a pinned CPU pool (needs CUDA)")
    ap.add_argument("--same-slots", action="store_true",
                    help="every job into the same CPU slots (default: each job into slots no "
                         "job touched yet)")
    ap.add_argument("--io-threads", type=int, default=8, help="the server's io-threads")
    ap.add_argument("--server-args", default="",
                    help="more valkey-server arguments, e.g. '--events-per-io-thread 0'")
    ap.add_argument("--write-first", action="store_true",
                    help="each fresh runtime first stores the blocks itself under new keys, "
                         "and its jobs read those (as remote_tier.py's rounds do)")
    ap.add_argument("--write-other", action="store_true",
                    help="each fresh runtime first stores the blocks under throwaway keys, "
                         "then its jobs read the first runtime's keys")
    a = ap.parse_args()
    n = a.blocks
    server = Server(Path(tempfile.mkdtemp(prefix="kvtier-first-job-")),
                    "--io-threads", str(a.io_threads), *a.server_args.split())
    rows = []
    try:
        cfg = load_config(data={"tiers": {"remote": {
            "url": server.url, "io_processes": a.io_processes, "timeout_s": 5.0}}}, env={})

        def runtime():  # every runtime in the same key space: the readers find the writer's
            return block_runtime(cfg, BLOCK, (a.jobs + 1) * n, pin=a.pin,
                                 model="first-remote-job")

        keys = [f"first-job-{i}".encode() for i in range(n)]
        writer = runtime()
        try:
            writer.pool.wait_ready()
            fill_random(writer, n, BLOCK)
            [res] = writer.engine.wait([writer.engine.submit(LoadStoreSpec.cpu(list(range(n))),
                                                             LoadStoreSpec.remote(keys))])
            if not res.ok:
                raise RuntimeError(f"the blocks were not stored: {res}")
        finally:
            writer.close()
        del writer
        gc.collect()
        for rep in range(a.reps):
            rt = runtime()
            try:
                rt.pool.wait_ready()
                time.sleep(a.settle_s)
                if a.write_first or a.write_other:
                    mine = [f"first-job-{rep}-{i}".encode() for i in range(n)]
                    [res] = rt.engine.wait([rt.engine.submit(LoadStoreSpec.cpu(list(range(n))),
                                                             LoadStoreSpec.remote(mine))])
                    if a.write_first:
                        keys = mine
                    if not res.ok:
                        raise RuntimeError(f"the blocks were not stored: {res}")
                ms = []
                for j in range(a.jobs):
                    first = n if a.same_slots else (j + 1) * n
                    slots = list(range(first, first + n))
                    t0 = time.perf_counter()
                    [res] = rt.engine.wait([rt.engine.submit(LoadStoreSpec.remote(keys),
                                                             LoadStoreSpec.cpu(slots))])
                    ms.append(round((time.perf_counter() - t0) * 1e3, 1))
                    if res.failed_keys or not res.ok:
                        raise RuntimeError(f"job {j} failed: {res}")
            finally:
                rt.close()
            del rt
            gc.collect()
            rows.append(ms)
            print(f"runtime {rep}: " + " ".join(f"{t:7.1f}" for t in ms) + " ms", flush=True)
    finally:
        server.stop()
    med = [statistics.median(c) for c in zip(*rows)]
    gbps = [round(n * BLOCK / (t / 1e3) / 1e9, 2) for t in med]
    print(json.dumps({"io_processes": a.io_processes, "blocks": n, "pin": a.pin,
                      "same_slots": a.same_slots, "write_first": a.write_first,
                      "write_other": a.write_other, "server_args": a.server_args,
                      "jobs_ms": rows, "median_ms": med, "median_gbps": gbps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
