"""kill -9 of host-tier instances in a loop: the others are never served a wrong block, and
once every instance is gone the service holds no pin, no region and no block.

Three instances (``host_kill_child.py``: real processes, each the production replay path)
share one host tier whose regions are small enough that they evict all the time (so
retirements race with other instances' reads); one of them is SIGKILLed at a random point,
mid-store or mid-load, and replaced, 50 times.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvtier.tiers.host import HostAddress
from kvtier.tiers.host.client import observe

from reliability import host_kill_child

CHILD = Path(host_kill_child.__file__).resolve()
KILLS = 50
LIVE = 3
BB = host_kill_child.BB


def _config(tmp_path: Path) -> dict:
    # 24 slots per instance, room for 6 regions: dead ones still read, live ones, new ones
    return {"tiers": {"cpu": {"capacity": 24 * BB, "pin": False},
                      "host": {"capacity": 6 * 24 * BB, "dir": str(tmp_path / "host"),
                               "idle_exit_s": 60}}}


def _counts(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _stats(cfg: dict, fingerprint: str) -> dict:
    from kvtier.config import load_config

    host = load_config(data=cfg).host
    return observe(HostAddress.from_config(host, fingerprint, BB).socket_path)


def test_kill_9_of_instances_in_a_loop_serves_no_wrong_block_and_leaks_no_slot(tmp_path):
    cfg = _config(tmp_path)
    rng = random.Random(47)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(CHILD.parent.parent), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])}
    outs: list[Path] = []
    live: list[tuple[subprocess.Popen, Path]] = []

    def spawn() -> None:
        out = tmp_path / f"child{len(outs)}.json"
        outs.append(out)
        proc = subprocess.Popen([sys.executable, str(CHILD), json.dumps(cfg), str(out),
                                 str(rng.randrange(1 << 30))], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        live.append((proc, out))

    kills = 0
    service_pid = None
    try:
        for _ in range(LIVE):
            spawn()
        # the kills start once the instances hit each other's blocks (a slow machine takes
        # a while to get there), so that they land while others read the victim's blocks
        deadline = time.monotonic() + 300
        while sum((_counts(o) or {}).get("foreign_hits", 0) for _, o in live) == 0:
            assert time.monotonic() < deadline, "no instance hit another's block in 300 s"
            for p, o in live:
                assert p.poll() is None, p.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        deadline = time.monotonic() + 900
        while kills < KILLS and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.05, 0.4))
            running = [(p, o) for p, o in live if (_counts(o) or {}).get("requests", 0) > 1]
            for p, o in live:
                assert p.poll() is None, p.stderr.read().decode()[-2000:]
            if not running:
                continue
            proc, out = rng.choice(running)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            live.remove((proc, out))
            kills += 1
            spawn()
        assert kills == KILLS, f"only {kills} kills in the time allowed"
        from kvtier.bench.replay import bench_geometry

        fingerprint = bench_geometry(BB).fingerprint()
        service_pid = _stats(cfg, fingerprint)["pid"]
    finally:
        for proc, _ in live:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    try:
        totals = [c for c in map(_counts, outs) if c is not None]
        print(f"host kill rig: {kills} kills, {len(outs)} instances, "
              f"{sum(c['requests'] for c in totals)} requests, "
              f"{sum(c['cpu_hits'] for c in totals)} CPU hit blocks, of which "
              f"{sum(c['foreign_hits'] for c in totals)} another instance's, "
              f"{sum(c['wrong_blocks'] for c in totals)} wrong, "
              f"{sum(c['failed_loads'] for c in totals)} failed loads")
        assert sum(c["wrong_blocks"] for c in totals) == 0
        assert sum(c["requests"] for c in totals) > KILLS
        # the rig means something: instances hit each other's blocks while others died
        assert sum(c["foreign_hits"] for c in totals) > 0
        # every instance is gone: within a bounded time, nothing of theirs is left
        deadline = time.monotonic() + 120
        while True:
            stats = _stats(cfg, fingerprint)
            left = stats["instances"]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert left == [], left
        assert stats["pinned_slots"] == 0 and stats["published_blocks"] == 0
        assert stats["free_slots"] == stats["total_slots"]
    finally:
        if service_pid is not None:
            os.kill(service_pid, signal.SIGKILL)
