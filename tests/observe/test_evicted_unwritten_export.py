"""``evicted_unwritten`` (CPU blocks dropped before write-back reached them) reaches operators:
the Prometheus endpoint, ``kvtier stats`` (table and JSON) read from it, and the snapshot."""

from __future__ import annotations

import json
import os
import time

from click.testing import CliRunner

from kvtier.cli.main import cli
from kvtier.config.schema import MetricsConfig
from kvtier.manager.specs import Medium
from kvtier.manager.tiered import TieredOffloadingManager
from kvtier.observe.metrics import MetricsExporter, metric_families


def live_stats() -> dict:
    """A manager whose write-back is behind: stores outrun demotions that never finish."""
    m = TieredOffloadingManager(cpu_blocks=4, disk_blocks=64, flush_reserve=1,
                                max_demotions_in_flight=1)
    for i in range(6):
        plan = m.prepare_store([f"k{i}".encode()])
        m.complete_store(plan.keys)
    assert m.stats.evicted_unwritten > 0
    assert m.take_background_transfers()[0].dst.medium is Medium.DISK  # still in flight
    return {"manager": m.stats.snapshot(), "usage": m.usage(), "block_bytes": 4096}


def test_evicted_unwritten_is_a_prometheus_counter_and_in_kvtier_stats(tmp_path):
    stats = live_stats()
    n = stats["manager"]["evicted_unwritten"]
    names = {f.name for f in metric_families(stats)}
    assert "kvtier_evicted_unwritten" in names
    with MetricsExporter(MetricsConfig(port=0), lambda: stats) as ex:
        text = CliRunner().invoke(cli, ["stats", "--url", ex.url], catch_exceptions=False).output
        data = json.loads(CliRunner().invoke(cli, ["stats", "--json", "--url", ex.url],
                                             catch_exceptions=False).output)
    assert f"evicted before written to disk {n}" in text
    assert data["instance"]["manager"]["evicted_unwritten"] == n
    snap = tmp_path / "kvtier-stats.json"
    snap.write_text(json.dumps({"format": 1, "pid": os.getpid(), "written_at": time.time(), **stats}))
    out = CliRunner().invoke(cli, ["stats", "--snapshot", str(snap)], catch_exceptions=False).output
    assert f"evicted before written to disk {n}" in out

