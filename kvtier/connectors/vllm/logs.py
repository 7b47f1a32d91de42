"""kvtier's log lines inside vLLM's processes, where operators read vLLM's output.

vLLM configures its own ``vllm`` logger (a handler, a format, ``VLLM_LOGGING_LEVEL``) and
leaves the root logger alone. kvtier logs under ``kvtier.*``, so inside ``vllm serve`` its
records reached no handler: INFO lines (the connector's layout, the CPU pool's progress) were
dropped, and warnings came out through Python's last-resort handler, bare, without level,
time or source. ``share_vllm_logging`` gives the ``kvtier`` logger vLLM's handlers and level,
so kvtier's lines look like vLLM's and follow its level, unless the application configured
logging itself (a handler on ``kvtier`` or on the root logger): then nothing is changed.
"""

from __future__ import annotations

import logging

KVTIER_LOGGER = "kvtier"
VLLM_LOGGER = "vllm"


def share_vllm_logging() -> bool:
    """Route ``kvtier.*`` records through vLLM's handlers at vLLM's level; True if it did.
    Idempotent. Does nothing where vLLM has no handler (``VLLM_CONFIGURE_LOGGING=0``) or the
    application set up logging (a handler on the ``kvtier`` or the root logger)."""
    ours, vllm = logging.getLogger(KVTIER_LOGGER), logging.getLogger(VLLM_LOGGER)
    if ours.handlers or logging.getLogger().handlers or not vllm.handlers:
        return False
    for handler in vllm.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm.getEffectiveLevel())
    ours.propagate = False  # the root logger has no handler: nothing to print twice
    return True
