"""The event publisher's memory (RSS) while clients misbehave (issue 36.2).

This process runs an ``EventPublisher`` (as vLLM's scheduler would) and publishes a steady
stream of ``BlockStored`` events; a second process holds the misbehaving clients:

- ``stuck-subscriber``: one SUB connects, subscribes and never reads;
- ``idle-replay``: ``--clients`` DEALERs each ask replay for the whole history and never read.

The publisher first runs alone until its replay buffer is full (at least ``--warmup`` seconds),
so the buffer's own bound is not counted as growth; then the clients connect, and RSS is
sampled every second for ``--seconds``. Prints one JSON line: the RSS before the clients, the
largest growth after, the slowest ``publish()`` call meanwhile, the publisher's drop counters.

    python benchmarks/events_memory.py --mode stuck-subscriber --seconds 120
    python benchmarks/events_memory.py --mode idle-replay --clients 8 --seconds 120
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_CLIENT = r"""
import sys, time, zmq
mode, endpoint, replay, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ctx = zmq.Context()
socks = []
if mode == "stuck-subscriber":
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.connect(endpoint)
    s.subscribe(b"")
    socks.append(s)
else:
    for _ in range(n):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.RCVHWM, 1)
        d.setsockopt(zmq.RCVBUF, 4096)
        d.connect(replay)
        d.send_multipart((b"", (0).to_bytes(8, "big")))
        socks.append(d)
print("ready", flush=True)
time.sleep(3600)  # never reads
"""


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("stuck-subscriber", "idle-replay"), required=True)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--events-per-publish", type=int, default=1000)
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("--stall-timeout", type=float, default=None,
                    help="events.stall_timeout_s (default: the config's default)")
    ap.add_argument("--replay-max-bytes", type=int, default=None,
                    help="the replay buffer's bound (default: the publisher's)")
    args = ap.parse_args(argv)

    from kvtier.config.schema import EventsConfig
    from kvtier.manager import events as mgr
    from kvtier.manager.specs import Medium
    from kvtier.observe.events.publisher import EventPublisher

    extra = {} if args.stall_timeout is None else {"stall_timeout_s": args.stall_timeout}
    cfg = EventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                       **extra)
    pub = EventPublisher(cfg, block_tokens=16, replay_max_bytes=args.replay_max_bytes)
    n = args.events_per_publish
    counter = 0
    worst_publish_s = 0.0  # while the clients are connected

    def buffered() -> int:
        held = getattr(pub.stats(), "replay_buffer_bytes", None)
        return pub._buffer.nbytes if held is None else held  # kvtier before issue 36: private

    def buffer_full() -> bool:
        before = buffered()
        publish_for(1.0, None)
        pub.flush()
        return buffered() <= before  # it stopped growing: at its bound

    def publish_for(seconds: float, samples: list[int] | None) -> None:
        nonlocal counter, worst_publish_s
        end = time.monotonic() + seconds
        next_sample = time.monotonic()
        while time.monotonic() < end:
            keys = tuple((counter + i).to_bytes(16, "little") for i in range(n))
            counter += n
            t0 = time.perf_counter()
            pub.publish([mgr.BlockStored(Medium.CPU, keys)])
            if samples is not None:
                worst_publish_s = max(worst_publish_s, time.perf_counter() - t0)
            time.sleep(args.interval_ms / 1000)
            if samples is not None and time.monotonic() >= next_sample:
                samples.append(rss_bytes())
                next_sample += 1.0

    child = None
    try:
        publish_for(args.warmup, None)
        while not buffer_full():
            pass
        before = rss_bytes()
        child = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, args.mode, pub.endpoint, pub.replay_endpoint or "",
             str(args.clients)], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        samples: list[int] = []
        publish_for(args.seconds, samples)
        stats = pub.stats().to_dict()
    finally:
        if child is not None:
            child.kill()
            child.wait()
        pub.close()
    mib = 1 << 20
    print(json.dumps({
        "mode": args.mode, "seconds": args.seconds, "clients": args.clients,
        "rss_before_mib": round(before / mib, 1),
        "rss_growth_max_mib": round((max(samples) - before) / mib, 1),
        "rss_growth_end_mib": round((samples[-1] - before) / mib, 1),
        "worst_publish_ms": round(worst_publish_s * 1000, 2),
        "batches": stats.get("batches"),
        **{k: v for k, v in stats.items() if "subscriber" in k or "replay" in k},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
