"""scripts/plot_results.py draws the docs' charts from the committed results JSON: the series
it plots are the numbers in those files, it writes both charts when matplotlib is there, and
without matplotlib it exits 2 with a one-line message naming what to install."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "plot_results.py"


@pytest.fixture(scope="module")
def plot():
    spec = importlib.util.spec_from_file_location("plot_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["plot_results"] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("plot_results", None)


def test_ttft_series_are_the_committed_medians(plot):
    e2e = json.loads(plot.E2E.read_text())
    first, next_turn = plot.ttft_panels(e2e)
    runs = e2e["session_18"]["runs"]
    n8 = runs["n8h100"]["result"]["ttft_ms"]["8192"]
    assert (8192, n8["kvtier_cpu"]) in first.series["kvtier"]
    assert (8192, n8["native_cpu"]) in first.series["native"]
    assert (8192, n8["kvtier_recompute"]) in first.series["recompute"]
    assert [p[0] for p in first.series["kvtier"]] == [16, 1024, 2048, 8192, 32768]
    assert [p[0] for p in next_turn.series["native"]] == [2048, 8192, 32768]
    assert first.gpu == "NVIDIA H100 80GB HBM3" and first.vllm == "0.32.0"


def test_a_panel_mixing_cards_is_refused(plot):
    e2e = json.loads(plot.E2E.read_text())
    e2e["session_18"]["runs"]["n8h100"]["gpu"] = "NVIDIA H200"
    with pytest.raises(ValueError, match="one card"):
        plot.ttft_panels(e2e)


def test_hit_rates_are_the_committed_rows(plot):
    for path in plot.COMPARE:
        compare = json.loads(path.read_text())
        rates = plot.hit_rates(compare)
        assert set(rates) == set(plot.POLICIES)
        for row in compare["rows"]:
            if row["policy"] in rates:
                assert (row["capacity"], 100 * row["hit_rate"]) in rates[row["policy"]]


def _matplotlib_importable() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def test_draws_both_charts_or_says_what_is_missing(tmp_path):
    """With matplotlib: both SVGs from the committed JSON. Without: status 2 and the message."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    if not _matplotlib_importable():
        assert run.returncode == 2
        assert "matplotlib is not installed" in run.stderr
        assert "kvtier[plots]" in run.stderr
        return
    assert run.returncode == 0, run.stderr
    for name, title in (("ttft_vs_prompt.svg", "First turn"),
                        ("hit_rate_vs_capacity.svg", "lru+reuse_gate (recommended)")):
        svg = (tmp_path / name).read_text()
        ET.fromstring(svg)  # well-formed
        assert title in svg


def test_without_matplotlib_exits_2_with_a_clear_message(tmp_path):
    """Runs whether or not matplotlib is installed: the import is made to fail."""
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['plot_results.py', '--out', {str(tmp_path)!r}]; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip() == ("plot_results: matplotlib is not installed; install it with "
                                  "pip install 'kvtier[plots]' (or pip install matplotlib)")
    assert not list(tmp_path.iterdir())


def test_committed_charts_exist():
    for name in ("ttft_vs_prompt.svg", "hit_rate_vs_capacity.svg"):
        ET.fromstring((ROOT / "docs" / "img" / name).read_text())
