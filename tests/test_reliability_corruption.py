"""Corruption through the whole stack: a damaged disk record becomes a failed load key, the
manager forgets the block, the store counts and drops it, and nothing raises.

Blocks are first pushed to disk only (demoted, then evicted from CPU); one of them is damaged
behind the store's back; then the rig loads it the way the connector would (DISK -> CPU ->
"GPU" in one chained job). The other blocks must still load byte-exact.
"""

from __future__ import annotations

import os
import pickle

import pytest

from reliability.blocks import key
from reliability.rig import StackRig

from kvtier.manager.events import BlockRemoved
from kvtier.manager.specs import Medium
from kvtier.tiers.disk.index import IndexWriter

N_KEYS = 12


class _Marker:
    def __reduce__(self):  # unpickling would create a file; nothing may ever unpickle this
        return (open, ("/tmp/kvtier-reliability-pwned", "w"))


def _seg(store, seg: int):
    return store.root / "segments" / f"{seg:08d}.seg"


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x04]))


def flip_payload(store, victim, other):
    e = store._index.get(victim)
    _flip(_seg(store, e.segment), e.offset + e.length - 7)


def flip_header(store, victim, other):
    e = store._index.get(victim)
    _flip(_seg(store, e.segment), e.offset + 21)  # inside the record's sequence number


def truncate_segment(store, victim, other):
    e = store._index.get(victim)
    os.truncate(_seg(store, e.segment), e.offset + e.length - 5)


def overwrite_with_other_record(store, victim, other):
    e, o = store._index.get(victim), store._index.get(other)
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
    assert e.segment != store._files.active_id, "test setup: victim must sit in a sealed segment"
    os.unlink(_seg(store, e.segment))


def garbage_index_value(store, victim, other):
    with IndexWriter(store._index) as w:
        w.txn.put(victim, pickle.dumps(_Marker()), db=store._index.blocks)


CORRUPTIONS = [flip_payload, flip_header, truncate_segment, overwrite_with_other_record,
               index_past_end, delete_segment, garbage_index_value]


@pytest.fixture(params=[("none", False), ("zstd", True)], ids=["raw", "zstd"])
def disk_only(request, tmp_path):
    """A rig whose first N_KEYS - 4 blocks live on disk only."""
    compression, compressible = request.param
    rig = StackRig(tmp_path / "disk", cpu_blocks=4, disk_blocks=32, flush_reserve=4,
                   compression=compression, compressible=compressible,
                   segment_bytes=(3 * 2120) if not compressible else 600)
    keys = [key(i) for i in range(N_KEYS)]
    for i in range(0, N_KEYS, 2):
        rig.store_blocks(keys[i:i + 2])
        rig.drain()
    yield rig, keys
    rig.close()


def _counted(store) -> int:
    st = store.stats()
    return st.checksum_failures + st.read_errors


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_damaged_record_is_a_failed_key_and_is_forgotten(disk_only, corrupt):
    rig, keys = disk_only
    victim, other = keys[1], keys[2]
    on_disk_only = keys[: N_KEYS - 4]
    assert rig.manager.lookup(on_disk_only).tiers == (Medium.DISK,) * len(on_disk_only)
    rig.events.clear()
    victim_seg = rig.store._index.get(victim).segment
    survivors = [k for k in on_disk_only if rig.store._index.get(k).segment != victim_seg]
    assert survivors, "test setup: need blocks outside the damaged segment"
    before = _counted(rig.store)

    corrupt(rig.store, victim, other)
    assert rig.load_blocks([victim]) == 1
    rig.drain()

    assert rig.c.failed_load_blocks == 1 and rig.c.wrong_blocks == 0
    assert not rig.c.failed_jobs, f"a job raised instead of reporting a failed key: {rig.c.failed_jobs}"
    assert rig.manager.lookup([victim]).num_hits == 0
    assert victim not in rig.manager.disk and victim not in rig.manager.cpu
    removed = [e for e in rig.events if isinstance(e, BlockRemoved) and e.medium is Medium.DISK]
    assert any(victim in e.keys for e in removed)
    assert not rig.store.contains(victim)
    assert _counted(rig.store) == before + 1
    assert not os.path.exists("/tmp/kvtier-reliability-pwned")

    for k in survivors:  # the rest of the disk tier still serves exact bytes
        assert rig.load_blocks([k]) == 1
        rig.drain()
    assert rig.c.loaded_blocks["DISK"] == len(survivors) and rig.c.wrong_blocks == 0
    assert rig.leaks() == dict.fromkeys(rig.leaks(), 0)
