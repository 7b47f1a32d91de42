"""scripts/plot_serving.py draws goodput against rate from a serving.py results JSON: the
series are the file's goodput figures at the run's first SLO, each panel names the workload,
the GPU and the vLLM release, and without matplotlib the script exits 2 with a one-line
message naming what to install (no skip: both branches are checked)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "plot_serving.py"
RESULTS = ROOT / "benchmarks" / "results" / "serving_alone_NVIDIA-H200.json"


@pytest.fixture(scope="module")
def plot():
    spec = importlib.util.spec_from_file_location("plot_serving", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_series_are_the_committed_goodput_per_config_and_rate(plot):
    data = json.loads(RESULTS.read_text())
    run = data["runs"]["1b-cpu8GiB-ws2x"]
    slo, series = plot.goodput_series(run)
    assert slo == "500"
    assert list(series) == ["native", "kvtier_cpu", "kvtier_disk"]  # CONFIG_ORDER
    for name, points in series.items():
        rates = run["configs"][name]["rates"]
        assert points == sorted((float(r), rates[r]["goodput"]["500"]["rps"]) for r in rates)
    title = plot.panel_title("1b-cpu8GiB-ws2x", run, data["device"])
    assert "workload synthetic" in title and "NVIDIA H200" in title and "vLLM ?" in title


def test_a_title_names_the_recorded_workload_gpu_and_release(plot):
    setup = {"slos_ms": [250.0], "workload": {"name": "vllm-multiturn"},
             "gpu": "NVIDIA H100 80GB HBM3", "vllm": "0.34.0"}
    run = {"configs": {"none": {"setup": setup, "rates": {
        "2": {"goodput": {"250": {"rps": 1.5}}}, "1": {"goodput": {"250": {"rps": 1.0}}}}}}}
    assert plot.goodput_series(run) == ("250", {"none": [(1.0, 1.0), (2.0, 1.5)]})
    assert plot.panel_title("r", run, "other") == (
        "r\nworkload vllm-multiturn, NVIDIA H100 80GB HBM3, vLLM 0.34.0")


def test_draws_the_chart_or_says_what_is_missing(tmp_path):
    out = tmp_path / "goodput.svg"
    run = subprocess.run([sys.executable, str(SCRIPT), str(RESULTS), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    if importlib.util.find_spec("matplotlib") is None:
        assert run.returncode == 2 and not out.exists()
        assert run.stderr.count("\n") == 1
        assert "matplotlib is not installed" in run.stderr and "kvtier[plots]" in run.stderr
        return
    assert run.returncode == 0, run.stderr
    svg = out.read_text()
    ET.fromstring(svg)  # well-formed
    assert "kvtier_disk" in svg and "NVIDIA H200" in svg
