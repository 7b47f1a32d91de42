"""Shared pytest options.

Layout: one folder per layer of kvtier (config, tiers, manager, transfer, runtime,
connectors/vllm, observe, cli), plus reliability (the stack under faults), benchmarks (tests of
benchmarks/ code), scripts and gpu. Test file basenames are unique across folders: pytest's
default ``prepend`` import mode imports a test file in a folder without ``__init__.py`` under its
basename. The same mode puts tests/ itself on sys.path for this file, which is what makes the
shared helper packages ``support`` and ``reliability`` importable from every folder; a helper
used by one folder only sits in that folder (importable by its basename). benchmarks/ is
appended to sys.path, so a test of a manager plug-in can use the benchmarks' policy simulator
and trace generator (``policy_sim``, ``trace_gen``) by basename; appended, it shadows nothing.

--runslow            also run the long variants (soak, many crash iterations)
KVTIER_REQUIRE_VLLM=1  a test skipped because vLLM is missing fails instead (CI sets it: the
                     test environment must have vLLM, and a skipped proof proves nothing).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run long variants")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip_slow = pytest.mark.skip(reason="long variant: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("KVTIER_REQUIRE_TLS_SERVER") == "1":
        lr = report.longrepr
        reason = (lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)).lower()
        if "redis-server built with tls" in reason:  # CI installs it: a skip proves nothing
            report.outcome = "failed"
            report.longrepr = f"a TLS server is required here (KVTIER_REQUIRE_TLS_SERVER=1) but: {lr}"
            return
    if report.skipped and os.environ.get("KVTIER_REQUIRE_VLLM") == "1":
        lr = report.longrepr  # (path, line, message): only the message says why
        reason = (lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)).lower()
        if "vllm" in reason:
            report.outcome = "failed"
            report.longrepr = f"vLLM is required here (KVTIER_REQUIRE_VLLM=1) but: {report.longrepr}"


@pytest.fixture
def tmpfs_mount(tmp_path):
    """``tmpfs_mount(size, why)``: a real tmpfs of ``size`` (e.g. "256k") under tmp_path,
    unmounted at teardown; the test is skipped (saying ``why`` it matters) where mounting is
    impossible (not root, no mount command, no permission)."""
    mounted = []

    def mount(size: str, why: str):
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip(f"needs root and mount for a real tmpfs ({why})")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                            str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()} ({why})")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
