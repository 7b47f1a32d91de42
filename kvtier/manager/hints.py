"""Retention hints: what a router knows about a request that the block stream cannot show.

A router (or the client) may say, per request, through vLLM's ``kv_transfer_params``::

    {"kvtier_retention": {"priority": 1, "ttl_s": 600, "continues": true, "session": "abc"}}

``continues: true`` or ``priority > 0`` keeps the request's blocks (admitted even by a closed
gate, evicted only after every unhinted block); ``continues: false`` or ``priority < 0`` marks
a one-off, whose never-seen blocks are not written; ``ttl_s`` ends the hint (default
``DEFAULT_TTL_S``); ``session`` is recorded only. The same hint may come as a vLLM 0.33
``kv_hints`` action (``RetentionHint.from_kv_hints``; ``kv_transfer_params`` wins when a
request carries both). The fields and their spellings: docs/placement.md, "Retention hints".

Hints are optional and never needed for correctness: a missing, malformed or expired hint
ranks the block like any other (a malformed one is counted in ``HintBook.ignored``), and a kept
block is still evicted when nothing unhinted is left. The book holds at most ``max_keys`` blocks
(oldest hint dropped first), so a router that marks everything cannot pin the tier."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

from kvtier.manager.index.keyed_list import KeyedList

PARAM_KEY = "kvtier_retention"
DEFAULT_TTL_S = 3600.0
KEEP, NONE, ONE_OFF = 1, 0, -1
KV_HINT_TYPES = ("kvtier_retention", "retention")  # kv_hints action types read as a hint
KV_HINT_VERSIONS = ("1", "1.0", "v1")
_KV_HINT_ALIASES = {"ttl": "ttl_s", "ttl_seconds": "ttl_s", "session_id": "session"}
ONE_OFF_KEYS = 1 << 16  # one-off marks remembered (the blocks of the requests in flight)


@dataclass(frozen=True)
class RetentionHint:
    rank: int = NONE  # KEEP, NONE or ONE_OFF
    ttl_s: float = DEFAULT_TTL_S
    session: str | None = None

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None) -> "RetentionHint | None":
        """The hint in a request's ``kv_transfer_params`` (None when absent). Raises
        ValueError naming the field when it is malformed."""
        if not params or PARAM_KEY not in params:
            return None
        raw = params[PARAM_KEY]
        if not isinstance(raw, Mapping):
            raise ValueError(f"{PARAM_KEY} must be an object, got {type(raw).__name__}")
        unknown = set(raw) - {"priority", "ttl_s", "continues", "session"}
        if unknown:
            raise ValueError(f"{PARAM_KEY}: unknown field(s) {sorted(unknown)}; allowed: "
                             "priority, ttl_s, continues, session")
        rank = NONE
        priority = raw.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, (int, float)):
            raise ValueError(f"{PARAM_KEY}.priority must be a number, got {priority!r}")
        if priority:
            rank = KEEP if priority > 0 else ONE_OFF
        continues = raw.get("continues")
        if continues is not None:
            if not isinstance(continues, bool):
                raise ValueError(f"{PARAM_KEY}.continues must be true or false")
            rank = KEEP if continues else ONE_OFF
        ttl = raw.get("ttl_s", DEFAULT_TTL_S)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= 1e7:
            raise ValueError(f"{PARAM_KEY}.ttl_s must be a number of seconds in (0, 1e7]")
        session = raw.get("session")
        if session is not None and not isinstance(session, (str, int)):
            raise ValueError(f"{PARAM_KEY}.session must be a string")
        return cls(rank, float(ttl), None if session is None else str(session)[:128])

    @classmethod
    def from_kv_hints(cls, actions: Sequence[Any]) -> "RetentionHint | None":
        """The hint in a request's ``kv_hints`` actions (objects with ``action_type``,
        ``action_version`` and ``payload``): the first retention action; None when there is
        none. Raises ValueError when that action's version or fields are malformed."""
        for action in actions:
            kind = getattr(action, "action_type", None)
            if not isinstance(kind, str) or kind.lower() not in KV_HINT_TYPES:
                continue
            version = getattr(action, "action_version", None)
            if version not in KV_HINT_VERSIONS:
                raise ValueError(f"kv_hints {kind}: unsupported action_version {version!r}; "
                                 f"supported: {', '.join(KV_HINT_VERSIONS)}")
            payload = getattr(action, "payload", None)
            if not isinstance(payload, Mapping):
                raise ValueError(f"kv_hints {kind}: payload must be an object")
            raw: dict[str, Any] = {}
            for name, value in payload.items():
                name = _KV_HINT_ALIASES.get(name, name)
                if name == "one_off":
                    if not isinstance(value, bool):
                        raise ValueError(f"kv_hints {kind}: one_off must be true or false")
                    name, value = "continues", not value
                if name in ("priority", "ttl_s", "continues", "session"):
                    if name in raw:
                        raise ValueError(f"kv_hints {kind}: {name} given twice")
                    raw[name] = value
            return cls.parse({PARAM_KEY: raw})
        return None


class HintBook:
    """Block key -> hinted rank until a deadline. O(1) per key; bounded."""

    def __init__(self, max_keys: int, clock=time.monotonic) -> None:
        self._keys = KeyedList(max(1, max_keys))  # kept: key -> deadline_ms * 4 + rank + 1
        # One-off marks matter only until the request's store (admission), so they live in a
        # short map of their own and never push kept blocks out.
        self._once = KeyedList(ONE_OFF_KEYS)
        self._clock = clock
        self.ignored = 0  # malformed hints, ranked as none
        self.sessions: set[str] = set()

    def note(self, keys: Sequence[Hashable], hint: RetentionHint | None) -> None:
        if hint is None or hint.rank == NONE:
            return
        if hint.session is not None and len(self.sessions) < 100_000:
            self.sessions.add(hint.session)
        packed = int((self._clock() + hint.ttl_s) * 1000) * 4 + hint.rank + 1
        book = self._keys if hint.rank == KEEP else self._once
        for key in keys:
            book.push_bounded(key, packed)

    def rank(self, key: Hashable) -> int:
        book = self._keys
        packed = book.get(key)
        if packed is None:
            book = self._once
            packed = book.get(key)
            if packed is None:
                return NONE
        if (packed >> 2) < self._clock() * 1000:
            book.pop(key)
            return NONE
        return (packed & 3) - 1

    def __len__(self) -> int:
        """Blocks hinted *keep* (what eviction has to look at)."""
        return len(self._keys)
