"""What a config is checked against on the machine that loads it: physical memory, and the
directories it creates.

A CPU tier larger than the machine's memory cannot work (the pool is allocated in full, in the
background, until the OOM killer ends the process: ``100TiB`` did exactly that), so it is refused
when the config is loaded, citing the line. Directories kvtier creates hold KV bytes of other
people's prompts, so each one it creates, parents included, is 0700 whatever the umask:
``Path.mkdir(parents=True)`` creates the parents with ``0777 & ~umask`` (0777 under umask 000).
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_DIR_MODE = 0o700


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine, or None where the OS does not say."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def make_private_dir(path: Path) -> list[Path]:
    """Create ``path`` and its missing parents, each mode 0700; return the ones created.

    Raises ``OSError`` like ``os.mkdir`` (a component that exists and is not a directory,
    no permission). A component another process creates meanwhile is accepted as it is."""
    missing: list[Path] = []
    p = Path(path)
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    created = []
    for d in reversed(missing):
        try:
            os.mkdir(d, PRIVATE_DIR_MODE)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue
        os.chmod(d, PRIVATE_DIR_MODE)  # mkdir's mode went through the umask
        created.append(d)
    return created
