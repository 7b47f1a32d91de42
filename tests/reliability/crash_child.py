"""Child process of the crash test: works a disk store until the parent SIGKILLs it.

Usage: ``python crash_child.py STORE_DIR JOURNAL SEED``

Every operation is journalled around the call, with unbuffered ``os.write`` on an O_APPEND file
(the kernel keeps it through a SIGKILL): an intent line before the call, an acknowledgement
line once the call returned. The parent replays the journal to know what must have survived
(acknowledged) and what may or may not have (the one call in flight when the kill landed).

Journal lines (key numbers index ``reliability.blocks.key``)::

    O                      store opened          p OP k:v k:v ...   put intent (key:version)
    P OP                   put returned          d OP k k ...       delete intent
    D OP                   delete returned       c OP / C OP        compact intent / returned
    r OP / R OP            close+reopen intent / returned           X   ran out of work
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for `reliability`

from reliability.blocks import GEO, block, key  # noqa: E402

from kvtier.tiers.disk import DiskStore  # noqa: E402

KEYSPACE = 48
RECORD = 56 + 16 + GEO.block_bytes
STORE_OPTS = dict(
    compression="zstd", fsync=True, segment_bytes=6 * RECORD, compact_threshold=0.5,
    compact_budget_bytes=2 * RECORD,
)
MAX_OPS = 20_000
MAX_SECONDS = 60.0  # never outlive a parent that died before killing us


def open_store(path: str) -> DiskStore:
    return DiskStore(path, GEO, **STORE_OPTS)


def main(path: str, journal: str, seed: int) -> None:
    rng = random.Random(seed)
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def note(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    store = open_store(path)
    note("O")
    deadline = time.monotonic() + MAX_SECONDS
    for op in range(MAX_OPS):
        if time.monotonic() > deadline:
            break
        r = rng.random()
        if r < 0.55:
            idx = rng.sample(range(KEYSPACE), rng.randint(1, 6))
            version = seed * 1_000_000 + op
            items = [(key(i), block(key(i), version, compressible=rng.random() < 0.5))
                     for i in idx]
            note(f"p {op} " + " ".join(f"{i}:{version}" for i in idx))
            store.put_many(items)
            note(f"P {op}")
        elif r < 0.82:
            idx = rng.sample(range(KEYSPACE), rng.randint(1, 4))
            note(f"d {op} " + " ".join(map(str, idx)))
            store.delete_many([key(i) for i in idx])
            note(f"D {op}")
        elif r < 0.97:
            note(f"c {op}")
            store.compact()
            note(f"C {op}")
        else:
            note(f"r {op}")
            store.close()
            store = open_store(path)
            note(f"R {op}")
    store.close()
    note("X")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
