"""Files named on the command line are checked before anything reads them.

``open()`` on a FIFO blocks until a writer appears (``kvtier stats --snapshot fifo`` hung),
``/dev/zero`` never ends (``--config /dev/zero`` died of MemoryError) and a 200 MB "config" was
read whole: every path a user gives must be a regular file, and a config no larger than any
real one could be. A file that parses to nothing is refused too: an empty YAML silently meant
"all defaults", which is never what a user who wrote a config file asked for.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import yaml

from kvtier.config import ConfigError, KvtierConfig, format_size, load_config
from kvtier.runtime.snapshot import read_snapshot

MAX_CONFIG_BYTES = 16 << 20
"""A real config (or stats snapshot) is a few KiB; anything past this is a wrong file."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def regular_file(path: Path, option: str, max_bytes: int | None = None) -> Path:
    """``path`` if it is a regular file (following links) of at most ``max_bytes``; else a
    ``ConfigError`` naming ``option``. Only ``stat`` is called: nothing is opened."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"cannot read {option} {str(path)!r}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{option} {str(path)!r} is {_kind(st.st_mode)}, not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise ConfigError(f"{option} {str(path)!r} is {format_size(st.st_size)}, more than "
                          f"the {format_size(max_bytes)} kvtier reads from one")
    return path


def _holds_settings(text: str) -> bool:
    """False for a document that is empty, only comments, ``---`` or ``null``. A YAML error
    counts as settings: ``load_config`` then reports it with its line."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError):
        return True
    if node is None:
        return False
    return not (isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null"))


def read_snapshot_file(path: Path | None) -> dict | None:
    """The stats snapshot at ``path`` if it is a regular file of sane size (a FIFO would block
    the read forever); None if there is none (or it is unreadable or malformed)."""
    if path is None or not os.path.lexists(path):
        return None
    regular_file(path, "stats snapshot", MAX_CONFIG_BYTES)
    return read_snapshot(path)


def load_config_file(path: Path, option: str = "--config", *,
                     create_dirs: bool = True) -> KvtierConfig:
    """The config at ``path``, after the checks above (a regular, non-empty file of at most
    ``MAX_CONFIG_BYTES``). ``create_dirs=False`` for a command that only reads what it names
    (``stats``, ``events``): nothing is created."""
    regular_file(path, option, MAX_CONFIG_BYTES)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {option} {str(path)!r}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:  # grew between the check and the read
        raise ConfigError(f"{option} {str(path)!r} is larger than {format_size(MAX_CONFIG_BYTES)}")
    if not _holds_settings(raw.decode("utf-8", errors="replace")):
        raise ConfigError(f"{option} {str(path)!r} holds no settings (empty, or only "
                          "comments); give at least one, e.g. tiers.cpu.capacity")
    return load_config(path, create_dirs=create_dirs)
