"""Progress of a long bench, on stderr, so a run of minutes is never silent.

A replay of the 3,993-request trace or a ``--compare`` over it printed nothing for a minute.
On a terminal a rich bar shows steps done and time spent; off a terminal (a pipe, a CI log,
where a bar would be a mess of control codes) a plain line every ``PLAIN_EVERY_S`` seconds.
Both go to stderr: stdout stays the report alone (``--json`` output stays parseable).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvtier.cli import terminal

PLAIN_EVERY_S = 10.0

Update = Callable[[int, str], None]
"""``update(done, what)``: ``done`` steps finished, ``what`` the step running now."""


@contextmanager
def progress(total: int, unit: str) -> Iterator[Update]:
    if sys.stderr.isatty():
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=terminal.console(stderr=True),
                      transient=True) as bar:
            task = bar.add_task(unit, total=total)
            yield lambda done, what: bar.update(task, completed=done,
                                                description=what or unit)
        return
    start = time.monotonic()
    last = start

    def update(done: int, what: str) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= PLAIN_EVERY_S:
            last = now
            now_doing = f" ({what})" if what else ""
            print(f"kvtier: {done:,}/{total:,} {unit}{now_doing}, {now - start:.0f} s",
                  file=sys.stderr, flush=True)

    yield update
