"""Log lines: a process's own fields on every line, and a recurring warning logged at most once
per interval, saying how many it held back."""

from __future__ import annotations

import json
import logging

import pytest

from kvswitch.logs import LogSettings, Throttled, configure_logging, log_settings


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


def test_a_process_s_own_fields_follow_the_level_on_every_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", process_fields={"worker_id": "worker-1"})
        logging.getLogger("kvswitch.test").info("ready", extra={"request_id": "r1"})
        line = capsys.readouterr().err.strip()
        assert line.split(" ", 1)[1] == (
            "level=INFO worker_id=worker-1 logger=kvswitch.test msg=ready request_id=r1"
        )
        # what an engine core process is started with: the same format and fields
        assert log_settings() == LogSettings(logging.INFO, False, (("worker_id", "worker-1"),))
        configure_logging("WARNING", json=True, process_fields={"worker_id": "w2"})
        logging.getLogger("kvswitch.test").warning("slow")
        record = json.loads(capsys.readouterr().err)
        assert list(record)[:4] == ["ts", "level", "worker_id", "logger"]
        assert record["worker_id"] == "w2"
        assert log_settings() == LogSettings(logging.WARNING, True, (("worker_id", "w2"),))
    finally:
        root.handlers[:], root.level = saved
