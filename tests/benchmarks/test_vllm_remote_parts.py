"""``benchmarks/vllm_remote.py`` without a GPU: the kvtier config its host-tier option builds
(read back by kvtier's own loader), the pure pieces (configurations, sizes, ratios, tables),
and one whole run of both phases on the host tier with stand-in instances
(``fake_vllm_remote_child.py``) that take their regions of a real host-tier service."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path

import pytest

import vllm_remote
import vllm_remote_child

GiB = 1 << 30
FAKE_CHILD = Path(__file__).with_name("fake_vllm_remote_child.py")


def test_configs_by_name_and_by_connector():
    assert vllm_remote.connectors("private,host,remote,native") == [
        "kvtier", "kvtier_host", "kvtier_remote", "native"]
    assert vllm_remote.connectors("kvtier,kvtier_remote") == ["kvtier", "kvtier_remote"]
    assert vllm_remote.default_configs("host") == "private,host,native"
    assert vllm_remote.default_configs("remote") == "private,remote,native"
    with pytest.raises(ValueError, match="unknown configuration 'disk'"):
        vllm_remote.connectors("private,disk")


def test_host_option_builds_a_host_tier_config_kvtier_loads(tmp_path):
    """What the child hands vLLM as kv_connector_extra_config: tiers.host with a fresh 0700
    directory and a pool of two regions plus a margin, each instance's region its CPU tier."""
    from kvtier.connectors.vllm.settings import load_kvtier_config
    from kvtier.tiers.host import HostAddress
    from kvtier.tiers.host.client import secure_directory

    d = vllm_remote.new_host_dir(tmp_path)
    assert d.parent == tmp_path and not any(d.iterdir())
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert vllm_remote.new_host_dir(tmp_path) != d  # fresh for every pool
    cpu = 256 << 20
    section = vllm_remote.host_section(d, cpu)
    assert section["capacity"] == 2 * cpu + vllm_remote.HOST_MARGIN
    cfg = vllm_remote_child.transfer_dict("kvtier_host", cpu, 16, str(tmp_path / "snap.json"),
                                          host=section, engine_id="A-1")
    assert cfg["engine_id"] == "A-1"
    assert cfg["kv_connector"] == "KVTierConnector"
    config = load_kvtier_config(cfg["kv_connector_extra_config"])
    assert config.cpu.capacity == cpu
    assert config.host.capacity == 2 * cpu + vllm_remote.HOST_MARGIN
    assert config.host.dir == d
    assert config.host.idle_exit_s == vllm_remote.HOST_IDLE_EXIT_S
    assert config.remote is None
    block = vllm_remote.kv_bytes_per_token("8b") * 16
    assert 2 * config.cpu_slots(block) <= config.host_slots(block)
    secure_directory(HostAddress.from_config(config.host, "f" * 32, block))  # accepted


def test_child_connectors_other_than_host(tmp_path):
    snap = str(tmp_path / "s.json")
    private = vllm_remote_child.transfer_dict("kvtier", 1 * GiB, 16, snap)
    tiers = private["kv_connector_extra_config"]["kvtier"]["tiers"]
    assert tiers == {"cpu": {"capacity": GiB}} and "engine_id" not in private
    remote = vllm_remote_child.transfer_dict("kvtier_remote", GiB, 16, snap,
                                             remote={"url": "redis://127.0.0.1:1"})
    assert remote["kv_connector_extra_config"]["kvtier"]["tiers"]["remote"]["url"]
    native = vllm_remote_child.transfer_dict("native", GiB, 16, snap, engine_id="n")
    assert native["kv_connector"] == "OffloadingConnector" and native["engine_id"] == "n"
    assert vllm_remote_child.transfer_dict("none", GiB, 16, snap) is None
    with pytest.raises(ValueError, match="tiers.host"):
        vllm_remote_child.transfer_dict("kvtier_host", GiB, 16, snap)


def test_vllm_takes_the_engine_id_or_draws_distinct_ones(tmp_path):
    config = pytest.importorskip("vllm.config")
    section = vllm_remote.host_section(tmp_path, GiB)
    given = vllm_remote_child.transfer_dict("kvtier_host", GiB, 16, "s", host=section,
                                            engine_id="A-1")
    assert config.KVTransferConfig(**given).engine_id == "A-1"
    given.pop("engine_id")
    drawn = {config.KVTransferConfig(**given).engine_id for _ in range(2)}
    assert len(drawn) == 2 and all(drawn)


def test_child_command_passes_the_host_section_and_a_distinct_engine_id(tmp_path):
    args = vllm_remote.parser().parse_args(["--shape", "1b"])
    host = vllm_remote.host_section(tmp_path, GiB)
    cmds = [vllm_remote.child_command(n, "kvtier_host", args, tmp_path, gpu_kv_bytes=5,
                                      cpu_bytes=GiB, host=host, gpu_util=0.4)
            for n in ("A", "B")]

    def value(cmd, flag):
        return cmd[cmd.index(flag) + 1]

    assert json.loads(value(cmds[0], "--host")) == host
    assert value(cmds[0], "--gpu-util") == "0.4" and value(cmds[0], "--cpu-bytes") == str(GiB)
    assert "--remote" not in cmds[0]
    ids = [value(c, "--engine-id") for c in cmds]
    assert ids[0].startswith("A-") and ids[1].startswith("B-") and ids[0] != ids[1]
    child = vllm_remote_child.parser().parse_args(cmds[0][2:])  # the child reads them back
    assert child.connector == "kvtier_host" and json.loads(child.host) == host


def test_sizes():
    assert vllm_remote.kv_bytes_per_token("8b") == 128 << 10  # 2 MiB per 16-token block
    lengths = [2048, 8192, 32768]
    need = sum(L // 16 * 3 for L in lengths) * (2 << 20)  # 2 reps and the checked prompt
    got = vllm_remote.ttft_cpu_bytes("8b", lengths, 2, 16 * GiB)
    assert need < got <= need * 1.1 + 1 and got > 16 * GiB
    assert vllm_remote.ttft_cpu_bytes("8b", [2048], 1, 16 * GiB) == 16 * GiB  # the floor
    args = argparse.Namespace(gpu_kv_bytes=24 * GiB, gpu_util=None)
    assert vllm_remote.gpu_budget(args, False) == (24 * GiB, None)
    assert vllm_remote.gpu_budget(args, True) == (12 * GiB, vllm_remote.SHARED_GPU_UTIL)
    args.gpu_util = 0.3
    assert vllm_remote.gpu_budget(args, True) == (12 * GiB, 0.3)


def _rr(config, new, rps, p50, p99):
    return {"config": config, "connector": vllm_remote.CONFIGS[config], "new_tokens": new,
            "requests_per_s": rps, "ttft_p50_ms": p50, "ttft_p99_ms": p99, "requests": 8,
            "cached_tokens": 1000, "conversations": 2, "turns": {0: {}, 1: {}},
            "first_tokens": 32, "think_ms": 0.0}


def test_ratios_against_the_private_tiers_per_turn_size():
    rows = [_rr("private", 2048, 4.0, 100.0, 200.0), _rr("host", 2048, 5.0, 80.0, 100.0),
            _rr("native", 2048, 2.0, 100.0, 400.0), _rr("private", 8192, 2.0, 300.0, 600.0),
            _rr("host", 8192, 3.0, 150.0, 600.0)]
    got = {(r["ratio"], r["new_tokens"]): r for r in vllm_remote.ratios(rows)}
    assert set(got) == {("host/private", 2048), ("native/private", 2048),
                        ("host/private", 8192)}
    assert got["host/private", 2048] == {"ratio": "host/private", "new_tokens": 2048,
                                         "requests_per_s": 1.25, "ttft_p50": 0.8,
                                         "ttft_p99": 0.5}
    assert got["host/private", 8192]["requests_per_s"] == 1.5
    result = {"gpu": "G", "gpus": 1, "shape": "8b", "tier": "host", "cluster": False,
              "roundrobin": rows, "ratios": vllm_remote.ratios(rows)}
    text = vllm_remote.markdown(result)
    assert "| kvtier host tier | 8192 | 3.0 | 150.0 / 600.0 | 1,000 | 1.5x, 0.5x |" in text
    assert vllm_remote.out_name(result) == "vllm_remote_roundrobin_host_G"


def test_help_documents_the_new_options():
    text = vllm_remote.parser().format_help()
    for flag in ("--tier", "--configs", "--host-dir", "--gpu-util", "--new-tokens"):
        assert flag in text
    assert "private (kvtier," in " ".join(text.split())


def test_a_whole_host_tier_run_with_stand_in_instances(tmp_path, monkeypatch):
    """Both phases on the host tier, as ``main`` runs them: B hits what the live A stored,
    its own blocks after a reset, a fresh prompt misses; in the round-robin each turn hits
    what the other instance stored, the private tiers only their own; the files written;
    every pool's service gone at the end."""
    monkeypatch.setattr(vllm_remote, "CHILD", FAKE_CHILD)
    monkeypatch.setattr(vllm_remote, "gpu_name", lambda: "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    out, logs, pools = tmp_path / "out", tmp_path / "logs", tmp_path / "pools"
    pools.mkdir()
    monkeypatch.setattr(sys, "argv", [
        "vllm_remote.py", "--phases", "ttft,roundrobin", "--tier", "host", "--shape", "1b",
        "--lengths", "64,160", "--reps", "2", "--cpu-bytes", str(64 << 20),
        "--configs", "private,host", "--conversations", "2", "--turns", "3",
        "--first-tokens", "48", "--new-tokens", "32,64", "--think-ms", "0", "--gpus", "0",
        "--out-dir", str(out), "--log-dir", str(logs), "--host-dir", str(pools)])
    assert vllm_remote.main() == 0
    result = json.loads((out / "vllm_remote_ttft-roundrobin_host_cpu.json").read_text())
    t = result["ttft"]
    assert t["host"]["capacity"] == 2 * t["cpu_bytes"] + vllm_remote.HOST_MARGIN
    assert t["gpu_util"] == vllm_remote.SHARED_GPU_UTIL  # A and B alive on one GPU
    assert t["stats_A"]["engine_id"] != t["stats_B"]["engine_id"]
    assert t["host_service"]["service_exited"]
    for L, row in t["rows"].items():
        L = int(L)
        assert row["host_cached"] == [L - 16, L - 16]  # A's blocks, A alive
        assert row["host_again"] and row["cpu_cached"] == [L - 16, L - 16]  # B's own
        assert row["tokens_equal"] and row["check_cached"] == L - 16
    assert t["first_hit_after_start"]["cached"] == 48
    rr = {(r["config"], r["new_tokens"]): r for r in result["roundrobin"]}
    assert set(rr) == {("private", 32), ("private", 64), ("host", 32), ("host", 64)}
    for n in (32, 64):
        # turn 1 lands on the other instance: only the host tier has turn 0's blocks there
        assert rr["host", n]["turns"]["1"]["cached_tokens"] > 0
        assert rr["private", n]["turns"]["1"]["cached_tokens"] == 0
        assert rr["host", n]["requests"] == 6
    assert rr["host", 32]["host_service"]["service_exited"]
    assert {r["ratio"] for r in result["ratios"]} == {"host/private"}
    text = (out / "vllm_remote_ttft-roundrobin_host_cpu.md").read_text()
    assert "| kvtier host tier | 64 |" in text and "A's blocks again" in text
    assert sorted(p.name for p in out.iterdir()) == [
        "vllm_remote_ttft-roundrobin_host_cpu.json", "vllm_remote_ttft-roundrobin_host_cpu.md"]
    assert not list(pools.iterdir())  # each pool's directory removed once its service left
