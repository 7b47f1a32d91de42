"""``diagnostics/hook_cost.py``: the hooks' wrapper adds each call's time and count."""

from __future__ import annotations

import collections

import hook_cost


def test_timed_hooks_add_their_time_and_calls_and_keep_results_and_errors():
    class Hooks:
        def build_connector_meta(self, x):
            return x + 1

        def wait_for_save(self):
            raise RuntimeError("boom")

    totals, counts = collections.defaultdict(float), collections.defaultdict(int)
    hook_cost.timed(Hooks, ("build_connector_meta", "wait_for_save", "absent"), totals, counts,
                    "hook.")
    h = Hooks()
    assert h.build_connector_meta(1) == 2 and h.build_connector_meta(2) == 3
    try:
        h.wait_for_save()
    except RuntimeError:
        pass
    assert counts == {"hook.build_connector_meta": 2, "hook.wait_for_save": 1}
    assert totals["hook.build_connector_meta"] > 0
