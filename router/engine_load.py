"""An OpenAI-API engine's load as its Prometheus ``/metrics`` tells it: vLLM's gauges
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``, and the KV cache's usage as
``vllm:kv_cache_usage_perc``, or ``vllm:gpu_cache_usage_perc`` from older servers: a fraction
from 0 to 1, whatever the name says). A kvswitch worker exports the same gauges.

A server with several engines (data-parallel ranks) labels each: their requests add up, and the
usage is the fullest one's (the one a new request might wait on). The cache's size in blocks
comes from ``vllm:cache_config_info``'s ``num_gpu_blocks`` label, where the server exports it."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

CACHE_CONFIG = "vllm:cache_config_info"  # 1, the cache's settings its labels
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_GAUGES = (CACHE_CONFIG, RUNNING, WAITING, *USAGE)


class EngineMetricsError(ValueError):
    """The text is not Prometheus's, or holds none of vLLM's load gauges."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float  # 0 to 1; 0 when the engine does not say
    num_blocks: int = 0  # the cache's size (its engines' together); 0 when the engine does not say


def parse_engine_load(text: str) -> EngineLoad:
    """The load ``text`` (a ``/metrics`` page) gives: only the lines of the gauges above are
    parsed. NOTE: a vLLM server's page is tens of KB (hundreds of histogram lines); the whole of
    it through Prometheus's parser took 22 ms, and a router polls each engine every 0.1 s."""
    values: dict[str, list[float]] = {}
    num_blocks = 0
    try:
        for family in text_string_to_metric_families(_gauge_lines(text)):
            for sample in family.samples:
                values.setdefault(sample.name, []).append(sample.value)
                if sample.name == CACHE_CONFIG:
                    num_blocks += _int_label(sample.labels, "num_gpu_blocks")
    except ValueError as e:
        raise EngineMetricsError(f"not Prometheus text: {e}") from None
    if RUNNING not in values and WAITING not in values:
        raise EngineMetricsError(
            f"no {RUNNING} or {WAITING} gauge: not a vLLM server's (or a kvswitch worker's) "
            "/metrics"
        )
    usage = next((values[name] for name in USAGE if name in values), [0.0])
    return EngineLoad(
        round(sum(values.get(RUNNING, [0.0]))),
        round(sum(values.get(WAITING, [0.0]))),
        max(usage),
        num_blocks,
    )


def _gauge_lines(text: str) -> str:
    """The lines of ``text`` that start with a name of ``_GAUGES``, found by ``str.find`` (a
    longer name's among them: the parser names each sample; ``# HELP`` and ``# TYPE`` lines
    are left out)."""
    lines = []
    for name in _GAUGES:
        start = 0
        while (at := text.find(name, start)) >= 0:
            end = text.find("\n", at)
            start = end = len(text) if end < 0 else end
            if at == 0 or text[at - 1] == "\n":
                lines.append(text[at:end])
    return "\n".join(lines) + "\n"


def _int_label(labels: dict[str, str], name: str) -> int:
    try:
        return max(int(float(labels.get(name) or 0)), 0)
    except ValueError:  # "None" before the cache is sized
        return 0
