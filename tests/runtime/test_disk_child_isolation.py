"""Issue 36.1: the disk I/O child maps the whole CPU pool, so a module planted where the server
was started from (the current directory, PYTHONPATH) must never be imported by it.

A ``json.py`` (the child imports json before anything else of its own) that writes a marker file
sits in the working directory and in a PYTHONPATH directory; the child must start, serve a
block byte-exact, and the marker must not exist.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config.schema import DiskTierConfig
from kvtier.tiers.disk.io.process import DiskProcess
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.layout import BlockGeometry

GEO = BlockGeometry(num_layers=1, kv_parts=2, engine_blocks_per_block=1, page_bytes=512,
                    dtype="uint8", model="isolation-test")
PLANTED = """\
import pathlib
pathlib.Path({marker!r}).write_text("imported by " + __name__)
raise ImportError("planted module")
"""


def _plant(where: Path, marker: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    for name in ("json.py", "lmdb.py", "socket.py", "mmap.py"):
        (where / name).write_text(PLANTED.format(marker=str(marker)))


@pytest.mark.parametrize("how", ["cwd", "pythonpath"])
def test_a_module_planted_beside_the_server_is_not_imported_by_the_disk_child(
        tmp_path, monkeypatch, how):
    marker = tmp_path / "pwned"
    planted = tmp_path / "planted"
    _plant(planted, marker)
    if how == "cwd":
        monkeypatch.chdir(planted)
    else:
        monkeypatch.setenv("PYTHONPATH", str(planted))
    pool = CpuBlockPool(GEO, 4, pin=False, shared=True)
    proc = DiskProcess(pool, DiskTierConfig(path=tmp_path / "disk", capacity=1 << 26), GEO,
                       connections=1)
    try:
        pool.slot(0).fill_(7)
        proc.put_slots([0], [b"k" * 32])
        pool.slot(1).zero_()
        failed, transient = proc.fetch_slots([b"k" * 32], [1])
        assert (failed, transient) == ([], [])
        assert bytes(pool.slot(1).numpy()) == b"\x07" * GEO.block_bytes
    finally:
        proc.close()
    assert not marker.exists(), marker.read_text()


def test_a_relative_store_path_means_the_same_directory_in_the_child(tmp_path, monkeypatch):
    """The child runs in a fixed directory, so a relative path is made absolute first."""
    monkeypatch.chdir(tmp_path)
    pool = CpuBlockPool(GEO, 2, pin=False, shared=True)
    proc = DiskProcess(pool, DiskTierConfig(path=Path("rel-disk"), capacity=1 << 26), GEO,
                       connections=1)
    try:
        proc.put_slots([0], [b"r" * 32])
        assert proc.stats().num_blocks == 1
    finally:
        proc.close()
    assert (tmp_path / "rel-disk" / "index.lmdb").is_dir()
