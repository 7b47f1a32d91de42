"""What kvtier prints fits 80 columns: help, tables and errors.

A terminal wraps a longer line wherever the column runs out, mid-word, and on a wide terminal
a table stretches past what anyone reads. So output is laid out for the terminal's width, never
more than ``MAX_COLUMNS``. An error is one line (``kvtier: error: <what>``), which a log or a
script reads whole; printed to a terminal, a long one is wrapped at word boundaries into
lines of at most that width, the continuation lines indented.
"""

from __future__ import annotations

import shutil
import sys
import textwrap

import click
from rich.console import Console

MAX_COLUMNS = 80
MIN_COLUMNS = 40  # below this, wrapping would shred the text: use 40 and let the terminal fold


def columns() -> int:
    """The width to lay text out for: the terminal's (``COLUMNS`` first, as every program
    reads it), at most ``MAX_COLUMNS``; ``MAX_COLUMNS`` when there is no terminal."""
    width = shutil.get_terminal_size((MAX_COLUMNS, 24)).columns
    return max(MIN_COLUMNS, min(width, MAX_COLUMNS))


def console(stderr: bool = False) -> Console:
    """A rich console that never lays out wider than ``columns()``."""
    return Console(stderr=stderr, width=columns())


def stderr_is_terminal() -> bool:
    stream = sys.stderr
    return bool(getattr(stream, "isatty", None)) and stream.isatty()


def wrapped(text: str, width: int | None = None) -> str:
    """``text`` on one line, or wrapped to ``width`` columns (continuations indented)."""
    line = " ".join(text.split())
    if width is None or len(line) <= width:
        return line
    return "\n".join(textwrap.wrap(line, width, subsequent_indent="  ",
                                   break_on_hyphens=False))


def echo_stderr(text: str) -> None:
    """Print one message on stderr: one line, wrapped when stderr is a terminal."""
    click.echo(wrapped(text, columns() if stderr_is_terminal() else None), err=True)


def echo_error(message: str) -> None:
    echo_stderr("kvtier: error: " + message)
