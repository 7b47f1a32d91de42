"""Prometheus metrics, ``kvtier stats`` against a running instance, and the whole path: a
workload in one process, scrapes, ``kvtier stats`` and an event consumer in others."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli.main import cli
from kvtier.config import ConfigError, load_config
from kvtier.config.schema import MetricsConfig
from kvtier.observe.events import EventSubscriber
from kvtier.observe.metrics import SPECS, MetricsExporter, ScrapeError, metric_families, parse, scrape
from kvtier.observe.metrics.families import enrich

ROOT = Path(__file__).resolve().parents[2]

STATS = {
    "manager": {"lookups": 7, "lookup_blocks": 40, "hit_blocks": {"CPU": 5, "DISK": 3},
                "stored_blocks": {"CPU": 20, "DISK": 9}, "evicted_blocks": {"CPU": 11, "DISK": 2},
                "admission_rejected": {"CPU": 1, "DISK": 4}, "store_skipped_no_space": 0,
                "load_truncated_no_space": 0, "failed_loads": 1, "failed_stores": {"CPU": 0, "DISK": 2},
                "protocol_errors": 0},
    "usage": {"CPU": {"used_blocks": 6, "capacity_blocks": 8}, "DISK": {"used_blocks": 9, "capacity_blocks": 32}},
    "transfers": {"GPU->CPU": {"jobs": 4, "failed_jobs": 0, "bytes": 81920, "seconds": 0.25, "gbps": 0.0},
                  "DISK->CPU": {"jobs": 2, "failed_jobs": 1, "bytes": 4096, "seconds": 0.5, "gbps": 0.0}},
    "block_bytes": 4096,
    "requests": {"hit_blocks": {"GPU": 10, "CPU": 5, "DISK": 3}, "hit_tokens": {"GPU": 160, "CPU": 80, "DISK": 40},
                 "miss_blocks": 22, "miss_tokens": 350},
    "disk": {"logical_bytes": 36864, "stored_bytes": 12288, "file_bytes": 20000, "compression_ratio": 3.0,
             "checksum_failures": 2, "read_errors": 0, "write_errors": 0, "num_blocks": 9},
    "events": {"batches": 12, "events": 30, "access_events": 4, "dropped_events": 5, "resyncs": 1,
               "replay_requests": 2, "replay_gaps": 0, "endpoint": "tcp://127.0.0.1:1"},
}


def text_of(stats: dict) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    class One:
        def collect(self):
            return metric_families(stats)

    reg = CollectorRegistry(auto_describe=False)
    reg.register(One())
    return generate_latest(reg).decode()


# -- config --------------------------------------------------------------------------------------


def test_metrics_config(tmp_path):
    assert load_config(env={}).metrics is None
    assert load_config(text="metrics: {}\n", env={}).metrics == MetricsConfig(9400, "127.0.0.1")
    m = load_config(text="metrics: {port: 0, host: 0.0.0.0}\n", env={}).metrics
    assert (m.port, m.host) == (0, "0.0.0.0")
    m = load_config(env={"KVTIER_METRICS_PORT": "9555"}).metrics
    assert (m.port, m.host) == (9555, "127.0.0.1")
    assert load_config(env={"KVTIER_METRICS_HOST": "::1"}).metrics.host == "::1"


@pytest.mark.parametrize("text, line, key, fragment", [
    ("metrics:\n  port: 70000\n", 2, "metrics.port", "out of range"),
    ("metrics:\n  port: -1\n", 2, "metrics.port", "out of range"),
    ("metrics:\n  port: '9400'\n", 2, "metrics.port", "must be an integer"),
    ("metrics:\n  host: ''\n", 2, "metrics.host", "not a host name"),
    ("metrics:\n  host: 'http://x'\n", 2, "metrics.host", "not a host name"),
    ("metrics:\n  host: 5\n", 2, "metrics.host", "must be a string"),
    ("metrics:\n  prot: 1\n", 2, "metrics.prot", "did you mean 'port'"),
])
def test_bad_metrics_config_cites_line_and_key(tmp_path, text, line, key, fragment):
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert (info.value.line, info.value.key) == (line, key) and fragment in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(env={"KVTIER_METRICS_PORT": "many"})
    assert info.value.key == "KVTIER_METRICS_PORT"


# -- the metric table ----------------------------------------------------------------------------


def test_every_metric_the_issue_asks_for_is_exported_with_the_prefix():
    text = text_of(STATS)
    for line in [
        'kvtier_hit_blocks_total{tier="GPU"} 10.0', 'kvtier_hit_blocks_total{tier="DISK"} 3.0',
        'kvtier_hit_tokens_total{tier="CPU"} 80.0', "kvtier_miss_blocks_total 22.0",
        "kvtier_miss_tokens_total 350.0",
        'kvtier_transfer_bytes_total{direction="GPU->CPU"} 81920.0',
        'kvtier_transfer_seconds_total{direction="DISK->CPU"} 0.5',
        'kvtier_tier_used_bytes{tier="CPU"} 24576.0', 'kvtier_tier_capacity_bytes{tier="DISK"} 131072.0',
        'kvtier_tier_used_bytes{tier="DISK"} 36864.0',  # the disk tier's own count
        'kvtier_evictions_total{tier="CPU"} 11.0', 'kvtier_admission_rejections_total{tier="DISK"} 4.0',
        "kvtier_checksum_failures_total 2.0", 'kvtier_failed_jobs_total{direction="DISK->CPU"} 1.0',
        "kvtier_event_drops_total 5.0", "kvtier_disk_compression_ratio 3.0",
    ]:
        assert line in text.splitlines(), line
    names = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert names and all(n.startswith("kvtier_") for n in names)


def test_parse_inverts_the_export():
    back = parse(text_of(STATS))
    want = enrich(json.loads(json.dumps(STATS)))
    for section in ("manager", "requests", "disk"):
        for key, value in back[section].items():
            assert value == want[section][key], (section, key)
    assert back["usage"] == want["usage"]
    for direction, t in back["transfers"].items():
        assert {k: t[k] for k in ("jobs", "failed_jobs", "bytes", "seconds")} == {
            k: want["transfers"][direction][k] for k in ("jobs", "failed_jobs", "bytes", "seconds")}
    assert back["events"]["dropped_events"] == 5 and back["block_bytes"] == 4096
    assert set(back) <= {s.path.split(".")[0] for s in SPECS}


def test_missing_sections_and_junk_values_are_left_out():
    text = text_of({"manager": {"lookups": 1, "hit_blocks": {"CPU": True, "DISK": float("nan")}},
                    "usage": "nonsense"})
    assert "kvtier_lookups_total 1.0" in text and "hit_blocks" not in text and "tier_used" not in text
    assert parse("# nothing\nother_metric 1\n") == {}
    with pytest.raises(ScrapeError):
        parse("kvtier_lookups_total{ 1\n")


# -- exporter and scrapes ------------------------------------------------------------------------


def test_exporter_serves_live_values_and_survives_a_failing_source():
    state = {"stats": {"manager": {"lookups": 1}}, "fail": False}

    def source():
        if state["fail"]:
            raise RuntimeError("collect failed")
        return state["stats"]

    with MetricsExporter(MetricsConfig(port=0), source) as ex:
        assert ex.url == f"http://127.0.0.1:{ex.port}/metrics"
        assert scrape(ex.url)["manager"]["lookups"] == 1
        state["stats"] = {"manager": {"lookups": 5}}
        assert scrape(ex.url)["manager"]["lookups"] == 5  # read at scrape time, not cached
        state["fail"] = True
        assert scrape(ex.url) == {}
        state["fail"] = False
        assert scrape(ex.url)["manager"]["lookups"] == 5


def test_exporter_port_in_use_and_bad_urls():
    with MetricsExporter(MetricsConfig(port=0), dict) as ex:
        with pytest.raises(OSError, match="cannot listen"):
            MetricsExporter(MetricsConfig(port=ex.port), dict)
    with pytest.raises(ScrapeError, match="not an http"):
        scrape("file:///etc/passwd")
    with pytest.raises(ScrapeError, match="cannot fetch"):
        scrape(f"http://127.0.0.1:{ex.port}/metrics", timeout=2)  # closed now
    res = CliRunner().invoke(cli, ["stats", "--url", f"http://127.0.0.1:{ex.port}/metrics"])
    assert res.exit_code == 2 and "cannot fetch" in res.output


def test_stats_cli_reads_a_url_and_a_snapshot_file(tmp_path):
    with MetricsExporter(MetricsConfig(port=0), lambda: STATS) as ex:
        res = CliRunner().invoke(cli, ["stats", "--json", "--url", ex.url], catch_exceptions=False)
        table = CliRunner().invoke(cli, ["stats", "--url", ex.url], catch_exceptions=False)
    data = json.loads(res.output)
    cpu, disk, gpu = data["tiers"]["CPU"], data["tiers"]["DISK"], data["tiers"]["GPU"]
    assert (gpu["block_hit_rate"], cpu["block_hit_rate"]) == (0.25, 0.125)  # of 40 blocks
    assert cpu["token_hit_rate"] == round(80 / 630, 4)
    assert (cpu["used_bytes"], cpu["capacity_bytes"]) == (6 * 4096, 8 * 4096)
    assert disk["compression_ratio"] == 3.0
    assert data["transfers"]["GPU->CPU"]["gbps"] == pytest.approx(81920 / 0.25 / 1e9)
    assert data["instance"]["live"] is True
    for word in ("GPU", "CPU", "DISK", "12.5%", "GB/s", "3.000", "checksum failures 2"):
        assert word in table.output, word
    snap = tmp_path / "s.json"
    snap.write_text(json.dumps({"format": 1, "pid": os.getpid(), "written_at": 1e12, **STATS}))
    res = CliRunner().invoke(cli, ["stats", "--json", "--snapshot", str(snap), "--watch",
                                   "--interval", "0.1", "--count", "2"], catch_exceptions=False)
    lines = [json.loads(x) for x in res.output.splitlines()]
    assert len(lines) == 2 and lines[1]["tiers"]["CPU"]["block_hit_rate"] == 0.125
    bad = CliRunner().invoke(cli, ["stats", "--snapshot", str(tmp_path / "none.json")])
    assert bad.exit_code == 2 and "no readable kvtier stats snapshot" in bad.output


# -- the whole path: a running instance in another process ---------------------------------------

WORKLOAD = textwrap.dedent("""
    import json, sys
    from kvtier.bench.replay import Replay
    from kvtier.bench.trace import load_trace
    from kvtier.config import load_config
    from kvtier.observe.events import resident_blocks

    config = load_config(sys.argv[1])
    trace = load_trace(None, 120)
    replay = Replay(config, 16 * 1024, max(64, 2 * max(len(r.hash_ids) for r in trace)))
    replay.run(trace)
    replay.events.pump()
    assert replay.events.publisher.flush()
    replay.snapshot.write_now()
    pub = replay.events.publisher
    names = {"CPU": "CPU", "DISK": "STORAGE"}
    resident = {names[m.value]: sorted(k.hex() for k in keys)
                for m, keys in resident_blocks(replay.manager).items() if keys}
    print(json.dumps({"report": replay.report(), "metrics_url": replay.metrics.url,
                      "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                      "resident": resident}, default=str), flush=True)
    sys.stdin.read()  # keep running (and serving) until the test closes stdin
    replay.close()
""")


def load_example():
    spec = importlib.util.spec_from_file_location("block_index_consumer",
                                                  ROOT / "examples" / "block_index_consumer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kvtier_cli(*args: str) -> dict | list:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    return lines[0] if len(lines) == 1 else lines


@pytest.fixture
def instance(tmp_path):
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(textwrap.dedent(f"""
        tiers:
          cpu: {{capacity: 2MiB}}
          disk: {{path: {tmp_path / 'disk'}, capacity: 8MiB, compression: zstd}}
        events: {{endpoint: "tcp://127.0.0.1:0", replay_endpoint: "tcp://127.0.0.1:0"}}
        metrics: {{port: 0}}
        stats: {{interval_s: 0.2}}
    """))
    script = tmp_path / "workload.py"
    script.write_text(WORKLOAD)
    proc = subprocess.Popen([sys.executable, str(script), str(cfg)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        yield cfg, json.loads(line)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read()


def test_running_instance_metrics_stats_and_events_agree_with_the_workload(instance):
    cfg, ready = instance
    report = ready["report"]
    assert report["wrong_blocks"] == 0 and report["blocks"]["DISK"] > 0 and report["blocks"]["CPU"] > 0

    # a Prometheus scrape, from this process
    text = urllib.request.urlopen(ready["metrics_url"], timeout=10).read().decode()
    for tier in ("GPU", "CPU", "DISK"):
        assert f'kvtier_hit_blocks_total{{tier="{tier}"}} {float(report["blocks"][tier])}' in text
        assert f'kvtier_hit_tokens_total{{tier="{tier}"}} {float(report["tokens"][tier])}' in text
    assert f'kvtier_miss_tokens_total {float(report["tokens"]["MISS"])}' in text
    got = parse(text)
    assert got["manager"]["evicted_blocks"] == report["manager"]["evicted_blocks"]
    assert got["manager"]["hit_blocks"] == report["manager"]["hit_blocks"]
    for direction, t in report["transfers"].items():
        assert got["transfers"][direction]["bytes"] == t["bytes"], direction
        assert got["transfers"][direction]["jobs"] == t["jobs"], direction
    assert got["usage"]["CPU"]["used_blocks"] == report["usage"]["CPU"]["used_blocks"]
    assert got["usage"]["CPU"]["capacity_bytes"] == 2 << 20
    assert got["disk"]["checksum_failures"] == 0
    assert got["disk"]["compression_ratio"] == pytest.approx(report["disk"]["compression_ratio"])
    assert got["events"]["dropped_events"] == 0 and got["events"]["batches"] > 0

    # kvtier stats in other processes: through the metrics endpoint, and through the snapshot
    by_url = kvtier_cli("stats", "--json", "--url", ready["metrics_url"])
    by_snapshot = kvtier_cli("stats", "--json", "--config", str(cfg))
    for data in (by_url, by_snapshot):
        assert data["instance"]["live"] is True
        for tier in ("GPU", "CPU", "DISK"):
            assert data["tiers"][tier]["block_hit_rate"] == report["block_hit_rate"][tier], tier
            assert data["tiers"][tier]["token_hit_rate"] == report["token_hit_rate"][tier], tier
        assert data["transfers"]["DISK->CPU"]["bytes"] == report["transfers"]["DISK->CPU"]["bytes"]
        assert data["tiers"]["DISK"]["compression_ratio"] == round(report["disk"]["compression_ratio"], 4)
    assert by_snapshot["tiers"]["DISK"]["blocks"] == report["disk"]["num_blocks"]  # read from the dir

    # the event stream, from this process: the example consumer rebuilds the tiers exactly
    index = load_example().BlockIndex()
    with EventSubscriber(ready["endpoint"], replay_endpoint=ready["replay_endpoint"]) as sub:
        for item in sub.sync():
            index.apply(item)
    assert not index.stale
    assert {tier: sorted(k.hex() for k in keys) for tier, keys in index.sets().items()} == ready["resident"]
    assert index.hits["CPU"] == report["manager"]["hit_blocks"]["CPU"]
    assert index.hits["STORAGE"] == report["manager"]["hit_blocks"]["DISK"]

    # and `kvtier events --config` finds the instance's bound endpoints through its snapshot
    res = CliRunner().invoke(cli, ["events", "--config", str(cfg), "--from-seq", "0", "--count", "1",
                                   "--json"], catch_exceptions=False)
    first = json.loads(res.output.splitlines()[0])
    assert first["seq"] == 0 and first["events"][0] == {"type": "AllBlocksCleared"}
