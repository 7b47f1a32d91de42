"""How many blocks two sharing instances write twice, when neither waits for the other's writes.

Two instances (``kvtier.bench.replay.Replay``: the real manager, transfer engine, I/O
processes and presence directory) take a trace's requests in turn against one real
``valkey-server`` on 127.0.0.1, as a router that ignores prefixes would send them, and keep
going while their writes are still in flight. With few writes in flight (``--max-writes``) the
writes fall behind, and the blocks one instance recomputes because the other had not written
them yet are queued by both. Printed: the server's SET count against its distinct keys (the
difference was written twice), each instance's ``remote_writes_already_held`` (writes skipped
because the block turned out held) and ``remote_writes_skipped``, REMOTE hits, wrong blocks.

    PYTHONPATH=.:tests python benchmarks/diagnostics/shared_write_duplicates.py [--max-writes 2]
        [--requests 300] [--block-kib 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent.parent / "tests")]

from kvtier.bench.replay import Replay  # noqa: E402
from kvtier.bench.trace import load_trace  # noqa: E402
from kvtier.config import load_config  # noqa: E402
from support.valkey_servers import Server  # noqa: E402


def run(args, url: str) -> dict:
    cfg = load_config(data={"tiers": {"cpu": {"capacity": args.cpu}, "remote": {
        "url": url, "io_processes": args.io_processes, "max_writes_in_flight": args.max_writes,
        "namespace": "dup-" + uuid.uuid4().hex[:8]}}}, env={})
    trace = load_trace(args.trace, limit=args.requests)
    gpu_blocks = max(64, 2 * max(len(r.hash_ids) for r in trace))
    a = Replay(cfg, args.block_kib << 10, gpu_blocks)
    b = Replay(cfg, args.block_kib << 10, gpu_blocks)
    start = time.perf_counter()
    try:
        for i, req in enumerate(trace):
            (a if i % 2 == 0 else b).run_request(req)
            a.pump(), b.pump()  # completions only: nobody waits for the writes
        a.drain(), b.drain()
        seconds = time.perf_counter() - start
        reports = [a.report(), b.report()]
    finally:
        a.close(), b.close()
    return {"seconds": round(seconds, 2), "instances": [
        {"already_held": r["manager"]["remote_writes_already_held"],
         "skipped": r["manager"]["remote_writes_skipped"],
         "written": r["manager"]["stored_blocks"]["REMOTE"],
         "remote_hits": r["blocks"]["REMOTE"], "wrong_blocks": r["wrong_blocks"]}
        for r in reports]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-writes", type=int, default=2, help="tiers.remote.max_writes_in_flight")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--cpu", default="64MiB", help="each instance's CPU tier")
    ap.add_argument("--io-processes", type=int, default=2)
    ap.add_argument("--trace", default=None, help="a Mooncake-format trace (default: the bundled one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-dup-") as tmp:
        server = Server(Path(tmp), "--io-threads", "4")
        try:
            out = run(args, server.url)
            c = server.client()
            out["server_sets"] = int(c.info("commandstats")["cmdstat_set"]["calls"])
            out["distinct_keys"] = c.dbsize()
        finally:
            server.stop()
    out["written_twice"] = out["server_sets"] - out["distinct_keys"]
    out["max_writes"], out["requests"], out["block_kib"] = \
        args.max_writes, args.requests, args.block_kib
    print(json.dumps(out))
    return 0 if all(i["wrong_blocks"] == 0 for i in out["instances"]) else 1


if __name__ == "__main__":
    sys.exit(main())
