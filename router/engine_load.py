"""An OpenAI-API engine's load as its Prometheus ``/metrics`` tells it: vLLM's gauges
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``, and the KV cache's usage as
``vllm:kv_cache_usage_perc``, or ``vllm:gpu_cache_usage_perc`` from older servers: a fraction
from 0 to 1, whatever the name says). A kvswitch worker exports the same gauges.

A server with several engines (data-parallel ranks) labels each: their requests add up, and the
usage is the fullest one's (the one a new request might wait on). The cache's size in blocks
comes from ``vllm:cache_config_info``'s ``num_gpu_blocks`` label, where the server exports it."""

from __future__ import annotations

import re
from dataclasses import dataclass

CACHE_CONFIG = "vllm:cache_config_info"  # 1, the cache's settings its labels
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_GAUGES = (CACHE_CONFIG, RUNNING, WAITING, *USAGE)
# A sample's line in Prometheus's text format: its name, its labels (name="value" pairs in
# braces; a value may hold braces, commas and escaped quotes), its value, maybe a timestamp.
_LABEL_NAME = r"[a-zA-Z_][a-zA-Z0-9_]*"
_LABEL_VALUE = r'"(?:[^"\\\n]|\\.)*"'
_PAIR = rf"[ \t]*{_LABEL_NAME}[ \t]*=[ \t]*{_LABEL_VALUE}[ \t]*"
_SAMPLE = re.compile(
    rf"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{{(?:{_PAIR}(?:,{_PAIR})*,?)?[ \t]*\}})?[ \t]+(\S+)"
    r"(?:[ \t]+-?[0-9]+)?[ \t]*"
)
# One pair of a sample's labels, from the brace or comma before it: found one after another,
# each match ends where the next pair's comma is, never inside a value.
_LABEL = re.compile(rf"[{{,][ \t]*({_LABEL_NAME})[ \t]*=[ \t]*({_LABEL_VALUE})")


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
    parsed, by ``_SAMPLE``. NOTE: a vLLM server's page is tens of KB (hundreds of histogram
    lines) and a router polls each engine every 0.1 s: the whole page through prometheus_client's
    parser took 22 ms, this under 0.1 ms (``kvswitch bench lookup``'s ``engine_page_parse_us``)."""
    values: dict[str, list[float]] = {}
    num_blocks = 0
    for line in _gauge_lines(text):
        sample = _SAMPLE.fullmatch(line)
        if sample is None:
            raise EngineMetricsError(f"not Prometheus text: {line[:200]!r}")
        name, labels, value = sample.groups()
        if name not in _GAUGES:
            continue  # a longer name that starts with one of theirs
        try:
            values.setdefault(name, []).append(float(value))
        except ValueError:
            raise EngineMetricsError(f"not Prometheus text: {line[:200]!r}") from None
        if name == CACHE_CONFIG and labels:
            pairs = {pair[1]: pair[2][1:-1] for pair in _LABEL.finditer(labels)}
            num_blocks += _count(pairs.get("num_gpu_blocks", ""))
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


def _gauge_lines(text: str) -> list[str]:
    """The lines of ``text`` that start with a name of ``_GAUGES``, found by ``str.find`` (a
    longer name's among them: the sample's name tells; ``# HELP`` and ``# TYPE`` lines are left
    out)."""
    lines = []
    for name in _GAUGES:
        start = 0
        while (at := text.find(name, start)) >= 0:
            end = text.find("\n", at)
            start = end = len(text) if end < 0 else end
            if at == 0 or text[at - 1] == "\n":
                lines.append(text[at:end].rstrip("\r"))
    return lines


def _count(text: str) -> int:
    try:
        return max(int(float(text or 0)), 0)
    except ValueError:  # "None" before the cache is sized
        return 0
