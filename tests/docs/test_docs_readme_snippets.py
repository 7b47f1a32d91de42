"""The README's config and `--kv-transfer-config` are ones kvtier accepts: the YAML loads, the
JSON parses into the connector settings vLLM passes on, the `LLM(...)` snippet names the same
connector, and no block size has to match: the YAML leaves `block_tokens` out (kvtier then takes
vLLM's block size, whatever the release's default) and neither command pins `--block-size`."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvtier.config import load_config
from kvtier.connectors.vllm.settings import load_kvtier_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _block(lang: str, containing: str) -> str:
    blocks = re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.M | re.S)
    found = [b for b in blocks if containing in b]
    assert len(found) == 1, f"one ```{lang} block with {containing!r}"
    return found[0]


def _serve_json() -> dict:
    command = _block("bash", "vllm serve")
    return json.loads(re.search(r"'(\{.*\})'", command, flags=re.S).group(1))


def test_readme_yaml_loads(tmp_path):
    text = _block("yaml", "# kvtier.yaml")
    config = load_config(text=text, env={"KVTIER_DISK_PATH": str(tmp_path / "cache")})
    assert config.disk is not None and config.cpu.capacity > 0


def test_serve_flag_names_the_connector_and_a_loadable_config(tmp_path, monkeypatch):
    settings = _serve_json()
    assert settings["kv_connector"] == "KVTierConnector"
    assert settings["kv_connector_module_path"] == "kvtier.connectors.vllm"
    assert settings["kv_role"] == "kv_both"
    assert settings["kv_load_failure_policy"] == "recompute"
    (tmp_path / "kvtier.yaml").write_text(_block("yaml", "# kvtier.yaml"))
    monkeypatch.chdir(tmp_path)  # the flag names the YAML relative to where vLLM starts
    monkeypatch.setenv("KVTIER_DISK_PATH", str(tmp_path / "cache"))
    config = load_kvtier_config(settings["kv_connector_extra_config"])
    assert not config.given("block_tokens")
    assert "--block-size" not in _block("bash", "vllm serve")


def test_python_snippet_matches_the_serve_flag(tmp_path):
    snippet = _block("python", "KVTransferConfig")
    settings = _serve_json()
    for key in ("kv_connector", "kv_connector_module_path", "kv_role", "kv_load_failure_policy"):
        assert f'{key}="{settings[key]}"' in snippet, key
    compile(snippet, "README.md", "exec")
    assert "block_size" not in snippet
