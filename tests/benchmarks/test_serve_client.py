"""``benchmarks/serve_client.Server``'s lifecycle without vLLM: a server whose leader dies while
starting is reported with its log, and stopping it leaves none of its process group behind
(vLLM's engine core outlives a crashed API server otherwise, holding the GPU)."""

from __future__ import annotations

import time

import pytest


import serve_client


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def test_a_leader_that_dies_starting_is_reported_and_its_group_is_stopped(tmp_path, monkeypatch):
    # the leader leaves a child in its group (as the API server leaves its engine core)
    monkeypatch.setattr(serve_client, "serve_command", lambda model, args: [
        "sh", "-c", "sleep 300 & echo child $!; echo 'engine failed: out of memory'; exit 3"])
    server = serve_client.Server("kvtier", "model", [], 1, str(tmp_path / "log"))
    with pytest.raises(RuntimeError, match=r"exited with 3(.|\n)*engine failed: out of memory"):
        server.start(timeout_s=30)
    child = int(open(tmp_path / "log").read().split("child ")[1].split()[0])
    assert _alive(child)
    server.stop()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
