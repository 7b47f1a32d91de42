"""Summarise py-spy raw profiles of ``vllm_e2e.py --pyspy``, side by side per configuration.

py-spy (``--native --threads --idle``, 1 kHz) writes one line per distinct stack: ``thread
(tid): name;frame;...;frame count``. For one thread (the engine's, ``MainThread`` in-process)
this prints, per profile, the samples per request by leaf frame (where the thread was: a
Python line, a CUDA driver call, a GIL wait in ``take_gil``/``pthread_cond_*``) and by any frame
on the stack (inclusive), so two configurations running the same request can be compared
function by function, native frames included.

    python benchmarks/diagnostics/pyspy_summary.py --requests 150 OUT/pyspy/1b-none.txt OUT/pyspy/1b-kvtier.txt
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_ADDR = re.compile(r"^0x[0-9a-f]+ \((.+)\)$")


def frame_name(frame: str) -> str:
    """A frame without its line number (``f (file.py:12)`` -> ``f (file.py)``); a bare
    address becomes its library, so unresolved frames of one library add up."""
    m = _ADDR.match(frame)
    if m:
        return f"[{m.group(1)}]"
    return re.sub(r":\d+\)$", ")", frame)


def load(path: str, thread: str) -> tuple[Counter, Counter, int]:
    leaf: Counter = Counter()
    inclusive: Counter = Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            if not frames[0].endswith(": " + thread):
                continue
            n = int(count)
            names = [frame_name(x) for x in frames[1:]]
            total += n
            if names:
                leaf[names[-1]] += n
            for name in set(names):
                inclusive[name] += n
    return leaf, inclusive, total


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profiles", nargs="+")
    p.add_argument("--thread", default="MainThread")
    p.add_argument("--requests", type=float, default=1.0,
                   help="requests in each profile (figures are samples per request)")
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args(argv)
    loaded = [(path, *load(path, a.thread)) for path in a.profiles]
    for title, index in (("leaf frame", 1), ("on the stack", 2)):
        union: Counter = Counter()
        for item in loaded:
            union.update(item[index])
        print(f"\n## samples per request by {title} ({a.thread})\n")
        print("| frame | " + " | ".join(path.rsplit("/", 1)[-1] for path, *_ in loaded) + " |")
        print("|---|" + "---|" * len(loaded))
        print("| (all) | " + " | ".join(f"{t / a.requests:.2f}" for *_, t in loaded) + " |")
        for name, _ in union.most_common(a.top):
            cells = [f"{item[index][name] / a.requests:.2f}" for item in loaded]
            print(f"| `{name[:110]}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
