"""The shared tier's presence directory wakes its asker thread from the scheduler's ``query``;
that wake must not preempt the scheduler thread (``SCHED_BATCH`` on Linux)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from kvtier.config import load_config
from kvtier.tiers.remote import RemoteKeys, RemoteStore
from kvtier.tiers.remote.directory import RemoteDirectory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_BATCH is Linux's")
def test_the_asker_thread_never_preempts_the_scheduler_on_wakeup():
    cfg = load_config(data={"tiers": {"remote": {"url": "redis://127.0.0.1:1"}}}, env={}).remote
    store = RemoteStore(cfg, RemoteKeys("ns", "geo"))
    directory = RemoteDirectory(store)
    try:
        deadline = time.monotonic() + 10
        policy = None
        while time.monotonic() < deadline:  # the asker sets its policy as it starts
            policy = os.sched_getscheduler(directory._asker.native_id)
            if policy == os.SCHED_BATCH:
                break
            time.sleep(0.01)
        assert policy == os.SCHED_BATCH
        assert os.sched_getscheduler(0) != os.SCHED_BATCH  # only that thread, not the caller
    finally:
        directory.close()
        store.close()
