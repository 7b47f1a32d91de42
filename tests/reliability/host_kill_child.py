"""One kvtier instance on a host tier, replaying requests until it is killed (the parent,
``test_reliability_host_kill.py``, SIGKILLs it at a random point).

Every load is checked byte for byte against the block its key names (``kvtier bench``'s
replay: the production manager, worker runtime, transfer engine and pool); the counts so far
are written after every request (atomically), so a killed instance's last word survives it.

    python host_kill_child.py CONFIG_JSON OUT_JSON SEED
"""

from __future__ import annotations

import json
import os
import random
import sys

from kvtier.bench.replay import Replay
from kvtier.bench.trace import load_trace
from kvtier.config import load_config

BB = 64 << 10


def main(argv: list[str]) -> int:
    cfg = load_config(data=json.loads(argv[0]))
    out, rng = argv[1], random.Random(int(argv[2]))
    trace = load_trace()
    replay = Replay(cfg, BB, max(len(r.hash_ids) for r in trace) + 1)
    while True:
        replay.run_request(rng.choice(trace))
        replay.drain()
        r = replay.result
        counts = {"requests": r.requests, "wrong_blocks": r.wrong_blocks,
                  "failed_loads": r.failed_loads, "cpu_hits": r.blocks["CPU"],
                  "foreign_hits": replay.manager.stats.host_foreign_hit_blocks}
        with open(out + ".tmp", "w") as f:
            json.dump(counts, f)
        os.replace(out + ".tmp", out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
