"""What the scripts/gen_*_doc.py generators share: their command line, and writing a page or
checking that the committed one is what the code generates (the drift check CI runs)."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path


def parse_args(description: str, default: Path, argv: list[str] | None,
               flag: str = "--out") -> argparse.Namespace:
    """``--check`` and the page's path (``flag``; read back as ``out``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the committed page differs from the generated one")
    ap.add_argument(flag, dest="out", type=Path, default=default, help="page to write or check")
    return ap.parse_args(argv)


def write_or_check(path: Path, text: str, check: bool, regenerate: str) -> int:
    """Write ``text`` to ``path``, or with ``check`` compare it (0: up to date, 1: stale, with
    the start of the difference and the command that regenerates the page)."""
    if check:
        current = path.read_text() if path.exists() else ""
        if current == text:
            return 0
        diff = difflib.unified_diff(current.splitlines(), text.splitlines(), str(path),
                                    "generated", lineterm="")
        print("\n".join(list(diff)[:60]))
        print(f"{path} is stale: run python {regenerate}", file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0
