"""Per-request ``kv_hints`` (vLLM's ``KvHintsEnvelope``: orchestrator-provided actions such
as retention hints) as plain kvtier data for the placement layer.

vLLM validates only the envelope; each action's ``payload`` schema belongs to whoever
implements the action, so kvtier passes every action through unchanged (type, version, id,
payload) and lets the manager's placement policies pick the ones they understand. A request
without hints, or a vLLM without the attribute, gives ``()``. Malformed actions are skipped:
a hint must never fail a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class KvHint:
    action_type: str
    action_version: str
    action_id: str = ""
    payload: Mapping[str, Any] = field(default_factory=dict)


def request_hints(request: Any) -> tuple[KvHint, ...]:
    envelope = getattr(request, "kv_hints", None)
    actions = getattr(envelope, "actions", None) or ()
    out: list[KvHint] = []
    for action in actions:
        kind = getattr(action, "action_type", None)
        version = getattr(action, "action_version", None)
        payload = getattr(action, "payload", None)
        if not isinstance(kind, str) or not isinstance(version, str):
            continue
        out.append(KvHint(kind, version, str(getattr(action, "action_id", "") or ""),
                          dict(payload) if isinstance(payload, Mapping) else {}))
    return tuple(out)
