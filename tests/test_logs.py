"""A recurring warning is logged at most once per interval, and says how many it held back."""

from __future__ import annotations

import logging

import pytest

from kvswitch.logs import Throttled


def test_a_recurring_warning_is_logged_once_per_interval(caplog: pytest.LogCaptureFixture):
    now = [0.0]
    logger = logging.getLogger("test.throttled")
    throttled = Throttled(logger, interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger.name):
        for second in [0, 1, 2, 9.9, 10, 15, 30]:
            now[0] = second
            throttled.warning("the index cannot answer (%s)", "refused")
    assert [r.getMessage() for r in caplog.records] == [
        "the index cannot answer (refused)",
        "the index cannot answer (refused) (and 3 more like it in the last 10 s)",
        "the index cannot answer (refused) (and 1 more like it in the last 10 s)",
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
