"""The worker runtime shortens Python's GIL switch interval while a load waits on its I/O
threads (disk; a shared tier: always), and puts the previous value back when the last such
load ended or it closes (kvtier/runtime/gil.py says why: with vLLM's busy engine loop beside
them each hand-off to a disk thread waited 5 ms, while a short interval all the time slowed
the engine thread whenever write-back was busy)."""

from __future__ import annotations

import sys

import pytest
import torch

from kvtier.config import ConfigError, load_config
from kvtier.runtime.gil import SwitchInterval
from kvtier.runtime.worker import WorkerRuntime
from kvtier.tiers.gpu_view import GpuKvView


@pytest.fixture
def python_default():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def _runtime(data: dict) -> WorkerRuntime:
    view = GpuKvView({f"l{i}": torch.zeros(8, 1, 128) for i in range(2)}, "block_pages")
    return WorkerRuntime.create(load_config(data=data), view, view.geometry(1))


def test_a_disk_tier_shortens_the_interval_only_while_a_load_waits_on_it(python_default,
                                                                        tmp_path):
    rt = _runtime({"tiers": {"cpu": {"capacity": "1MiB"},
                             "disk": {"path": str(tmp_path), "capacity": "4MiB"}}})
    assert sys.getswitchinterval() == pytest.approx(0.005)  # write-back alone: Python's own
    rt.io_wait(7, True)
    assert sys.getswitchinterval() == pytest.approx(0.0002)  # the default, 0.2 ms
    rt.io_wait(8, True)
    rt.io_wait(7, False)
    assert sys.getswitchinterval() == pytest.approx(0.0002)  # load 8 still waits
    rt.io_wait(8, False)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    rt.io_wait(9, True)
    rt.close()  # a load still in flight at close: put back all the same
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_shared_tier_keeps_the_interval_short_until_close(python_default):
    rt = _runtime({"tiers": {"cpu": {"capacity": "1MiB"},  # connects lazily: never here
                             "remote": {"url": "redis://127.0.0.1:1/0"}}})
    assert sys.getswitchinterval() == pytest.approx(0.0002)  # its lookups run any time
    rt.io_wait(1, True)
    rt.io_wait(1, False)
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    rt.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_configured_interval_and_zero_leaves_python_alone(python_default, tmp_path):
    disk = {"path": str(tmp_path), "capacity": "4MiB"}
    rt = _runtime({"gil_switch_interval_ms": 1, "tiers": {"cpu": {"capacity": "1MiB"}, "disk": disk}})
    rt.io_wait(1, True)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    rt.close()
    rt = _runtime({"gil_switch_interval_ms": 0, "tiers": {"cpu": {"capacity": "1MiB"}, "disk": disk}})
    rt.io_wait(1, True)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    rt.close()


def test_cpu_only_runtime_leaves_the_interval_alone(python_default):
    rt = _runtime({"tiers": {"cpu": {"capacity": "1MiB"}}})
    assert sys.getswitchinterval() == pytest.approx(0.005)
    rt.close()


def test_never_raises_an_interval_set_lower_elsewhere(python_default):
    sys.setswitchinterval(0.0001)
    s = SwitchInterval(0.2)
    assert not s.applied and sys.getswitchinterval() == pytest.approx(0.0001)
    s.hold(1)
    s.release(1)
    assert sys.getswitchinterval() == pytest.approx(0.0001)
    s.restore()
    assert sys.getswitchinterval() == pytest.approx(0.0001)


@pytest.mark.parametrize("bad", [-1, 6, "fast", True])
def test_bad_interval_is_a_config_error_naming_the_key(bad):
    with pytest.raises(ConfigError, match="gil_switch_interval_ms"):
        load_config(data={"gil_switch_interval_ms": bad})
    with pytest.raises(ValueError):
        SwitchInterval(-1)
