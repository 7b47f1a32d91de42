"""``kvtier host-tier``: an operator's look at the host tier's services (a real one)."""

from __future__ import annotations

import json
import os
import signal

from click.testing import CliRunner

from kvtier.cli.main import cli
from kvtier.tiers.host import HostAddress, HostClient


def test_host_tier_lists_the_pool_its_instances_and_their_hits(tmp_path):
    address = HostAddress(tmp_path / "host", "e" * 32, 32, idle_exit_s=30)
    a = HostClient.connect(address, "engine-a")
    b = HostClient.connect(address, "engine-b")
    pid = None
    try:
        base = a.register(8)
        b.register(8)
        os.close(a.attach(0, 4096))
        a.publish([b"k1", b"k2"], [base, base + 1])
        a.flush()  # publish gets no reply: applied by now
        b.release(b.acquire([b"k1"]))
        b.flush()
        runner = CliRunner()
        out = runner.invoke(cli, ["host-tier", "--dir", str(address.directory), "--json"])
        assert out.exit_code == 0, out.output
        stats = json.loads(out.output)
        pid = stats["pid"]
        assert stats["published_blocks"] == 2 and stats["total_slots"] == 32
        assert stats["pool_bytes"] == {"0": 32 * 4096}
        by_name = {i["name"]: i for i in stats["instances"]}
        assert by_name["engine-a"]["hits_given"] == 1 and by_name["engine-b"]["hits_taken"] == 1
        table = runner.invoke(cli, ["host-tier", "--dir", str(address.directory)])
        assert table.exit_code == 0
        assert "2 of 32 blocks published" in table.output and "engine-a" in table.output
    finally:
        a.close()
        b.close()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)


def test_host_tier_says_when_no_service_runs(tmp_path):
    out = CliRunner().invoke(cli, ["host-tier", "--dir", str(tmp_path)])
    assert out.exit_code == 1
    assert "no host tier service runs in" in out.output


def test_kvtier_stats_says_what_the_host_tier_gives_and_takes():
    from kvtier.cli.stats_cmd import host_line

    m = {"host_foreign_hit_blocks": 12, "host_store_skipped_held": 3, "host_evictions_held": 1}
    line = host_line({"instances": 2, "used_blocks": 40, "capacity_blocks": 100,
                      "hits_given": 7}, m)
    assert "2 instances" in line and "40 of 100 blocks" in line
    assert "hits on others' blocks 12" in line and "others' hits on this instance's 7" in line
    assert "stores skipped (held by another) 3" in line and "evictions held back 1" in line
    assert "DOWN" in host_line({}, m)  # the manager's usage is empty while the service is gone
