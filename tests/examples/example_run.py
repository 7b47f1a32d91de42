"""Running an example script as a user would: its own process, from the repository root, with
the environment a CPU-only machine needs for vLLM (the examples set the rest themselves). A run
that prints a traceback fails, even when it exits 0: a user reads it as a crash."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_example(*args: str, timeout: float = 600, env: dict | None = None):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **CPU_ENV, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-6000:]
    return proc.stdout
