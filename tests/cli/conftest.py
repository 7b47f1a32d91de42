"""A generated trace as a file: ``kvtier bench`` reads traces from files only; the benchmarks'
generator (``trace_gen``, by basename: tests/conftest.py puts benchmarks/ on sys.path) writes
the shapes that tell policies apart."""

from __future__ import annotations

import pytest
from trace_gen import generate, write_trace


@pytest.fixture
def generated_trace(tmp_path):
    """``generated_trace(shape, requests, seed=0)`` -> the path of that trace, written once."""

    def write(shape: str, requests: int, seed: int = 0) -> str:
        path = tmp_path / f"{shape}-{requests}-{seed}.jsonl"
        if not path.exists():
            write_trace(generate(shape, requests, seed), path)
        return str(path)

    return write
