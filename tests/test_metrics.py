"""The /metrics endpoint helper, the router's metrics and the log line formats."""

from __future__ import annotations

import json
import logging
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from kvswitch.logs import JsonFormatter, KeyValueFormatter, configure_logging, log_format_from_env
from kvswitch.metrics import start_metrics_server
from kvswitch.router.metrics import RouterMetrics, WorkerLoadSample
from kvswitch.router.outcome import Outcome
from kvswitch.v1 import common_pb2, router_pb2


def _get(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_metrics_server_serves_its_registry_and_stops() -> None:
    registry = CollectorRegistry()
    Counter("kvswitch_test_things", "Things", registry=registry).inc(3)
    server = start_metrics_server(registry, "127.0.0.1", 0)
    try:
        host, port = server.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert "kvswitch_test_things_total 3.0" in _get(server.address).splitlines()
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):
        _get(server.address)


def test_metrics_server_refuses_a_taken_port() -> None:
    server = start_metrics_server(CollectorRegistry(), "127.0.0.1", 0)
    try:
        port = int(server.address.rsplit(":", 1)[1])
        with pytest.raises(OSError):
            start_metrics_server(CollectorRegistry(), "127.0.0.1", port)
    finally:
        server.stop()


def test_router_metrics_record_requests() -> None:
    metrics = RouterMetrics()
    metrics.requests.finished(
        "stop", ttft_s=0.2, num_prompt_tokens=100, num_cached_tokens=64, num_output_tokens=8
    )
    # No first token: counted by reason, its prompt left out of the cached-token ratio.
    metrics.requests.finished("unavailable", num_prompt_tokens=50)

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert value("kvswitch_router_requests_total", finish_reason="stop") == 1
    assert value("kvswitch_router_requests_total", finish_reason="unavailable") == 1
    assert value("kvswitch_router_requests_total", finish_reason="length") == 0
    assert value("kvswitch_router_ttft_seconds_count") == 1
    assert value("kvswitch_router_ttft_seconds_sum") == 0.2
    assert value("kvswitch_router_ttft_seconds_bucket", le="0.1") == 0
    assert value("kvswitch_router_ttft_seconds_bucket", le="0.25") == 1
    assert value("kvswitch_router_prompt_tokens_total") == 100
    assert value("kvswitch_router_cached_prompt_tokens_total") == 64
    assert value("kvswitch_router_output_tokens_total") == 8


def test_router_metrics_record_routing() -> None:
    metrics = RouterMetrics()
    metrics.routed("cost", "lowest cost", "w1")
    metrics.routed("cost", "lowest cost", "w1")
    metrics.routed("cost", "failover: no cached prefix: lowest load", "w2")
    metrics.index_lookup(0.0003)
    metrics.failed_over("before_first_token")

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    decisions = "kvswitch_router_routing_decisions_total"
    assert value(decisions, policy="cost", reason="lowest cost", worker_id="w1") == 2
    reason = "failover: no cached prefix: lowest load"
    assert value(decisions, policy="cost", reason=reason, worker_id="w2") == 1
    assert value(decisions, policy="cost", reason="lowest cost", worker_id="w2") is None
    assert value("kvswitch_router_index_lookup_seconds_count") == 1
    assert value("kvswitch_router_index_lookup_seconds_bucket", le="0.00025") == 0
    assert value("kvswitch_router_index_lookup_seconds_bucket", le="0.0005") == 1
    assert value("kvswitch_router_failovers_total", kind="before_first_token") == 1
    assert value("kvswitch_router_failovers_total", kind="mid_stream") == 0


def test_router_metrics_record_timings() -> None:
    metrics = RouterMetrics()
    metrics.inter_token(0.02)
    metrics.inter_token(0.004)
    metrics.served(1.5, 0.003, 48)
    metrics.overloaded("workers_full")

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    itl = "kvswitch_router_inter_token_latency_seconds"
    assert value(f"{itl}_count") == 2 and value(f"{itl}_sum") == 0.024
    assert value(f"{itl}_bucket", le="0.005") == 1
    assert value(f"{itl}_bucket", le="0.02") == 2
    e2e, queue = (
        "kvswitch_router_e2e_request_latency_seconds",
        "kvswitch_router_request_queue_time_seconds",
    )
    assert (value(f"{e2e}_count"), value(f"{e2e}_sum")) == (1, 1.5)
    assert (value(f"{e2e}_bucket", le="1.0"), value(f"{e2e}_bucket", le="2.5")) == (0, 1)
    assert (value(f"{queue}_count"), value(f"{queue}_sum")) == (1, 0.003)
    assert value(f"{queue}_bucket", le="0.0025") == 0
    assert value(f"{queue}_bucket", le="0.005") == 1
    assert value("kvswitch_router_predicted_cached_prompt_tokens_total") == 48
    overloaded = "kvswitch_router_overloaded_requests_total"
    assert value(overloaded, cause="workers_full") == 1
    assert value(overloaded, cause="client_streams") == 0


def test_an_outcome_records_its_timings_and_transfers_once() -> None:
    metrics = RouterMetrics()

    def value(name: str) -> float | None:
        return metrics.registry.get_sample_value(name)

    # No first token: its timings and predicted hits are left out.
    Outcome("r1", metrics).record()
    assert value("kvswitch_router_e2e_request_latency_seconds_count") == 0

    outcome = Outcome("r2", metrics, ttft_s=0.1, queue_s=0.002, num_predicted_cached_tokens=32)
    stats = common_pb2.RequestStats(
        num_prompt_tokens=40, num_cached_tokens=16, num_output_tokens=4, num_transferred_blocks=3
    )
    outcome.finished(
        router_pb2.GenerateFinal(finish_reason=common_pb2.FINISH_REASON_LENGTH, stats=stats)
    )
    outcome.record()  # the handler's finally: nothing more
    assert value("kvswitch_router_e2e_request_latency_seconds_count") == 1
    assert value("kvswitch_router_request_queue_time_seconds_sum") == 0.002
    assert value("kvswitch_router_predicted_cached_prompt_tokens_total") == 32
    assert value("kvswitch_router_cached_prompt_tokens_total") == 16
    assert value("kvswitch_router_kv_transfers_total") == 1
    assert value("kvswitch_router_kv_transferred_blocks_total") == 3


def test_router_worker_gauges_are_read_at_scrape_time() -> None:
    loads = [WorkerLoadSample("w1", 2, 300), WorkerLoadSample("w2", 0, 0)]
    metrics = RouterMetrics(worker_loads=lambda: loads)
    in_flight, outstanding = (
        "kvswitch_router_worker_in_flight_requests",
        "kvswitch_router_worker_outstanding_tokens",
    )
    assert metrics.registry.get_sample_value(in_flight, {"worker_id": "w1"}) == 2
    assert metrics.registry.get_sample_value(outstanding, {"worker_id": "w1"}) == 300
    assert metrics.registry.get_sample_value(in_flight, {"worker_id": "w2"}) == 0

    loads = [WorkerLoadSample("w2", 1, 40)]  # w1 left
    assert metrics.registry.get_sample_value(in_flight, {"worker_id": "w1"}) is None
    assert metrics.registry.get_sample_value(outstanding, {"worker_id": "w2"}) == 40


def test_router_metrics_serve() -> None:
    metrics = RouterMetrics()
    metrics.failed_over("mid_stream")
    server = start_metrics_server(metrics.registry, "127.0.0.1", 0)
    try:
        lines = _get(server.address).splitlines()
    finally:
        server.stop()
    assert 'kvswitch_router_failovers_total{kind="mid_stream"} 1.0' in lines


# -- logs -----------------------------------------------------------------------------------------


def _record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.getLogger("kvswitch.worker.server").makeRecord(
        "kvswitch.worker.server", logging.INFO, __file__, 1, msg, args, None, extra=extra
    )
    record.created, record.msecs = 1738324800.123, 123.0  # 2025-01-31T12:00:00.123Z
    return record


def test_key_value_lines_carry_the_request_id() -> None:
    record = _record("stop after %d tokens", 8, request_id="r-1")
    assert KeyValueFormatter().format(record) == (
        "ts=2025-01-31T12:00:00.123Z level=INFO logger=kvswitch.worker.server "
        'msg="stop after 8 tokens" request_id=r-1'
    )
    record = _record('a "quoted"\nvalue=1', request_id="has space")
    assert (
        KeyValueFormatter()
        .format(record)
        .endswith(r'msg="a \"quoted\"\nvalue=1" request_id="has space"')
    )


def test_json_lines_parse() -> None:
    record = _record("stop after %d tokens", 8, request_id="r-1")
    assert json.loads(JsonFormatter().format(record)) == {
        "ts": "2025-01-31T12:00:00.123Z",
        "level": "INFO",
        "logger": "kvswitch.worker.server",
        "msg": "stop after 8 tokens",
        "request_id": "r-1",
    }
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = _record("failed")
        record.exc_info = sys.exc_info()
    fields = json.loads(JsonFormatter().format(record))
    assert "request_id" not in fields
    assert fields["exc"].startswith("Traceback") and "RuntimeError: boom" in fields["exc"]


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_configure_logging_writes_json_to_stderr(
    root_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("DEBUG", json=True)
    logging.getLogger("kvswitch.router.server").debug("routed", extra={"request_id": "r-2"})
    fields = json.loads(capsys.readouterr().err)
    assert (fields["level"], fields["msg"], fields["request_id"]) == ("DEBUG", "routed", "r-2")

    configure_logging()  # INFO, key=value
    logging.getLogger("kvswitch.router.server").debug("hidden")
    logging.getLogger("kvswitch.router.server").info("shown")
    assert capsys.readouterr().err.endswith(" level=INFO logger=kvswitch.router.server msg=shown\n")


def test_log_format_from_env() -> None:
    assert log_format_from_env({}) == "text"
    assert log_format_from_env({"KVSWITCH_LOG_FORMAT": ""}) == "text"
    assert log_format_from_env({"KVSWITCH_LOG_FORMAT": "json"}) == "json"
    with pytest.raises(ValueError, match="KVSWITCH_LOG_FORMAT must be text or json, got 'xml'"):
        log_format_from_env({"KVSWITCH_LOG_FORMAT": "xml"})


def test_log_level_comes_from_the_environment() -> None:
    from kvswitch.logs import log_level_from_env

    assert log_level_from_env({}) == "INFO"
    assert log_level_from_env({"KVSWITCH_LOG_LEVEL": "debug"}) == "DEBUG"
    with pytest.raises(ValueError, match="KVSWITCH_LOG_LEVEL"):
        log_level_from_env({"KVSWITCH_LOG_LEVEL": "loud"})
