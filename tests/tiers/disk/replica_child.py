"""Rank 1 of a replicated (MLA) disk layout, in its own process, driven line by line.

Started by tests/tiers/disk/test_disk_replicated.py as ``python replica_child.py <disk path>``
(replica_common.py beside it is importable: a script's folder is sys.path[0]): it builds the
worker runtime exactly as the connector does for rank 1 of 2 (``replicated=True``, rank
0's directory ``<path>/rank0``) and answers one JSON line per command read from stdin:

- ``demote K,K``  fill CPU slots with each key's bytes, run CPU -> DISK; -> ``{"ok"}``
- ``load K,K``    run DISK -> CPU into zeroed slots; -> ``{"ok", "failed", "transient",
                  "equal"}`` (``equal``: each slot holds exactly the key's bytes)
- ``drop K,K``    run DISK -> DROP; -> ``{"ok"}``
- ``pause``       from now on, every segment read first prints ``{"paused": seg}`` and waits
                  for a line (``go``) from stdin: the parent moves records in between
- ``unpause``, ``mode`` (-> ``{"mode"}``), ``quit``

Keys travel hex-encoded. Nothing read is unpickled.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kvtier.manager.specs import LoadStoreSpec
from kvtier.runtime.worker import WorkerRuntime
from kvtier.tiers.disk.segments import SegmentFiles

from replica_common import geometry, pattern, rank_config, view_for

_real_pread = SegmentFiles.pread
_paused = False


def _pausing_pread(self, seg, bufs, offset):
    if _paused:
        reply({"paused": seg})
        sys.stdin.readline()
    return _real_pread(self, seg, bufs, offset)


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    global _paused
    root = Path(sys.argv[1])
    SegmentFiles.pread = _pausing_pread
    rt = WorkerRuntime.create(rank_config(root, 1), view_for(geometry(1)), geometry(1), rank=1,
                              world_size=2, rank0_geometry=geometry(0), replicated=True,
                              rank0_disk=root / "rank0")
    reply({"ready": True})
    try:
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            keys = [bytes.fromhex(k) for k in arg.split(",") if k]
            slots = list(range(len(keys)))
            if cmd == "demote":
                for s, k in zip(slots, keys):
                    data = torch.frombuffer(bytearray(pattern(k)), dtype=torch.uint8)
                    rt.pool.slot(s).copy_(data)
                [r] = rt.engine.wait([rt.engine.submit(LoadStoreSpec.cpu(slots),
                                                       LoadStoreSpec.disk(keys))])
                reply({"ok": r.ok, "error": r.error})
            elif cmd == "load":
                for s in slots:
                    rt.pool.slot(s).zero_()
                [r] = rt.engine.wait([rt.engine.submit(LoadStoreSpec.disk(keys),
                                                       LoadStoreSpec.cpu(slots))])
                equal = [bytes(rt.pool.slot(s).numpy()) == pattern(k) for s, k in zip(slots, keys)]
                reply({"ok": r.ok, "failed": [k.hex() for k in r.failed_keys],
                       "transient": [k.hex() for k in r.transient_keys], "equal": equal})
            elif cmd == "drop":
                [r] = rt.engine.wait([rt.engine.submit(LoadStoreSpec.disk(keys),
                                                       LoadStoreSpec.drop(keys))])
                reply({"ok": r.ok})
            elif cmd in ("pause", "unpause"):
                _paused = cmd == "pause"
                reply({"ok": True})
            elif cmd == "mode":
                reply({"mode": rt.replica.mode if rt.replica is not None else None})
            elif cmd == "quit":
                break
    finally:
        rt.close()


if __name__ == "__main__":
    main()
