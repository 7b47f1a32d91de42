"""Corruption through the whole stack: a damaged disk record becomes a failed load key, the
manager forgets the block (and says so with BlockRemoved), the store counts and drops it, and
nothing raises.

Blocks are first pushed to disk only (demoted, then evicted from CPU); one of them is damaged
behind the store's back (reliability.corrupt); then the rig loads it the way the connector
would: the lookup promotes it (a DISK -> CPU background read, which reports the damaged key
as failed) and misses; nothing damaged reaches the "GPU". The blocks outside the damaged
segment must still load byte-exact (promoted, then one CPU -> "GPU" job each).
"""

from __future__ import annotations

import pytest

from reliability.corrupt import CODECS, CORRUPTIONS, disk_only_rig, load_after_damage


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_damaged_record_is_a_failed_key_and_is_forgotten(tmp_path, corrupt, codec):
    rig, keys = disk_only_rig(tmp_path / "disk", codec)
    try:
        out = load_after_damage(rig, keys, corrupt)
    finally:
        rig.close()
    assert out.problems == ()
    assert out.failed_keys == 1 and out.wrong_blocks == 0 and out.survivors_loaded >= 2


def test_the_check_notices_an_undamaged_block(tmp_path):
    """If the 'damage' does nothing, the load succeeds and the check must say so."""
    rig, keys = disk_only_rig(tmp_path / "disk", "raw")
    try:
        out = load_after_damage(rig, keys, lambda store, victim, other: None)
    finally:
        rig.close()
    assert any("failed load keys" in p for p in out.problems)
