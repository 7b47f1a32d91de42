"""The connector timeline: marks kept in memory, written as JSON lines on flush, off by default."""

import json
import threading
import time

from kvtier.observe import timeline as tl_mod
from kvtier.observe.timeline import Timeline


def test_marks_are_written_in_order_on_flush(tmp_path):
    path = tmp_path / "tl.jsonl"
    tl = Timeline(str(path))
    tl.mark("sched", "lookup", req="r1", blocks=3)
    tl.mark("worker", "load_done", hops=[["CPU->GPU", 512, 0.5]])
    assert not path.exists()  # nothing written per mark
    tl.flush()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["ev"] for r in rows] == ["lookup", "load_done"]
    assert rows[0]["who"] == "sched" and rows[0]["req"] == "r1" and rows[0]["blocks"] == 3
    assert rows[1]["hops"] == [["CPU->GPU", 512, 0.5]]
    assert rows[0]["t"] <= rows[1]["t"]
    tl.mark("client", "done")
    tl.flush()  # appends, never rewrites
    assert [json.loads(x)["ev"] for x in path.read_text().splitlines()] == [
        "lookup", "load_done", "done"]


def test_full_buffer_flushes_and_threads_lose_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(tl_mod, "FLUSH_EVERY", 100)
    path = tmp_path / "tl.jsonl"
    tl = Timeline(str(path))

    def many(who):
        for i in range(1000):
            tl.mark(who, "e", i=i)

    threads = [threading.Thread(target=many, args=(f"w{k}",)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.exists()  # flushed on the way, before any explicit flush
    tl.flush()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 4000
    for k in range(4):
        assert [r["i"] for r in rows if r["who"] == f"w{k}"] == list(range(1000))


def test_off_without_a_path(tmp_path):
    tl = Timeline(None)
    assert not tl.enabled
    tl.mark("sched", "lookup")
    tl.flush()
    assert list(tmp_path.iterdir()) == []


def test_marks_older_than_a_second_are_written_with_the_next_mark(tmp_path, monkeypatch):
    """vLLM's engine processes under ``vllm serve`` end without exit handlers: with
    KVTIER_TIMELINE_FLUSH_S a timeline there does not hold its marks until exit."""
    monkeypatch.setattr(tl_mod, "FLUSH_AFTER_S", 0.05)
    path = tmp_path / "tl.jsonl"
    tl = Timeline(str(path))
    tl.mark("worker", "start_load")
    assert not path.exists()
    time.sleep(0.1)
    tl.mark("worker", "load_done")
    assert [json.loads(x)["ev"] for x in path.read_text().splitlines()] == [
        "start_load", "load_done"]


def test_without_the_age_setting_marks_wait_for_a_flush(tmp_path, monkeypatch):
    """Off by default: an in-process benchmark's timed requests never pay a write."""
    monkeypatch.setattr(tl_mod, "FLUSH_AFTER_S", None)
    path = tmp_path / "tl.jsonl"
    tl = Timeline(str(path))
    tl.mark("worker", "start_load")
    time.sleep(0.05)
    tl.mark("worker", "load_done")
    assert not path.exists()


def test_the_age_setting_accepts_seconds_and_ignores_nonsense():
    assert tl_mod._flush_after("1") == 1.0 and tl_mod._flush_after("0.25") == 0.25
    for bad in (None, "", "0", "-1", "soon", "nan"):
        assert tl_mod._flush_after(bad) is None
