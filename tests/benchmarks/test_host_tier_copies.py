"""benchmarks/host_tier_copies.py: two instances in turn, private CPU tiers against one host
tier (a real service): the host tier holds every block once and finds the other's blocks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import host_tier_copies  # noqa: E402


def test_the_host_tier_holds_each_block_once_and_hits_the_other_instances(capsys):
    assert host_tier_copies.main(["--requests", "120", "--cpu-mib", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    host, private = out["host"], out["private"]
    assert host["keys_held_twice"] == 0
    assert host["distinct_keys_held"] == host["blocks_held"] == host["host_published_blocks"]
    assert sum(host["of_them_the_other_instances"]) > 0
    assert sum(private["of_them_the_other_instances"]) == 0
    assert host["wrong_blocks"] == private["wrong_blocks"] == 0
