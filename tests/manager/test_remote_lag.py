"""The shared tier's write-lag log line: first loss at once, then at most one per interval,
each saying how many blocks the window lost and wrote."""

from __future__ import annotations

import logging

from kvtier.manager.remote.lag import WriteLagNotice


def test_a_loss_is_logged_once_per_interval_with_the_windows_counts(caplog):
    now = [100.0]
    lag = WriteLagNotice(interval_s=60.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="kvtier.manager.remote.lag")
    lag.written(10)
    now[0] = 130.0
    lag.lost(3)
    assert lag.lines == 1
    assert "3 blocks left this instance before their write in the last 30 s (10 written)" \
        in caplog.records[-1].getMessage()
    now[0] = 150.0
    lag.written(5)
    lag.lost(2)  # within the interval: counted, not logged
    now[0] = 189.0
    lag.lost(1)
    assert lag.lines == 1 and len(caplog.records) == 1
    now[0] = 191.0
    lag.lost(4)  # the next line reports everything since the last one
    assert lag.lines == 2
    assert "7 blocks left this instance before their write in the last 61 s (5 written)" \
        in caplog.records[-1].getMessage()


def test_writes_alone_never_log(caplog):
    lag = WriteLagNotice(clock=lambda: 0.0)
    caplog.set_level(logging.WARNING, logger="kvtier.manager.remote.lag")
    lag.written(1000)
    assert lag.lines == 0 and not caplog.records
