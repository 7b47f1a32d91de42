"""scripts/test.sh announces each phase, says every HEARTBEAT_S seconds that a long one is still
running, and ends each with its duration and status (a full run is ~10 minutes on 2 cores; a
vLLM engine test alone takes minutes, and the log used to be silent meanwhile).

The script runs for real on a stand-in tree: its setup, pytest, vLLM 0.33 and 0.34 steps are stubs
that take a few seconds, and the heartbeat's period is 1 s instead of 60 s."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stand_in_tree(tmp_path: Path, pytest_status: int = 0) -> Path:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    text = (ROOT / "scripts" / "test.sh").read_text()
    assert "HEARTBEAT_S=60\n" in text
    (scripts / "test.sh").write_text(text.replace("HEARTBEAT_S=60\n", "HEARTBEAT_S=1\n"))
    (scripts / "setup.sh").write_text("echo 'setup ran' >&2\n")
    (scripts / "test_vllm_release.sh").write_text("echo \"vllm ${1%.0} suite ran\" >&2\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nsleep 2.6\necho \"pytest $*\"\nexit {pytest_status}\n")
    python.chmod(0o755)
    return scripts / "test.sh"


def run(script: Path, *args: str, **extra_env: str):
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVTIER_SKIP_VLLM033", "KVTIER_SKIP_VLLM034")}
    env.update(extra_env)
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          timeout=60, env=env)
    return proc, time.monotonic() - t0


def test_every_phase_is_announced_timed_and_never_silent(tmp_path):
    proc, seconds = run(stand_in_tree(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    phases = [line for line in lines if line.startswith("kvtier tests: phase: ")]
    assert [p.split(": ", 2)[2].split(" ")[0] for p in phases] == ["setup"] + ["the"] * 3, phases
    assert "whole suite" in phases[1] and "vLLM 0.33" in phases[2] and "vLLM 0.34" in phases[3]
    done = [line for line in lines if line.startswith("kvtier tests: phase done in ")]
    assert len(done) == 4 and all("(exit 0)" in line for line in done), lines
    suite = lines.index(phases[1])
    beats = [line for line in lines[suite:lines.index(phases[2])] if "still running" in line]
    assert len(beats) >= 2, lines  # the 2.6 s stand-in suite, a line a second
    assert "setup ran" in proc.stderr and "vllm 0.33 suite ran" in proc.stderr
    assert proc.stderr.index("vllm 0.33 suite ran") < proc.stderr.index("vllm 0.34 suite ran")
    assert seconds < 20  # no heartbeat sleep left holding the output open


def test_a_failing_phase_stops_the_run_with_its_status(tmp_path):
    proc, _ = run(stand_in_tree(tmp_path, pytest_status=3))
    assert proc.returncode == 3, proc.stderr
    assert "(exit 3)" in proc.stderr and "vllm 0.33 suite ran" not in proc.stderr
    assert "vllm 0.34 suite ran" not in proc.stderr


def test_each_later_vllm_phase_has_its_own_skip_switch(tmp_path):
    script = stand_in_tree(tmp_path)
    proc, _ = run(script, KVTIER_SKIP_VLLM034="1")
    assert proc.returncode == 0, proc.stderr
    assert "vllm 0.33 suite ran" in proc.stderr and "vllm 0.34 suite ran" not in proc.stderr
    proc, _ = run(script, KVTIER_SKIP_VLLM033="1")
    assert proc.returncode == 0, proc.stderr
    assert "vllm 0.33 suite ran" not in proc.stderr and "vllm 0.34 suite ran" in proc.stderr


def test_extra_arguments_run_one_pytest_phase(tmp_path):
    proc, _ = run(stand_in_tree(tmp_path), "tests/cli", "-k", "version")
    assert proc.returncode == 0, proc.stderr
    assert "kvtier tests: phase: pytest tests/cli -k version" in proc.stderr
    assert proc.stdout.strip() == "pytest -m pytest -q -p no:cacheprovider tests/cli -k version"
    assert "vllm 0.33 suite ran" not in proc.stderr and "vllm 0.34 suite ran" not in proc.stderr
