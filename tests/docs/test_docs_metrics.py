"""docs/events-and-metrics.md lists every Prometheus metric kvtier exports exactly once (and no
metric it does not export), and the Grafana dashboard in docs/grafana/ queries only metrics
that exist, under their names on the wire (a counter's ends in ``_total``)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from kvtier.observe.metrics.families import SPECS

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "events-and-metrics.md"
DASHBOARD = ROOT / "docs" / "grafana" / "kvtier.json"
METRIC = re.compile(r"\bkvtier_[a-z_]+\b")


def wire_names() -> set[str]:
    return {s.name + ("_total" if s.kind == "counter" else "") for s in SPECS}


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]


def unknown_metrics(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in METRIC.findall(e)} - wire_names()


def _generator():
    spec = importlib.util.spec_from_file_location("gen_metrics_doc",
                                                  ROOT / "scripts" / "gen_metrics_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_metrics_table_is_what_the_script_generates(tmp_path, capsys):
    gen = _generator()
    assert gen.main(["--check"]) == 0, "run python scripts/gen_metrics_doc.py"
    stale = tmp_path / "page.md"
    stale.write_text(PAGE.read_text().replace("| `kvtier_block_bytes` |", "| `kvtier_blocks` |"))
    assert gen.main(["--check", "--page", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err


def test_every_metric_documented_exactly_once():
    rows = re.findall(r"^\| `(kvtier_[a-z_]+)` \|", PAGE.read_text(), flags=re.M)
    assert sorted(rows) == sorted(wire_names())  # each once, none extra


def test_page_names_no_metric_that_does_not_exist():
    assert set(METRIC.findall(PAGE.read_text())) - wire_names() == set()


def test_dashboard_queries_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _exprs(dashboard)
    assert len(exprs) >= 15
    assert unknown_metrics(exprs) == set()
    used = {m for e in exprs for m in METRIC.findall(e)}
    for core in ("kvtier_hit_tokens_total", "kvtier_miss_tokens_total",
                 "kvtier_transfer_bytes_total", "kvtier_tier_used_bytes",
                 "kvtier_disk_degraded", "kvtier_remote_degraded"):
        assert core in used, core


def test_the_dashboard_check_catches_a_wrong_name():
    assert unknown_metrics(["rate(kvtier_hit_tokens[5m])"]) == {"kvtier_hit_tokens"}
    assert unknown_metrics(["kvtier_disk_degraded_total"]) == {"kvtier_disk_degraded_total"}


def test_dashboard_is_importable():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all('instance=~"$instance"' in t["expr"] for t in panel["targets"])
