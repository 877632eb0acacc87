"""``kvswitch health`` against a live worker: what container healthchecks run."""

from __future__ import annotations

import pytest

from kvswitch.app.cli import main
from kvswitch.worker.server import WorkerConfig
from tests.worker.background import BackgroundWorker


def health(*argv: str) -> int:
    """The exit status of ``kvswitch health ARGV``."""
    try:
        return main(["health", *argv])
    except SystemExit as e:
        return int(e.code or 0)


def test_health_says_whether_a_worker_serves(capsys: pytest.CaptureFixture[str]) -> None:
    worker = BackgroundWorker(WorkerConfig(port=0, kv_cache_bytes=16 << 20, grace_s=0.0))
    address = worker.server.address
    try:
        assert health("--target", address, "--service", "kvswitch.v1.Worker") == 0
        assert capsys.readouterr().out == f"{address}: SERVING\n"
        assert health("--target", address) == 0
    finally:
        worker.close()
    assert health("--target", address, "--timeout-s", "0.5") == 1
    assert f"{address}: UNAVAILABLE" in capsys.readouterr().err


def test_health_refuses_an_unknown_service(capsys: pytest.CaptureFixture[str]) -> None:
    assert health("--service", "kvswitch.v1.Nothing") == 2
    assert "service must be empty or one of" in capsys.readouterr().err
