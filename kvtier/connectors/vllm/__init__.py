"""kvtier as a vLLM 0.32 / 0.33 KV connector: ``KVTierConnector`` (:mod:`.connector`).

The halves vLLM builds apart live apart: :mod:`.scheduler` (the engine-core process: kvtier's
manager, plans every transfer, never touches a tensor) and :mod:`.worker` (each GPU worker:
CPU pool, disk store, transfer engine; executes, decides nothing). Both derive the same
:mod:`.settings`, exchange only :mod:`.metadata` each step and :mod:`.stats`, and, when both
run in one thread, the typed :mod:`.handoff`. Release differences live in :mod:`.compat`.

``kv_connector_module_path="kvtier.connectors.vllm"`` is the public path: the connector (and
with it vLLM) is imported on first use of the name, so the settings and metadata modules stay
importable where vLLM is not installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.connectors.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
