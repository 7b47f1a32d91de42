"""benchmarks/remote_bandwidth.py against a real server: the shared tier's GB/s next to the raw
ceiling of plain client processes, measured in the same run, with no failed block and a share
the rows can be read by."""

from __future__ import annotations

from remote_bandwidth import tier_vs_ceiling

from kvtier.config import load_config
from support.valkey_fixtures import valkey  # noqa: F401 - pytest fixture


def test_tier_vs_ceiling_reports_both_and_their_share(valkey):
    server = valkey()
    cfg = load_config(data={"tiers": {"cpu": {"capacity": "64MiB"},
                                      "remote": {"url": server.url, "capacity": "1GiB"}}},
                      env={})
    row = tier_vs_ceiling(cfg, 64 << 10, clients=2, total_bytes=8 << 20, repeats=1)
    assert row["failed"] == 0 and min(row["gbps"].values()) > 0
    assert row["share"]["load"] > 0 and row["share"]["store"] > 0
