"""Ways to damage a disk store behind its back, and the check that a load survives each one.

Shared by tests/reliability/test_reliability_corruption.py and benchmarks/reliability_report.py.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path

from support.disk_records import record_entry
from reliability.blocks import key
from reliability.rig import StackRig

from kvtier.manager.events import BlockRemoved
from kvtier.manager.specs import Medium
from kvtier.tiers.disk.catalog.index import IndexWriter

N_KEYS = 12


def marker(store) -> Path:
    """The file an unpickled ``_Marker`` would create: beside this test's own store, so
    concurrent runs never see each other's."""
    return store.root.parent / "kvtier-reliability-pwned"


class _Marker:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # unpickling would create a file; nothing may ever unpickle this
        return (open, (str(self.path), "w"))


def _seg(store, seg: int) -> Path:
    return store.root / "segments" / f"{seg:08d}.seg"


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x04]))


def flip_payload(store, victim, other):
    e = record_entry(store, victim)
    _flip(_seg(store, e.segment), e.offset + e.length - 7)


def flip_header(store, victim, other):
    e = record_entry(store, victim)
    _flip(_seg(store, e.segment), e.offset + 21)  # inside the record's sequence number


def truncate_segment(store, victim, other):
    e = record_entry(store, victim)
    os.truncate(_seg(store, e.segment), e.offset + e.length - 5)


def overwrite_with_other_record(store, victim, other):
    e, o = record_entry(store, victim), record_entry(store, other)
    with open(_seg(store, o.segment), "rb") as f:
        f.seek(o.offset)
        rec = f.read(min(o.length, e.length))
    with open(_seg(store, e.segment), "r+b") as f:
        f.seek(e.offset)
        f.write(rec)


def index_past_end(store, victim, other):
    e = store._index.get(victim)
    size = os.path.getsize(_seg(store, e.segment))
    with IndexWriter(store._index) as w:
        w.put(victim, e._replace(offset=size + 4096))


def delete_segment(store, victim, other):
    e = store._index.get(victim)
    assert e.segment != store._files.active_id, "setup: the victim must sit in a sealed segment"
    os.unlink(_seg(store, e.segment))


def garbage_index_value(store, victim, other):
    with IndexWriter(store._index) as w:
        w.txn.put(victim, pickle.dumps(_Marker(marker(store))), db=store._index.blocks)


CORRUPTIONS = [flip_payload, flip_header, truncate_segment, overwrite_with_other_record,
               index_past_end, delete_segment, garbage_index_value]
CODECS = {"raw": ("none", False), "zstd": ("zstd", True)}


def disk_only_rig(root: Path, codec: str) -> tuple[StackRig, list[bytes]]:
    """A rig whose first N_KEYS - 4 blocks live on disk only (demoted, evicted from CPU)."""
    compression, compressible = CODECS[codec]
    rig = StackRig(root, cpu_blocks=4, disk_blocks=32, flush_reserve=4, compression=compression,
                   compressible=compressible, segment_bytes=600 if compressible else 3 * 2120)
    keys = [key(i) for i in range(N_KEYS)]
    for i in range(0, N_KEYS, 2):
        rig.store_blocks(keys[i:i + 2])
        rig.drain()
    return rig, keys


@dataclass
class CorruptionOutcome:
    """What loading a damaged block did; ``problems`` is empty when everything held."""

    failed_keys: int = 0
    wrong_blocks: int = 0
    survivors_loaded: int = 0
    problems: tuple[str, ...] = ()


def load_after_damage(rig: StackRig, keys: list[bytes], corrupt) -> CorruptionOutcome:
    victim, other = keys[1], keys[2]
    on_disk_only = keys[: N_KEYS - 4]
    problems = []
    m = rig.manager
    if not all(k not in m.cpu and m.disk.is_ready(k) for k in on_disk_only):
        problems.append("setup: blocks not on disk only")
    victim_seg = rig.store._index.get(victim).segment
    survivors = [k for k in on_disk_only if rig.store._index.get(k).segment != victim_seg]
    st = rig.store.stats()
    before = st.checksum_failures + st.read_errors
    rig.events.clear()

    corrupt(rig.store, victim, other)
    promoted = rig.c.promoted_blocks
    # the lookup promotes the victim (DISK -> CPU, a background read the rig runs): the read
    # finds the damage, the promotion fails the key, and the lookup then misses
    if rig.load_blocks([victim]) != 0:
        problems.append("the damaged victim was loaded")
    rig.drain()
    if rig.c.failed_load_blocks == 0 and rig.c.promoted_blocks == promoted:
        problems.append("victim was not offered for loading (never promoted)")
    if rig.c.promoted_blocks != promoted:
        problems.append("the damaged victim was promoted into CPU memory")

    c = rig.c
    if c.failed_load_blocks != 1:
        problems.append(f"{c.failed_load_blocks} failed load keys, expected 1")
    if c.failed_jobs:
        problems.append(f"a job raised instead of reporting a failed key: {dict(c.failed_jobs)}")
    if rig.manager.lookup([victim]).num_hits or victim in rig.manager.disk:
        problems.append("manager still offers the damaged block")
    if not any(isinstance(e, BlockRemoved) and e.medium is Medium.DISK and victim in e.keys
               for e in rig.events):
        problems.append("no BlockRemoved(DISK) event for the damaged block")
    if rig.store.contains(victim):
        problems.append("store still indexes the damaged block")
    st = rig.store.stats()
    if st.checksum_failures + st.read_errors != before + 1:
        problems.append("the damage was not counted exactly once")
    if marker(rig.store).exists():
        problems.append("a crafted payload was unpickled")
    for k in survivors:
        rig.load_blocks([k])
        rig.drain()
    if c.loaded_blocks["DISK"] != len(survivors):
        problems.append(f"{c.loaded_blocks['DISK']} of {len(survivors)} survivors loaded")
    if not survivors:
        problems.append("setup: no survivors outside the damaged segment")
    leaks = {k: v for k, v in rig.leaks().items() if v}
    if leaks:
        problems.append(f"leaks: {leaks}")
    return CorruptionOutcome(c.failed_load_blocks, c.wrong_blocks, c.loaded_blocks["DISK"],
                             tuple(problems))
