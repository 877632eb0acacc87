"""The monitoring files (deploy/monitoring/): the Grafana dashboard and the Prometheus alert rules
have the shape Grafana and Prometheus load, and every metric their PromQL selects is one that a
running router or worker exports; the router's request timings are observed for real requests.

``promtool`` is not used (it is not installed here): the rules are checked for their structure,
and their expressions only for the metrics they name.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvswitch.client import Client, GenerateResult, KvswitchError
from kvswitch.router.metrics import OVERLOAD_CAUSES
from tests.router.harness import (
    BLOCK_SIZE,
    ROUTER_CONFIG,
    WORKER_CONFIG,
    BackgroundCluster,
    paused_core,
    wait_until,
)

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
ALERTS = MONITORING / "alerts.yaml"
# Series Prometheus makes itself for every scrape target, not exported by anyone.
PROMETHEUS_SERIES = {"up"}
# Words of PromQL that are not metric names (functions are told by the parenthesis after them).
_PROMQL_WORDS = {
    *("sum", "min", "max", "avg", "count", "stddev", "stdvar", "group"),
    *("topk", "bottomk", "quantile", "count_values", "limitk", "limit_ratio"),
    *("by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool"),
    *("and", "or", "unless", "atan2", "Inf", "NaN", "inf", "nan"),
}
PROMPT = "| row | name | age |\n" * 6  # 6 blocks of bytes and a bit: cached when sent again


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings: label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges and subqueries, $__rate_interval included
    expr = re.sub(r"\boffset\s+-?\w+", "", expr)
    # Label lists: by (le), on (job, instance), group_left (worker_id), ...
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        name, is_call = match.groups()
        if not is_call and name not in _PROMQL_WORDS:
            names.add(name)
    return names


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))  # a collapsed row holds its panels

    return [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", [])]


def alert_exprs(rules: dict[str, Any]) -> list[str]:
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def unexported(exprs: Iterable[str], exported: set[str]) -> dict[str, set[str]]:
    """Each expression's metric names that nobody exports (none: an empty dict)."""
    missing = {expr: metric_names(expr) - exported - PROMETHEUS_SERIES for expr in exprs}
    return {expr: names for expr, names in missing.items() if names}


def test_metric_names_of_promql() -> None:
    assert metric_names(
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{kind="x y"}[$__rate_interval])))'
    ) == {"a_bucket"}
    assert metric_names("(1 - free / total) * on (job, instance) group_left (worker_id) info") == {
        "free",
        "total",
        "info",
    }
    assert metric_names("count by (w) (g offset 10m) unless count by (w) (g)") == {"g"}
    assert metric_names("up == 0 and on (job) max_over_time(x[1h]) > 1e-3") == {"up", "x"}


# -- the files ------------------------------------------------------------------------------------


def test_the_dashboard_is_a_grafana_model_on_a_prometheus_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panel_ids = [p["id"] for p in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
    for panel in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys()
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    exprs = " ".join(dashboard_exprs(dashboard))
    # What an operator looks for first: the latency percentiles, the hit rates, load, failures.
    for metric in [
        "kvswitch_router_requests_total",
        "kvswitch_router_ttft_seconds_bucket",
        "kvswitch_router_inter_token_latency_seconds_bucket",
        "kvswitch_router_e2e_request_latency_seconds_bucket",
        "kvswitch_router_request_queue_time_seconds_bucket",
        "kvswitch_router_predicted_cached_prompt_tokens_total",
        "kvswitch_router_cached_prompt_tokens_total",
        "kvswitch_router_worker_in_flight_requests",
        "kvswitch_worker_free_blocks",
        "kvswitch_router_index_errors_total",
        "kvswitch_router_failovers_total",
        "kvswitch_router_kv_transferred_blocks_total",
    ]:
        assert metric in exprs
    assert "histogram_quantile(0.99, sum by (le) (rate(kvswitch_router_ttft_seconds_bucket" in exprs


def test_the_alert_rules_are_prometheus_rule_groups() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    assert rules.keys() == {"groups"}
    group_names = [g["name"] for g in rules["groups"]]
    assert len(group_names) == len(set(group_names))
    alerts = {}
    for group in rules["groups"]:
        assert group.keys() <= {"name", "interval", "rules"} and group["rules"]
        for rule in group["rules"]:
            assert rule.keys() <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert re.fullmatch(r"[A-Z][A-Za-z]+", rule["alert"])
            assert re.fullmatch(r"\d+[smh]", rule["for"])
            assert rule["labels"]["severity"] in ("info", "warning", "critical")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
            assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
            alerts[rule["alert"]] = rule["expr"]
    assert len(alerts) == sum(len(g["rules"]) for g in rules["groups"])
    # A worker gone, index errors, a falling hit rate, overload refusals.
    assert "kvswitch_router_worker_in_flight_requests" in alerts["KvswitchWorkerGone"]
    assert "kvswitch_router_index_errors_total" in alerts["KvswitchRouterIndexErrors"]
    assert "kvswitch_router_cached_prompt_tokens_total" in alerts["KvswitchCacheHitRateFalling"]
    assert 'cause="workers_full"' in alerts["KvswitchOverloadRefusals"]


# -- against a running fleet ----------------------------------------------------------------------


@dataclasses.dataclass
class Scraped:
    router: dict[str, float]  # sample name (labels summed over): value
    exported: set[str]  # every sample name the router and the workers export
    results: list[GenerateResult]
    num_token_chunks: list[int]  # per request, the chunks that carried tokens


def _scrape(address: str) -> list[Any]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


@pytest.fixture(scope="module")
def scraped() -> Iterator[Scraped]:
    """A router and two workers, all serving ``/metrics``, after a few requests: the same prompt
    again and again (cached after the first), streamed until one came in two chunks or more."""
    cluster = BackgroundCluster(
        num_workers=2,
        router_config=dataclasses.replace(ROUTER_CONFIG, metrics_port=0),
        worker_config=dataclasses.replace(WORKER_CONFIG, metrics_port=0),
    )
    try:
        results, num_token_chunks = [], []
        with Client(cluster.address, timeout_s=30, max_retries=0) as client:
            # NOTE: how the worker cuts its output into chunks depends on timing; bounded.
            while len(results) < 2 or (max(num_token_chunks) < 2 and len(results) < 20):
                with client.stream(PROMPT, max_tokens=24) as stream:
                    num_token_chunks.append(sum(1 for chunk in stream if chunk.token_ids))
                    results.append(stream.result)
        router_samples = _scrape(cluster.router.metrics_address)
        worker_samples = [s for w in cluster.workers for s in _scrape(w.metrics_address)]
    finally:
        cluster.close()
    router: dict[str, float] = {}
    for sample in router_samples:
        if sample.name.endswith("_bucket"):
            continue  # summed over its buckets it means nothing
        router[sample.name] = router.get(sample.name, 0.0) + sample.value
    exported = {s.name for s in [*router_samples, *worker_samples]}
    yield Scraped(router, exported, results, num_token_chunks)


def test_every_metric_the_dashboard_and_the_rules_select_is_exported(scraped: Scraped) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    rules = yaml.safe_load(ALERTS.read_text())
    assert unexported(dashboard_exprs(dashboard), scraped.exported) == {}
    assert unexported(alert_exprs(rules), scraped.exported) == {}
    # The check catches a name nobody exports, and a histogram named without its suffix.
    wrong = [
        "sum(rate(kvswitch_router_time_to_first_token_seconds_bucket[5m]))",
        "kvswitch_router_ttft_seconds",
    ]
    assert unexported([*dashboard_exprs(dashboard), *wrong], scraped.exported) == {
        wrong[0]: {"kvswitch_router_time_to_first_token_seconds_bucket"},
        wrong[1]: {"kvswitch_router_ttft_seconds"},
    }


def test_the_router_times_each_request(scraped: Scraped) -> None:
    router, results = scraped.router, scraped.results
    num_requests = len(results)
    assert [r.finish_reason for r in results] == ["length"] * num_requests
    ttft, itl, e2e, queue = (
        "kvswitch_router_ttft_seconds",
        "kvswitch_router_inter_token_latency_seconds",
        "kvswitch_router_e2e_request_latency_seconds",
        "kvswitch_router_request_queue_time_seconds",
    )
    for histogram in (ttft, e2e, queue):
        assert router[f"{histogram}_count"] == num_requests, histogram
    # Each request: queue <= TTFT <= end to end, and its inter-token gaps (per token of their
    # chunk) add up to at most the time from its first token to its end.
    assert 0 < router[f"{queue}_sum"] <= router[f"{ttft}_sum"] <= router[f"{e2e}_sum"]
    # One observation per chunk after each request's first.
    assert max(scraped.num_token_chunks) >= 2
    assert router[f"{itl}_count"] == sum(n - 1 for n in scraped.num_token_chunks)
    assert 0 < router[f"{itl}_sum"] <= router[f"{e2e}_sum"] - router[f"{ttft}_sum"]


def test_the_router_counts_predicted_and_achieved_cache_hits(scraped: Scraped) -> None:
    router, results = scraped.router, scraped.results
    # What each routing decision expected the worker to hold: its matched blocks, less the
    # prompt's last token (always computed).
    predicted = [
        min(r.route.num_matched_blocks * BLOCK_SIZE, r.stats.num_prompt_tokens - 1) for r in results
    ]
    assert predicted[0] == 0 and max(predicted) > 0  # the same prompt, sent again
    assert router["kvswitch_router_predicted_cached_prompt_tokens_total"] == sum(predicted)
    achieved = sum(r.stats.num_cached_tokens for r in results)
    assert router["kvswitch_router_cached_prompt_tokens_total"] == achieved > 0
    assert router["kvswitch_router_kv_transfers_total"] == 0  # no P/D, no peer fetch here


@pytest.mark.parametrize(
    ("max_streams_per_client", "cause"), [(2, "workers_full"), (1, "client_streams")]
)
def test_overload_refusals_are_counted_by_cause(max_streams_per_client: int, cause: str) -> None:
    """One worker that runs one request at a time and queues none, its engine stopped while a
    request runs there: a second request is refused (RESOURCE_EXHAUSTED), because the worker is
    full or, where the router takes one stream per client, because its client has one open."""
    router_config = dataclasses.replace(
        ROUTER_CONFIG, metrics_port=0, max_streams_per_client=max_streams_per_client
    )
    worker_config = dataclasses.replace(WORKER_CONFIG, max_num_seqs=1, max_waiting_requests=0)
    with (
        BackgroundCluster(1, router_config, worker_config) as cluster,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        Client(cluster.address, max_retries=0) as client,
    ):
        worker = cluster.workers[0]
        with paused_core(worker):
            running = pool.submit(client.generate, PROMPT, max_tokens=2, timeout_s=120)
            wait_until(
                lambda: worker.engine.num_requests == 1 or running.done(), "the first request run"
            )
            with pytest.raises(KvswitchError) as refused:
                client.generate(PROMPT, max_tokens=2, timeout_s=60)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(running.result(timeout=120).token_ids) == 2
        samples = _scrape(cluster.router.metrics_address)
    overloaded = {
        s.labels["cause"]: s.value
        for s in samples
        if s.name == "kvswitch_router_overloaded_requests_total"
    }
    assert overloaded == {c: float(c == cause) for c in OVERLOAD_CAUSES}
