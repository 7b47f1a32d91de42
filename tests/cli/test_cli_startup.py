"""The CLI must start without torch (issue 14, item 19): importing torch costs 4-5 s (21 s under
load), and only ``kvtier bench`` without ``--compare`` moves bytes. Checked in a fresh
interpreter, since this test process has long imported torch through other tests."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from kvtier.cli.main import cli
try:
    cli.main({args!r}, prog_name="kvtier", standalone_mode=False)
except SystemExit:
    pass
print("TORCH-LOADED" if "torch" in sys.modules else "TORCH-ABSENT")
"""


def _torch_loaded(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(args=args)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_importing_the_cli_does_not_import_torch():
    proc = subprocess.run([sys.executable, "-c",
                           "import sys, kvtier.cli.main; print('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize("args", [["--help"], ["bench", "--help"], ["stats", "--help"],
                                  ["events", "--help"]])
def test_help_does_not_import_torch(args):
    assert _torch_loaded(args) == "TORCH-ABSENT"


def test_compare_does_not_import_torch():
    assert _torch_loaded(["bench", "--compare", "--limit", "20", "--policies", "lru",
                          "--capacity-blocks", "10", "--json"]) == "TORCH-ABSENT"


def test_a_replay_does_import_torch():
    """Positive control: the probe does see torch where bytes really move."""
    assert _torch_loaded(["bench", "--limit", "5", "--json"]) == "TORCH-LOADED"
