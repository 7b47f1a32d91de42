"""User errors (bad config, bad trace, bad directory) end with one line and status 2."""

from __future__ import annotations

import functools
import sys

from kvtier.bench.trace import TraceError
from kvtier.cli.terminal import echo_error
from kvtier.config import ConfigError
from kvtier.tiers.disk import DiskLayoutMismatch, DiskStoreBusy, NotADiskStore
from kvtier.tiers.disk.errors import DiskIndexUnreadable

USER_ERRORS = (ConfigError, TraceError, DiskLayoutMismatch, DiskStoreBusy, NotADiskStore,
               DiskIndexUnreadable)
EXIT_USAGE = 2


def user_errors(fn):
    """Print a user error as ``kvtier: error: ...`` and exit 2, with no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
            echo_error(str(exc))
            sys.exit(EXIT_USAGE)

    return wrapper
