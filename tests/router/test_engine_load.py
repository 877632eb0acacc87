"""An engine's load from its Prometheus text: vLLM's own (as its servers export it) and a
kvswitch worker's, which exports the same gauges."""

from __future__ import annotations

import urllib.request

import pytest

from kvswitch.benchmarks.vllm_metrics import vllm_metrics_page
from kvswitch.router.engine_load import EngineLoad, EngineMetricsError, parse_engine_load
from kvswitch.worker.server import WorkerConfig
from tests.worker.background import BackgroundWorker

# What a vLLM server with two data-parallel engines exports (older versions name the KV usage
# gpu_cache_usage_perc), beside metrics of other kinds.
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.25
vllm:gpu_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.5
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 1234.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_cpu_blocks="None",num_gpu_blocks="2048"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_cpu_blocks="None",num_gpu_blocks="2048"} 1.0
"""


def test_a_vllm_servers_engines_add_up_and_the_fullest_cache_counts() -> None:
    assert parse_engine_load(VLLM_TEXT) == EngineLoad(5, 1, 0.5, 4096)
    # Without the cache's settings (or before its size is known), its size is not known.
    without = VLLM_TEXT.replace('num_gpu_blocks="2048"', 'num_gpu_blocks="None"')
    assert parse_engine_load(without).num_blocks == 0


def test_the_gauges_are_read_out_of_a_whole_vllm_page() -> None:
    page = vllm_metrics_page(
        "Qwen/Qwen3-0.6B",
        engines=("0", "1"),
        num_running=3,
        num_waiting=2,
        kv_cache_usage=0.25,
        num_blocks=2048,
    )
    assert page.count("\n") > 900  # two engines' histograms, the HTTP server's, the process's
    assert parse_engine_load(page) == EngineLoad(6, 4, 0.25, 4096)
    # NOTE: only whole names at a line's start count: not a longer name, not a comment's.
    traps = (
        "vllm:num_requests_running_by_adapter 40.0\n"
        "# HELP vllm:num_requests_waiting 9.0\n"
        "xvllm:kv_cache_usage_perc 0.9\n"
    )
    assert parse_engine_load(traps + page) == EngineLoad(6, 4, 0.25, 4096)
    first_and_last = "vllm:num_requests_running 1.0\nvllm:num_requests_waiting 5.0"
    assert parse_engine_load(first_and_last) == EngineLoad(1, 5, 0.0, 0)


def test_labels_are_read_as_prometheus_writes_them() -> None:
    """Quoted values may hold braces, commas, escaped quotes and a pair's look; a sample may
    carry a timestamp."""
    trick = r'model_name="a{b},c=\"d\",num_gpu_blocks=\"7\"",'
    text = (
        f'vllm:cache_config_info{{{trick}num_gpu_blocks="512", block_size="16",}} 1.0\n'
        'vllm:num_requests_running{model_name="}{"} 2 1700000000000\n'
        "vllm:num_requests_waiting 1e1\n"
        "vllm:kv_cache_usage_perc{} 0.5\n"
    )
    assert parse_engine_load(text) == EngineLoad(2, 10, 0.5, 512)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("process_cpu_seconds_total 3.5\n", "no vllm:num_requests_running"),
        ("vllm:num_requests_running{engine=0} 3\n", "not Prometheus text"),
        ('vllm:num_requests_running{engine="0} 3\n', "not Prometheus text"),
        ("vllm:num_requests_running three\n", "not Prometheus text"),
        ("vllm:num_requests_running\n", "not Prometheus text"),
    ],
)
def test_text_without_vllms_gauges_is_refused(text: str, message: str) -> None:
    with pytest.raises(EngineMetricsError, match=message):
        parse_engine_load(text)


def test_a_kvswitch_worker_exports_its_load_under_vllms_names() -> None:
    worker = BackgroundWorker(WorkerConfig(port=0, kv_cache_bytes=64 * (32 << 10), metrics_port=0))
    try:

        def scraped() -> EngineLoad:
            url = f"http://{worker.server.metrics_address}/metrics"
            with urllib.request.urlopen(url, timeout=30) as response:
                return parse_engine_load(response.read().decode())

        assert scraped() == EngineLoad(0, 0, 0.0, 64)
        # A finished request's blocks held for a peer: in use, as a vLLM server counts them.
        worker.generate([256, *range(100)], request_id="held", max_tokens=1, hold_blocks_ms=60_000)
        load = worker.load()
        assert load.num_free_blocks < load.num_total_blocks
        used = 1 - load.num_free_blocks / load.num_total_blocks
        assert scraped() == EngineLoad(0, 0, pytest.approx(used), 64)
    finally:
        worker.close()
