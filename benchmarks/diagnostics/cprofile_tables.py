"""Function-level host time of repeated calls (``vllm_e2e.py --cprofile``), as text tables.

The torch profiler shows CUDA calls and kernels; where kvtier's *Python* time goes per hit
(scheduler lookup, planning, the copy's enqueue) needs cProfile. Every call under one name
adds to one profile, and the table is rewritten after each, in milliseconds per call, so a run
cut short still leaves its tables.
"""

from __future__ import annotations

import cProfile
import os
import pstats
from typing import Callable, TypeVar

T = TypeVar("T")
_PROFILES: dict[str, tuple[cProfile.Profile, list[int]]] = {}


def profiled_call(fn: Callable[[], T], out_dir: str, name: str, title: str) -> T:
    """``fn()`` under the profile ``name``; writes ``<out_dir>/<name>.txt``: kvtier's functions
    by cumulative time, then everything by own and by cumulative time."""
    prof, calls = _PROFILES.setdefault(name, (cProfile.Profile(), [0]))
    prof.enable()
    try:
        result = fn()
    finally:
        prof.disable()
    calls[0] += 1
    n = calls[0]
    rows = [(ct, tt, nc, path, f"{'/'.join(path.split('/')[-2:])}:{line}({func})")
            for (path, line, func), (_cc, nc, tt, ct, _callers) in pstats.Stats(prof).stats.items()]

    def table(heading: str, picked) -> list[str]:
        return [heading, "  cum ms/req  own ms/req  calls/req  function"] + [
            f"  {ct * 1e3 / n:10.3f}  {tt * 1e3 / n:10.3f}  {nc / n:9.1f}  {where}"
            for ct, tt, nc, _path, where in picked]

    lines = [f"{title}: {n} timed hits under cProfile"]
    lines += table("kvtier, by cumulative time:",
                   sorted((r for r in rows if "/kvtier/" in r[3]), reverse=True)[:60])
    lines += table("all, by own time:", sorted(rows, key=lambda r: -r[1])[:40])
    lines += table("all, by cumulative time:", sorted(rows, reverse=True)[:40])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return result
