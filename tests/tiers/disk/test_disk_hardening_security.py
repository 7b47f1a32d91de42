"""Disk tier hardening (issue 14): the single-owner lock, path attacks and odd files.

* The lock is on the directory itself: unlinking a lock file under a running store does not
  let a second process in; processes racing to create one store get "busy", never
  FileExistsError.
* A symlinked store path and parents another user could change are refused; a tree swapped
  after start-up does not redirect the store's writes (everything is opened relative to
  directory descriptors).
* A FIFO or a directory in a segment's place is a miss (never a hang, never an exception);
  a removed ``segments/`` directory does not break ``stats()``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap

import pytest

from kvtier.tiers.disk import DiskStore, DiskStoreBusy, UnsafeDiskDirectory
from test_disk_hardening import GEO, PRELUDE, REC, ROOT, block, key, run_py


def _holder(path) -> subprocess.Popen:
    """Another process holding the store open until its stdin closes."""
    code = PRELUDE + textwrap.dedent("""
        with DiskStore(sys.argv[1], GEO) as s:
            s.put_many([(key(1), block(key(1)))])
            print("ready", flush=True)
            sys.stdin.read()
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    p = subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=ROOT, env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_unlinked_lock_file_does_not_let_a_second_store_in(tmp_path):
    path = tmp_path / "d"
    holder = _holder(path)
    try:
        for name in ("LOCK", "lock"):  # whatever lock file there may be
            if (path / name).exists():
                os.unlink(path / name)
        with pytest.raises(DiskStoreBusy, match=str(path)):
            DiskStore(path, GEO)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    with DiskStore(path, GEO) as s:  # released with the process
        assert s.get(key(1)) == block(key(1))


def _race(path, barrier, out) -> None:
    barrier.wait()
    try:
        with DiskStore(path, GEO):
            out.put("opened")
            barrier.wait()  # hold it until everyone has tried
    except DiskStoreBusy:
        out.put("busy")
        barrier.wait()
    except BaseException as exc:  # noqa: BLE001 (reported to the test)
        out.put(f"{type(exc).__name__}: {exc}")
        barrier.wait()


def test_processes_racing_to_create_a_store_get_busy_not_file_exists(tmp_path):
    ctx = mp.get_context("fork")
    results = []
    for rnd in range(25):
        path = tmp_path / f"a{rnd}" / "b" / "store"
        barrier, out = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_race, args=(path, barrier, out)) for _ in range(4)]
        for p in procs:
            p.start()
        got = sorted(out.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        results.append(got)
    for got in results:
        assert got.count("opened") == 1 and got.count("busy") == 3, got


# -- paths another user could change -------------------------------------------------------

def test_symlinked_store_path_is_refused(tmp_path):
    real = tmp_path / "real"
    with DiskStore(real, GEO):
        pass
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UnsafeDiskDirectory, match="symbolic link"):
        DiskStore(tmp_path / "link", GEO)


def test_world_writable_parent_without_sticky_bit_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeDiskDirectory, match=f"parent {shared} is world-writable"):
        DiskStore(shared / "mine" / "store", GEO)
    assert os.listdir(shared) == []  # refused before creating anything
    os.chmod(shared, 0o1777)  # sticky (like /tmp): others cannot replace our entries
    with DiskStore(shared / "mine" / "store", GEO):
        pass


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_parent_or_link_owned_by_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UnsafeDiskDirectory, match=rf"parent {theirs} is owned by uid 65534"):
        DiskStore(theirs / "store", GEO)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "via"
    link.symlink_to(mine)
    os.lchown(link, 65534, 65534)  # the attacker could re-point it
    with pytest.raises(UnsafeDiskDirectory, match="owned by uid 65534"):
        DiskStore(link / "store", GEO)


def test_tree_swapped_after_start_does_not_redirect_writes(tmp_path):
    path = tmp_path / "d"
    with DiskStore(path, GEO, segment_bytes=2 * REC) as s:
        s.put_many([(key(i), block(key(i))) for i in range(2)])
        moved = tmp_path / "moved"
        os.rename(path, moved)  # the attacker's tree takes the store's place
        (path / "segments").mkdir(parents=True)
        (path / "index.lmdb").mkdir()
        s.put_many([(key(i), block(key(i))) for i in range(2, 12)])  # several new segments
        assert os.listdir(path / "segments") == []
        assert all(s.get(key(i)) == block(key(i)) for i in range(12))
    assert len(os.listdir(moved / "segments")) >= 5
    with DiskStore(moved, GEO) as s:
        assert all(s.get(key(i)) == block(key(i)) for i in range(12))


# -- odd files under segment names ----------------------------------------------------------

def _sealed_segment_of_first_key(path):
    with DiskStore(path, GEO, segment_bytes=2 * REC, compact_budget_bytes=0) as s:
        s.put_many([(key(i), block(key(i))) for i in range(6)])
        seg = s._index.get(key(0)).segment
        assert seg != s._files.active_id
    return path / "segments" / f"{seg:08d}.seg"


def test_fifo_in_place_of_a_segment_is_a_miss_not_a_hang(tmp_path):
    path = tmp_path / "d"
    seg = _sealed_segment_of_first_key(path)
    os.unlink(seg)
    os.mkfifo(seg, 0o600)
    r = run_py("""
        with DiskStore(sys.argv[1], GEO, segment_bytes=2 * REC) as s:
            print(s.get(key(0)) is None, s.get(key(5)) == block(key(5)))
    """, str(path), timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "True"]


def test_directory_in_place_of_a_segment_is_a_miss(tmp_path):
    path = tmp_path / "d"
    seg = _sealed_segment_of_first_key(path)
    os.unlink(seg)
    os.mkdir(seg, 0o700)
    with DiskStore(path, GEO, segment_bytes=2 * REC) as s:
        same = [k for k in map(key, range(6)) if s._index.get(k).segment == s._index.get(
            key(0)).segment]
        assert len(same) == 2  # every record of that segment turns out bad
        assert all(s.get(k) is None and not s.contains(k) for k in same)
        assert s.get(key(5)) == block(key(5))
        s.put_many([(key(i), block(key(i))) for i in range(10, 16)])
        assert s.stats().num_blocks == 10
    with DiskStore(path, GEO, segment_bytes=2 * REC) as s:  # and it opens again
        assert all(s.get(key(i)) == block(key(i)) for i in range(10, 16))
    assert seg.is_dir()  # never removed recursively: it is not ours


def test_removed_segments_directory_does_not_break_stats(tmp_path):
    path = tmp_path / "d"
    with DiskStore(path, GEO, segment_bytes=2 * REC) as s:
        s.put_many([(key(i), block(key(i))) for i in range(4)])
        for f in os.listdir(path / "segments"):
            os.unlink(path / "segments" / f)
        os.rmdir(path / "segments")
        st = s.stats()
        assert st.num_blocks == 4 and st.segments == 0
        assert s.get(key(0)) is None
    assert DiskStore.read_stats(path).segments == 0
