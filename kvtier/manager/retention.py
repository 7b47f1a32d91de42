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

from kvtier.manager.hints import HintBook, RetentionHint
from kvtier.manager.policies.hinted import HintedEviction
from kvtier.manager.specs import BlockKey, RequestContext

log = logging.getLogger(__name__)
MAX_REQUESTS = 1 << 16  # hints of requests not yet stored (oldest dropped)


class RetentionHints:
    """Mixin for the tiered manager (needs ``self.cpu`` and ``self.cpu_admission``)."""

    hints: HintBook | None = None
    _request_hints: dict[str, RetentionHint] | None = None

    def set_retention(self, request_id: str, hint: RetentionHint | None) -> None:
        if hint is None:
            return
        if self.hints is None:
            self.hints = HintBook(max(1, self.cpu.capacity // 2))
            self._request_hints = {}
            self.cpu.policy = HintedEviction(self.cpu.policy, self.hints)
            if hasattr(self.cpu_admission, "hints"):
                self.cpu_admission.hints = self.hints
        pending = self._request_hints
        pending[request_id] = hint
        if len(pending) > MAX_REQUESTS:
            del pending[next(iter(pending))]

    def _note_hints(self, keys: Sequence[BlockKey], ctx: RequestContext | None) -> None:
        if self._request_hints and ctx is not None:
            hint = self._request_hints.get(ctx.request_id)
            if hint is not None:
                self.hints.note(keys, hint)


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
