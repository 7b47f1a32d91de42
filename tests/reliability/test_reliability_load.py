"""Load: many concurrent loads and stores of overlapping keys through the transfer engine and
a real disk store; nothing wrong served, nothing leaked, resident memory flat.

The CI variant is short (a few thousand requests); ``--runslow`` soaks for
``KVTIER_SOAK_SECONDS`` (default 1800 s) and holds RSS growth after warm-up under 16 MiB.
"""

from __future__ import annotations

import logging
import os

import pytest

from reliability.rig import StackRig
from reliability.soak import run_soak


@pytest.fixture
def rig(tmp_path):
    logging.disable(logging.WARNING)
    r = StackRig(tmp_path / "disk", cpu_blocks=32, disk_blocks=160, gpu_blocks=256,
                 segment_bytes=64 * 2120, compression="zstd", compressible=True, disk_write_jobs=2)
    yield r
    r.close()
    logging.disable(logging.NOTSET)


def _assert_sound(rig: StackRig, result) -> None:
    c = rig.c
    assert c.wrong_blocks == 0
    assert c.failed_load_blocks == 0 and not c.failed_jobs, (c.failed_load_blocks, c.failed_jobs)
    assert rig.leaks() == dict.fromkeys(rig.leaks(), 0)
    st = rig.store.stats()
    assert st.checksum_failures == st.read_errors == st.write_errors == 0
    assert rig.manager.stats.protocol_errors == 0
    # the load really was concurrent and really went through every tier and route
    assert result.max_jobs_in_flight >= 6
    assert c.loaded_blocks["CPU"] > 0 and c.loaded_blocks["DISK"] > 0
    assert c.promoted_blocks >= c.loaded_blocks["DISK"]  # disk hits were promoted, then loaded
    routes = rig.engine.stats()
    assert all(routes[r].jobs > 0 for r in ("GPU->CPU", "CPU->GPU", "CPU->DISK", "DISK->CPU",
                                            "DISK->DROP")), routes


def test_concurrent_overlapping_requests(rig):
    result = run_soak(rig, requests=2500, seed=3, max_in_flight=10, sample_every=100)
    _assert_sound(rig, result)
    assert rig.store.stats().reclaimed_bytes > 0  # evictions became deletions, space came back


@pytest.mark.slow
def test_soak_memory_stays_flat(rig):
    seconds = float(os.environ.get("KVTIER_SOAK_SECONDS", "1800"))
    result = run_soak(rig, seconds=seconds, seed=4, max_in_flight=10, sample_every=500)
    _assert_sound(rig, result)
    growth = result.growth_after_warmup()
    assert growth < 16 << 20, f"RSS grew {growth / 2**20:.1f} MiB after warm-up"
