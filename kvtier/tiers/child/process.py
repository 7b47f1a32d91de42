"""How kvtier starts its helper processes (disk I/O, shared-tier I/O): isolated.

Such a child maps the whole CPU pool, so whatever it imports can read and overwrite every
cached block. It runs ``python -I`` (no script or current directory on ``sys.path``, no
PYTHON* variables, no user site-packages) in a fixed working directory, so a module planted in
the directory the server was started from (say a ``json.py`` in /tmp) is never imported.

What it may import is what this process already trusts: the absolute, existing entries of this
process's ``sys.path`` (kvtier's own directory, a venv or a ``PYTHONPATH`` install of its
dependencies), minus the working directory, appended after the child's own standard library so
nothing there can shadow it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import kvtier

CHILD_CWD = "/"
_BOOT = ("import json, sys; sys.path += [p for p in json.loads(sys.argv[1]) if p not in sys.path];"
         " from {module} import main; sys.exit(main(sys.argv[1:]))")


def child_environment() -> dict[str, str]:
    """This process's environment without the interpreter's own switches (``PYTHON*``: a
    path, a start-up file, a hash seed ...); ``-I`` ignores them too, this says so twice."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


def trusted_path() -> list[str]:
    """The import path a child gets beyond its own: see the module's docstring."""
    cwd = os.path.realpath(os.getcwd())
    kvtier_root = str(Path(kvtier.__file__).resolve().parent.parent)
    out = []
    for p in [kvtier_root, *sys.path]:
        if not p or not os.path.isabs(p) or not os.path.isdir(p):
            continue
        if os.path.realpath(p) == cwd and p != kvtier_root:
            continue
        if p not in out:
            out.append(p)
    return out


def isolated_command(module: str, spec: dict) -> list[str]:
    """The command line of a child running ``module.main(argv)``; ``argv[1]`` is ``spec`` as
    JSON (no secrets: a command line is visible to every local user)."""
    return [sys.executable, "-I", "-c", _BOOT.format(module=module), json.dumps(trusted_path()),
            json.dumps(spec)]
