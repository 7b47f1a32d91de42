"""Which vLLM is loaded, and the releases kvtier is tested with.

The connector API kvtier needs is the same on 0.32, 0.33 and 0.34 apart from what the sibling
adapters cover; an untested release gets a warning, not a refusal (its API may well fit).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ("0.32", "0.33", "0.34")


def vllm_version() -> str:
    try:
        from vllm import __version__ as version
    except ImportError:  # pragma: no cover - the connector cannot load without vLLM anyway
        return "unknown"
    return str(version)


def release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a version string such as ``0.33.0`` or ``0.32.1.dev3+g1234``;
    (0, 0) when it cannot be read."""
    parts = (version or vllm_version()).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def is_supported(version: str | None = None) -> bool:
    return "%d.%d" % release(version) in SUPPORTED_VLLM


def check_version() -> None:
    version = vllm_version()
    if not is_supported(version):
        log.warning("kvtier: tested with vLLM %s; this is vLLM %s", ", ".join(SUPPORTED_VLLM),
                    version)
