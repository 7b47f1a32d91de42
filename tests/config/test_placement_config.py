"""Placement settings in the YAML: per-tier admission (``tiers.*.admission``) and cost-aware
loading (``cost``), validated like every other key and wired by ``build_manager``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import ADMISSION_POLICIES, ConfigError, load_config
from kvtier.manager.admission import AdmitAll, SightingThreshold, admission_names
from kvtier.manager.admission.reuse_gate import ReuseGate
from kvtier.manager.factory import build_manager
from kvtier.manager.specs import Medium

BB = 64 * 1024


def cfg(tmp_path: Path, text: str, env: dict | None = None):
    path = tmp_path / "kvtier.yaml"
    path.write_text(text.replace("{disk}", str(tmp_path / "disk")))
    return load_config(path, env=env or {})


def err(tmp_path: Path, text: str, env: dict | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        cfg(tmp_path, text, env)
    return info.value


def test_admission_names_match_the_registry():
    assert set(ADMISSION_POLICIES) == set(admission_names())


def test_per_tier_admission_is_built(tmp_path):
    c = cfg(tmp_path, "tiers:\n  cpu: {capacity: 1MiB, admission: reuse_gate}\n"
                      "  disk: {path: '{disk}', capacity: 4MiB, admission: threshold}\n")
    assert c.cpu.admission == "reuse_gate" and c.disk.admission == "threshold"
    m = build_manager(c, BB)
    assert isinstance(m.cpu_admission, ReuseGate) and m.cpu_admission.capacity >= 16
    assert isinstance(m.disk_admission, SightingThreshold) and m.disk_admission.threshold == 2


def test_defaults_admit_all_and_store_threshold_still_means_threshold(tmp_path):
    c = cfg(tmp_path, "tiers:\n  disk: {path: '{disk}', capacity: 4MiB}\n")
    assert c.cpu.admission == "all" and c.disk.admission == "all" and c.cost is None
    m = build_manager(c, BB)
    assert isinstance(m.cpu_admission, AdmitAll) and isinstance(m.disk_admission, AdmitAll)
    assert m.cost is None
    c = cfg(tmp_path, "tiers:\n  disk: {path: '{disk}', capacity: 4MiB, store_threshold: 3}\n")
    assert c.disk.admission == "threshold"
    assert build_manager(c, BB).disk_admission.threshold == 3


def test_admission_errors_name_line_key_and_choices(tmp_path):
    e = err(tmp_path, "tiers:\n  cpu:\n    capacity: 1MiB\n    admission: reuse-gate\n")
    assert e.line == 4 and e.key == "tiers.cpu.admission"
    assert "did you mean 'reuse_gate'" in str(e) and e.allowed == ", ".join(ADMISSION_POLICIES)
    e = err(tmp_path, "tiers:\n  disk: {path: '{disk}', store_threshold: 2,\n"
                      "          admission: reuse_gate}\n")
    assert e.key == "tiers.disk.admission" and "contradicts store_threshold" in str(e)
    e = err(tmp_path, "tiers:\n  cpu: {admision: all}\n")
    assert "did you mean 'admission'" in str(e)


def test_admission_from_the_environment(tmp_path):
    c = load_config(data={}, env={"KVTIER_CPU_ADMISSION": "threshold",
                                  "KVTIER_DISK_PATH": str(tmp_path / "d"),
                                  "KVTIER_DISK_ADMISSION": "reuse_gate"})
    assert c.cpu.admission == "threshold" and c.disk.admission == "reuse_gate"
    with pytest.raises(ConfigError, match="KVTIER_CPU_ADMISSION"):
        load_config(data={}, env={"KVTIER_CPU_ADMISSION": "lru"})


def test_cost_section(tmp_path):
    c = cfg(tmp_path, "cost: {recompute_tokens_per_s: 31000}\n")
    assert c.cost.recompute_us_per_token == pytest.approx(1e6 / 31000) and c.cost.prior_load_gbps == 100
    c = cfg(tmp_path, "block_tokens: 16\ncost: {recompute_us_per_token: 32.3, prior_load_gbps: 20}\n")
    assert c.to_dict()["cost"] == {"recompute_us_per_token": 32.3, "prior_load_gbps": 20.0}
    m = build_manager(c, 2 << 20)  # Llama-8B: 2 MiB per 16-token block
    assert m.cost.recompute_block_s == pytest.approx(16 * 32.3e-6)
    assert m.cost.bandwidth[Medium.DISK].bytes_per_s == 20e9
    m.record_load(Medium.DISK, 1 << 30, (1 << 30) / 1.5e9)  # a 1.5 GB/s disk loses
    assert m.cost.worth_loading([Medium.DISK]) == 0


@pytest.mark.parametrize("text, key, words", [
    ("cost: {prior_load_gbps: 5}\n", "cost", "recompute speed once"),
    ("cost: {recompute_us_per_token: 3,\n       recompute_tokens_per_s: 9}\n",
     "cost.recompute_tokens_per_s", "recompute speed once"),
    ("cost: {recompute_us_per_token: -1}\n", "cost.recompute_us_per_token", "out of range"),
    ("cost: {recompute_tokens_per_s: 0}\n", "cost.recompute_tokens_per_s", "out of range"),
    ("cost: {recompute_us_per_token: 3, prior_load_gbps: fast}\n", "cost.prior_load_gbps",
     "must be a number"),
    ("cost: {recompute_us_per_tokens: 3}\n", "cost.recompute_us_per_tokens",
     "did you mean 'recompute_us_per_token'"),
])
def test_cost_errors(tmp_path, text, key, words):
    e = err(tmp_path, text)
    assert e.key == key and words in str(e) and e.line is not None


def test_offload_limit_from_the_config_caps_each_prompts_store(tmp_path):
    """``admission.offload_ratio`` / ``max_offload_tokens`` reach the manager's own
    ``prepare_store`` (no wrapper); a request's context overrides them."""
    from kvtier.manager.specs import RequestContext

    c = cfg(tmp_path, "tiers:\n  cpu: {capacity: 1MiB}\nadmission:\n  offload_ratio: 0.5\n")
    m = build_manager(c, BB)
    ctx = RequestContext(num_prompt_blocks=8, block_tokens=16)
    assert m.prepare_store([bytes([i]) * 16 for i in range(8)], ctx).keys == tuple(
        bytes([i]) * 16 for i in range(4))
    whole = RequestContext(num_prompt_blocks=8, block_tokens=16, offload_ratio=1.0)
    assert len(m.prepare_store([bytes([i]) * 16 for i in range(20, 28)], whole).keys) == 8
    c = cfg(tmp_path, "tiers:\n  cpu: {capacity: 1MiB}\nadmission:\n  max_offload_tokens: 48\n")
    m = build_manager(c, BB)
    assert len(m.prepare_store([bytes([i]) * 16 for i in range(8)], ctx).keys) == 3
