"""How many copies of a block the host holds, and how many hits the instances find: two
instances taking a trace's requests in turn (a router that ignores prefixes), with private
CPU tiers and with one host tier, the same CPU bytes per instance.

Each instance is ``kvtier.bench.replay.Replay`` (the real manager, worker runtime, transfer
engine and pool; the host tier's real service process); every load is checked byte for byte.
Printed as JSON per configuration: CPU hit blocks per instance (and of them, blocks the other
instance stored), blocks held in CPU memory over both instances, distinct keys among them,
keys held twice, bytes held, wrong blocks.

    python benchmarks/host_tier_copies.py [--requests 400] [--block-kib 64] [--cpu-mib 32]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kvtier.bench.replay import Replay  # noqa: E402
from kvtier.bench.trace import load_trace  # noqa: E402
from kvtier.config import load_config  # noqa: E402
from kvtier.tiers.host import HostAddress  # noqa: E402
from kvtier.tiers.host.client import observe  # noqa: E402


def run(trace, block_bytes: int, cpu_bytes: int, host_dir: Path | None) -> dict:
    tiers: dict = {"cpu": {"capacity": cpu_bytes, "pin": False}}
    if host_dir is not None:
        tiers["host"] = {"capacity": 2 * cpu_bytes, "dir": str(host_dir), "idle_exit_s": 5}
    cfg = load_config(data={"tiers": tiers}, env={})
    gpu_blocks = max(len(r.hash_ids) for r in trace) + 1  # the engine keeps one request
    pair = [Replay(cfg, block_bytes, gpu_blocks), Replay(cfg, block_bytes, gpu_blocks)]
    service_pid = None
    try:
        for i, req in enumerate(trace):
            rep = pair[i % 2]
            rep.run_request(req)
            rep.drain()
        held = [set(r.manager.cpu.keys()) for r in pair]
        out = {
            "hit_blocks_cpu": [r.result.blocks["CPU"] for r in pair],
            "of_them_the_other_instances": [r.manager.stats.host_foreign_hit_blocks
                                            for r in pair],
            "miss_blocks": [r.result.blocks["MISS"] for r in pair],
            "blocks_held": sum(map(len, held)),
            "distinct_keys_held": len(held[0] | held[1]),
            "keys_held_twice": len(held[0] & held[1]),
            "bytes_held": sum(map(len, held)) * block_bytes,
            "wrong_blocks": sum(r.result.wrong_blocks for r in pair),
        }
        if host_dir is not None:
            g = pair[0].geometry
            stats = observe(HostAddress(host_dir, g.fingerprint(), 0).socket_path)
            service_pid = stats["pid"]
            out["host_published_blocks"] = stats["published_blocks"]
        return out
    finally:
        for r in pair:
            r.close()
        if service_pid is not None:
            os.kill(service_pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=None, help="Mooncake JSONL (default: the bundled one)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--block-kib", type=int, default=64)
    p.add_argument("--cpu-mib", type=int, default=32, help="CPU tier per instance")
    a = p.parse_args(argv)
    trace = load_trace(a.trace, limit=a.requests)
    bb, cpu = a.block_kib << 10, a.cpu_mib << 20
    with tempfile.TemporaryDirectory(prefix="kvtier-host-copies-") as tmp:
        host_dir = Path(tmp) / "host"
        result = {"requests": len(trace), "block_bytes": bb, "cpu_bytes_per_instance": cpu,
                  "private": run(trace, bb, cpu, None),
                  "host": run(trace, bb, cpu, host_dir)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
