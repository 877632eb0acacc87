"""A ``/metrics`` page the size and shape of a vLLM server's, for stub engines.

A router polls each engine's load from its ``/metrics`` (``router/engine_load.py``), and what that
costs is set by the page: a vLLM v1 server's holds, beside the few gauges a router reads, the
HTTP server's histograms per handler, the process's and Python's collectors, and per engine
(data-parallel rank) about a dozen request histograms of 5 to 25 buckets each.
``vllm_metrics_page`` writes such a page with the load given (about 50 KB and 600 lines for
one engine); the families are vLLM's by name, the values made up.
"""

from __future__ import annotations

from collections.abc import Sequence

_SECONDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
_SECONDS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_HTTP_SECONDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0)
_HTTP_SECONDS += (3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)
_HANDLERS = ("/v1/completions", "/v1/chat/completions", "/metrics", "/health", "/v1/models")
_REQUEST_HISTOGRAMS = (
    ("vllm:request_prompt_tokens", _TOKENS),
    ("vllm:request_generation_tokens", _TOKENS),
    ("vllm:iteration_tokens_total", _TOKENS),
    ("vllm:request_max_num_generation_tokens", _TOKENS),
    ("vllm:request_params_n", (1, 2, 5, 10, 20)),
    ("vllm:request_params_max_tokens", _TOKENS),
    ("vllm:time_to_first_token_seconds", _SECONDS),
    ("vllm:inter_token_latency_seconds", _SECONDS),
    ("vllm:e2e_request_latency_seconds", _SECONDS),
    ("vllm:request_queue_time_seconds", _SECONDS),
    ("vllm:request_inference_time_seconds", _SECONDS),
    ("vllm:request_prefill_time_seconds", _SECONDS),
    ("vllm:request_decode_time_seconds", _SECONDS),
)


def vllm_metrics_page(
    model: str,
    *,
    engines: Sequence[str] = ("0",),
    num_running: int = 0,
    num_waiting: int = 0,
    kv_cache_usage: float = 0.0,
    block_size: int = 16,
    num_blocks: int = 4096,
) -> str:
    """The page of a server of ``model`` with data-parallel ``engines``, each with this load."""
    page = _Page()
    for name in ("collected", "uncollectable"):
        family = f"python_gc_objects_{name}_total"
        page.family(
            family, "counter", [f'{family}{{generation="{g}"}} {g * 97}.0' for g in (0, 1, 2)]
        )
    for name in ("virtual_memory_bytes", "resident_memory_bytes", "cpu_seconds_total"):
        page.family(f"process_{name}", "gauge", [f"process_{name} 1.5e+09"])
    page.family(
        "http_requests_total",
        "counter",
        [
            f'http_requests_total{{handler="{h}",method="POST",status="2xx"}} 12.0'
            for h in _HANDLERS
        ],
    )
    for name in ("http_request_duration_seconds", "http_request_size_bytes"):
        samples = []
        for handler in _HANDLERS:
            labels = f'handler="{handler}",method="POST"'
            samples += _histogram(name, labels, _HTTP_SECONDS)
        page.family(name, "histogram", samples)
    for engine in engines:
        labels = f'engine="{engine}",model_name="{model}"'
        page.family(
            "vllm:num_requests_running",
            "gauge",
            [f"vllm:num_requests_running{{{labels}}} {num_running}.0"],
        )
        page.family(
            "vllm:num_requests_waiting",
            "gauge",
            [f"vllm:num_requests_waiting{{{labels}}} {num_waiting}.0"],
        )
        page.family(
            "vllm:kv_cache_usage_perc",
            "gauge",
            [f"vllm:kv_cache_usage_perc{{{labels}}} {kv_cache_usage}"],
        )
        for name in (
            "prefix_cache_queries",
            "prefix_cache_hits",
            "prompt_tokens",
            "generation_tokens",
        ):
            page.family(f"vllm:{name}_total", "counter", [f"vllm:{name}_total{{{labels}}} 4321.0"])
        page.family(
            "vllm:request_success_total",
            "counter",
            [
                f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} 7.0'
                for reason in ("stop", "length", "abort")
            ],
        )
        for name, buckets in _REQUEST_HISTOGRAMS:
            page.family(name, "histogram", _histogram(name, labels, buckets))
        page.family(
            "vllm:cache_config_info",
            "gauge",
            [
                f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",'
                f'{labels},num_cpu_blocks="None",num_gpu_blocks="{num_blocks}"}} 1.0'
            ],
        )
    return page.text()


class _Page:
    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(self, name: str, kind: str, samples: list[str]) -> None:
        self._lines += [
            f"# HELP {name} {name.split(':')[-1].replace('_', ' ')}.",
            f"# TYPE {name} {kind}",
        ]
        self._lines += samples

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _histogram(name: str, labels: str, buckets: Sequence[float]) -> list[str]:
    samples = [f'{name}_bucket{{{labels},le="{float(b)}"}} 7.0' for b in buckets]
    samples.append(f'{name}_bucket{{{labels},le="+Inf"}} 7.0')
    return [*samples, f"{name}_count{{{labels}}} 7.0", f"{name}_sum{{{labels}}} 1.5"]
