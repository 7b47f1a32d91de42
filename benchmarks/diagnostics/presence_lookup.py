"""How long the scheduler waits for the shared tier's presence answers, beside a busy engine loop.

The scheduler never waits on the network: ``RemoteDirectory.query`` answers "not yet" and its
asker thread sends the EXISTS pipeline; vLLM asks again next step. So a lookup costs as many
engine steps as the asker needs to get the answer, and the asker's Python work (building the
pipeline, parsing the replies) runs only when it wins the GIL from the engine loop, which
hardly ever blocks. In real vLLM a declined lookup cost 15-20 ms more than recompute.

This drives the production directory (``open_remote_directory`` from a config) against a real
``valkey-server`` on 127.0.0.1 and, per lookup size, times from the first ``query`` until every
key is answered while the calling thread plays the engine loop (1 ms of Python between asks),
alone and beside a second thread spinning in Python, at kvtier's GIL switch interval. Reported:
median and max ms, and the median number of "not yet" answers (engine steps).

``--during-write-mib N`` then times 512-key lookups while the tier's own write path
(``RemoteIOProcesses.put_slots``: ``--io-processes`` children, 2 MiB blocks) stores N MiB:
the server runs one event loop for every client, so a lookup waits behind whatever SETs are
queued there.

    PYTHONPATH=.:tests python benchmarks/diagnostics/presence_lookup.py [--sizes 128,512,2048]
        [--during-write-mib 512 --io-processes 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvtier.config import load_config
from kvtier.config.schema import DEFAULT_GIL_SWITCH_INTERVAL_MS
from kvtier.tiers.remote.io.process import RemoteIOProcesses
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.layout import BlockGeometry
from kvtier.tiers.remote.wire.connect import remote_keys
from kvtier.tiers.remote.secrets import RemoteSecrets
from kvtier.tiers.remote.presence import open_remote_directory

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.valkey_servers import Server  # noqa: E402

STEP_S = 0.001  # the engine loop's Python work between two asks


def _step() -> None:
    end = time.perf_counter() + STEP_S
    while time.perf_counter() < end:
        pass


def time_lookups(directory, n: int, rounds: int, tag: str) -> dict:
    ms, asks = [], []
    for r in range(rounds):
        keys = [f"{tag}-{n}-{r}-{i}".encode() for i in range(n)]
        t0, k = time.perf_counter(), 0
        while any(v is None for v in directory.query(keys)):
            k += 1
            _step()
        ms.append((time.perf_counter() - t0) * 1e3)
        asks.append(k)
    return {"keys": n, "p50_ms": round(statistics.median(ms), 2), "max_ms": round(max(ms), 2),
            "not_yet_p50": statistics.median(asks)}


def during_write(cfg, mib: int) -> None:
    """512-key lookups, quiet and while the tier's write path stores ``mib`` MiB."""
    geo = BlockGeometry(num_layers=1, kv_parts=2, engine_blocks_per_block=1,
                        page_bytes=1 << 20, model="presence-diag-write")
    blocks = max(1, mib // 2)
    pool = CpuBlockPool(geo, blocks, pin=False, shared=True)
    io = RemoteIOProcesses(pool, cfg, remote_keys(cfg, geo), RemoteSecrets.load(cfg))
    directory = open_remote_directory(cfg, geo, world_size=1, replicated=False)
    try:
        io.warm_up()
        quiet = time_lookups(directory, 512, 8, "quiet")
        took: dict = {}

        def write() -> None:
            t0 = time.perf_counter()
            io.put_slots(list(range(blocks)), [b"w%d" % i for i in range(blocks)])
            took["ms"] = (time.perf_counter() - t0) * 1e3

        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.02)
        during = [time_lookups(directory, 512, 1, f"during{r}")["max_ms"] for r in range(4)]
        writer.join()
        print({"lookup_512_quiet_p50_ms": quiet["p50_ms"], "write_mib": mib,
               "write_ms": round(took["ms"], 1), "lookups_during_write_ms": during}, flush=True)
    finally:
        directory.close()
        io.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="128,512,2048")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--during-write-mib", type=int, default=0)
    ap.add_argument("--io-processes", type=int, default=8)
    a = ap.parse_args()
    sys.setswitchinterval(DEFAULT_GIL_SWITCH_INTERVAL_MS / 1000)
    server = Server(Path(tempfile.mkdtemp(prefix="kvtier-presence-")))
    try:
        remote = {"url": server.url, "io_processes": a.io_processes, "timeout_s": 10.0}
        cfg = load_config(data={"tiers": {"remote": remote}}, env={}).remote
        run(cfg, a)
        if a.during_write_mib:
            during_write(cfg, a.during_write_mib)
    finally:
        server.stop()
    return 0


def run(cfg, a) -> None:
    geo = BlockGeometry(num_layers=1, kv_parts=2, engine_blocks_per_block=1, page_bytes=1024,
                        model="presence-diag")
    directory = open_remote_directory(cfg, geo, world_size=1, replicated=False)
    spinning = threading.Event()

    def spin() -> None:
        x = 0
        while spinning.is_set():
            x += 1

    try:
        for busy in (False, True):
            if busy:
                spinning.set()
                threading.Thread(target=spin, daemon=True).start()
            for n in (int(s) for s in a.sizes.split(",")):
                row = time_lookups(directory, n, a.rounds, f"busy{int(busy)}")
                print({"beside_a_spinning_thread": busy, **row}, flush=True)
            spinning.clear()
    finally:
        spinning.clear()
        directory.close()


if __name__ == "__main__":
    sys.exit(main())
