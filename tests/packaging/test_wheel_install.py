"""``python -m build`` makes an sdist and a wheel (the wheel built from the unpacked sdist, as
``build`` does by default, so a file missing from the sdist fails here), and the wheel installed
into a fresh venv runs: ``kvtier --version``, a replay of the bundled trace, ``--compare``.

The fresh venv gets kvtier from the wheel only (``--no-deps --no-index``, run from a directory
that holds no source tree). Its third-party dependencies are borrowed from the test venv by a
``.pth`` line, because downloading torch in a test is minutes and gigabytes; a ``.pth`` in a
path added that way is not executed, so the test venv's editable kvtier stays invisible, which
the test checks. That every dependency the wheel declares is importable is checked too.
"""

from __future__ import annotations

import json
import re
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

pytest.importorskip("build", reason="the packaging test needs `build` (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = {"remote", "gpu", "test", "plots", "engine"}


def _run(cmd, cwd, timeout=300):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """sdist and wheel built from a copy of the tree (the build writes egg-info and build/)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvtier", src / "kvtier",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, src], cwd=src)
    (sdist,), (wheel,) = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    return sdist, wheel


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        return names, Parser().parsestr(z.read(meta).decode()), z.read(entry).decode()


def test_the_distributions_hold_the_package_its_data_and_accurate_metadata(dist):
    sdist, wheel = dist
    with tarfile.open(sdist) as t:
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for name in ("pyproject.toml", "README.md", "kvtier/cli/main.py",
                 "kvtier/data/sample_trace.jsonl"):
        assert name in in_sdist, name
    names, meta, entry_points = _metadata(wheel)
    assert "kvtier/data/sample_trace.jsonl" in names and "kvtier/cli/main.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names)
    assert re.search(r"^kvtier = kvtier\.cli\.main:main$", entry_points, re.M)
    assert meta["Requires-Python"] == ">=3.10"
    assert "Redis/Valkey" in meta["Summary"] and "\n" not in meta["Summary"]
    assert EXTRAS <= set(meta.get_all("Provides-Extra"))
    requires = meta.get_all("Requires-Dist")
    assert not any(r.startswith("aiofiles") for r in requires)
    assert any(r.startswith("matplotlib") and 'extra == "plots"' in r for r in requires)
    assert any(r.startswith("transformers") and 'extra == "engine"' in r for r in requires)
    assert any("Programming Language :: Python :: 3.10" == c
               for c in meta.get_all("Classifier"))


def _import_name(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
    return {"pyyaml": "yaml", "pyzmq": "zmq", "prometheus-client": "prometheus_client"}.get(
        name, name.replace("-", "_"))


def test_the_wheel_installs_into_a_fresh_venv_and_runs(dist, tmp_path):
    _, wheel = dist
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install",
          "--no-deps", "--no-index", "--disable-pip-version-check", "--quiet", wheel],
         cwd=tmp_path)
    purelib = Path(_run([venv / "bin" / "python", "-c",
                         "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        cwd=tmp_path).strip())
    (purelib / "borrowed_dependencies.pth").write_text(
        "\n".join(site.getsitepackages()) + "\n")
    work = tmp_path / "elsewhere"  # no source tree here: kvtier can only come from the wheel
    work.mkdir()
    where = _run([venv / "bin" / "python", "-c", "import kvtier; print(kvtier.__file__)"],
                 cwd=work).strip()
    assert where.startswith(str(purelib)), where
    _, meta, _ = _metadata(wheel)
    needed = [_import_name(r) for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    _run([venv / "bin" / "python", "-c",
          "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]", *needed],
         cwd=work)
    kvtier = venv / "bin" / "kvtier"
    assert _run([kvtier, "--version"], cwd=work).strip() == f"kvtier {meta['Version']}"
    report = json.loads(_run([kvtier, "bench", "--limit", "20", "--json"], cwd=work))
    assert report["requests"] == 20 and report["wrong_blocks"] == 0
    table = _run([kvtier, "bench", "--compare", "--limit", "40", "--policies", "arc"], cwd=work)
    assert "| inf | infinite |" in table
