"""Tests of benchmarks/ code. Benchmarks are scripts, not a package: each runs with its own
folder first on sys.path and imports its siblings by basename, so the tests import them that
way too, with benchmarks/ and benchmarks/diagnostics/ leading sys.path (benchmarks/ first)."""

from __future__ import annotations

import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "benchmarks")
for folder in (os.path.join(BENCHMARKS, "diagnostics"), BENCHMARKS):
    if folder not in sys.path:
        sys.path.insert(0, folder)
