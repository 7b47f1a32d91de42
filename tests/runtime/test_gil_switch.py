"""The worker runtime shortens Python's GIL switch interval while it runs, and puts the
previous value back when it closes (kvtier/runtime/gil.py says why: with vLLM's busy engine
loop beside them, each hand-off to a disk thread waited 5 ms, and under ``vllm serve`` the
engine core's own output thread waits the same way). Without a disk or shared tier it puts
Python's back while the engine is saturated, where the hand-offs cost the engine loop steps."""

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


def test_a_disk_tier_shortens_the_interval_until_the_runtime_closes(python_default, tmp_path):
    rt = _runtime({"tiers": {"cpu": {"capacity": "1MiB"},
                             "disk": {"path": str(tmp_path), "capacity": "4MiB"}}})
    assert sys.getswitchinterval() == pytest.approx(0.0002)  # the default, 0.2 ms
    rt.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_configured_interval_and_zero_leaves_python_alone(python_default, tmp_path):
    disk = {"path": str(tmp_path), "capacity": "4MiB"}
    rt = _runtime({"gil_switch_interval_ms": 1, "tiers": {"cpu": {"capacity": "1MiB"}, "disk": disk}})
    assert sys.getswitchinterval() == pytest.approx(0.001)
    rt.close()
    rt = _runtime({"gil_switch_interval_ms": 0, "tiers": {"cpu": {"capacity": "1MiB"}, "disk": disk}})
    assert sys.getswitchinterval() == pytest.approx(0.005)
    rt.close()


def test_a_cpu_only_runtime_shortens_it_too_and_zero_leaves_it(python_default):
    rt = _runtime({"tiers": {"cpu": {"capacity": "1MiB"}}})
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    rt.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    rt = _runtime({"gil_switch_interval_ms": 0, "tiers": {"cpu": {"capacity": "1MiB"}}})
    assert sys.getswitchinterval() == pytest.approx(0.005)
    rt.close()


def test_cpu_only_gives_the_interval_back_while_the_engine_is_saturated(python_default):
    rt = _runtime({"tiers": {"cpu": {"capacity": "1MiB"}}})
    seen = []
    for saturated in (False, True, True, False, True):
        rt.switch.engine_saturated(saturated)
        seen.append(round(sys.getswitchinterval() * 1000, 3))
    assert seen == [0.2, 5.0, 5.0, 0.2, 5.0]
    rt.close()  # closed while saturated: Python's stays
    assert sys.getswitchinterval() == pytest.approx(0.005)
    rt = _runtime({"tiers": {"cpu": {"capacity": "1MiB"}}})
    rt.switch.engine_saturated(False)
    rt.close()  # closed while short: Python's comes back
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_disk_tier_keeps_the_short_interval_when_saturated(python_default, tmp_path):
    rt = _runtime({"tiers": {"cpu": {"capacity": "1MiB"},
                             "disk": {"path": str(tmp_path), "capacity": "4MiB"}}})
    rt.switch.engine_saturated(True)
    assert rt.switch.lowered and sys.getswitchinterval() == pytest.approx(0.0002)
    rt.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_an_interval_never_applied_ignores_saturation(python_default):
    sys.setswitchinterval(0.0001)  # lower than kvtier's: left alone whatever the load
    s = SwitchInterval(0.2, steady=False)
    for saturated in (True, False):
        s.engine_saturated(saturated)
        assert not s.lowered and sys.getswitchinterval() == pytest.approx(0.0001)
    s.restore()
    assert sys.getswitchinterval() == pytest.approx(0.0001)


def test_never_raises_an_interval_set_lower_elsewhere(python_default):
    sys.setswitchinterval(0.0001)
    s = SwitchInterval(0.2)
    assert not s.applied and sys.getswitchinterval() == pytest.approx(0.0001)
    s.restore()
    assert sys.getswitchinterval() == pytest.approx(0.0001)


@pytest.mark.parametrize("bad", [-1, 6, "fast", True])
def test_bad_interval_is_a_config_error_naming_the_key(bad):
    with pytest.raises(ConfigError, match="gil_switch_interval_ms"):
        load_config(data={"gil_switch_interval_ms": bad})
    with pytest.raises(ValueError):
        SwitchInterval(-1)
