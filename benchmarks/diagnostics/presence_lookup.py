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

    PYTHONPATH=.:tests python benchmarks/diagnostics/presence_lookup.py [--sizes 128,512,2048]
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
from kvtier.tiers.layout import BlockGeometry
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="128,512,2048")
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    sys.setswitchinterval(DEFAULT_GIL_SWITCH_INTERVAL_MS / 1000)
    server = Server(Path(tempfile.mkdtemp(prefix="kvtier-presence-")))
    try:
        cfg = load_config(data={"tiers": {"remote": {"url": server.url}}}, env={}).remote
        run(cfg, a)
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
