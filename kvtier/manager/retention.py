"""The manager's side of retention hints: ``set_retention(request_id, hint)``.

A hint given for a request (by the connector, from ``kv_transfer_params``) is applied to the
blocks that request stores (``prepare_store`` with its ``RequestContext.request_id``). The hint
book and the hinted eviction wrapper are installed on the CPU tier at the first hint, so a
deployment that never sends hints pays nothing. Kept blocks are never pinned: a hint only
reorders what the policies choose (see ``kvtier.manager.hints``).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from kvtier.manager.admission import AdmissionPolicy
from kvtier.manager.hints import HintBook, RetentionHint
from kvtier.manager.policies.hinted import HintedEviction
from kvtier.manager.specs import BlockKey, RequestContext
from kvtier.manager.index.tier_index import TierIndex

log = logging.getLogger(__name__)
MAX_REQUESTS = 1 << 16  # hints of requests not yet stored (oldest dropped)


class RetentionHints:
    """Hints by request, and the hint book they feed.

    Built by the tiered manager with the CPU tier (whose eviction policy the first hint wraps
    in :class:`~kvtier.manager.policies.hinted.HintedEviction`) and the CPU admission (given
    the book too when it reads hints). ``book``: None until the first hint; ``by_request``:
    the hints of requests whose blocks were not stored yet, at most ``MAX_REQUESTS``."""

    def __init__(self, cpu: TierIndex, admission: AdmissionPolicy) -> None:
        self._cpu = cpu
        self._admission = admission
        self.book: HintBook | None = None
        self.by_request: dict[str, RetentionHint] = {}

    def set(self, request_id: str, hint: RetentionHint | None) -> None:
        """``set_retention``: remember ``hint`` for the blocks ``request_id`` stores."""
        if hint is None:
            return
        if self.book is None:
            self.book = HintBook(max(1, self._cpu.capacity // 2))
            self._cpu.policy = HintedEviction(self._cpu.policy, self.book)
            if hasattr(self._admission, "hints"):
                self._admission.hints = self.book
        pending = self.by_request
        pending[request_id] = hint
        if len(pending) > MAX_REQUESTS:
            del pending[next(iter(pending))]

    def note(self, keys: Sequence[BlockKey], ctx: RequestContext | None) -> None:
        """``prepare_store``: the hint of the request ``ctx`` names applies to ``keys``."""
        if self.by_request and ctx is not None:
            hint = self.by_request.get(ctx.request_id)
            if hint is not None:
                self.book.note(keys, hint)


def apply_retention_hint(manager: Any, request_id: str, params: Mapping[str, Any] | None,
                         kv_hints: Sequence[Any] = ()) -> None:
    """Connector helper: parse ``kv_transfer_params['kvtier_retention']``, else the request's
    vLLM ``kv_hints`` retention action, and hand the hint to the manager. A malformed hint is
    logged and ignored (hints are never needed for correctness); a malformed
    ``kv_transfer_params`` hint does not fall back to ``kv_hints``."""
    try:
        hint = RetentionHint.parse(params)
        if hint is None and kv_hints:
            hint = RetentionHint.from_kv_hints(kv_hints)
    except ValueError as exc:
        log.warning("kvtier: ignoring retention hint of request %s: %s", request_id, exc)
        return
    if hint is not None:
        manager.set_retention(request_id, hint)
