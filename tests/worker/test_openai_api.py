"""A worker's own OpenAI API (``kvswitch worker --http-port``), standalone as a vLLM server is:
no router, no index. Completions (text and token ids), chat, streams with usage, ``/health``,
``/metrics`` with vLLM's gauges, its keys, and what it refuses."""

from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Iterator

import httpx2
import openai
import pytest

from kvswitch.router.engine_load import parse_engine_load
from kvswitch.serving import start_server_process
from kvswitch.worker.worker_config import WorkerConfig

KEY = "sk-worker-test"
PROMPT = "Tell me about the weather in the mountains, " * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[str, str]]:
    """A worker serving HTTP with a key: its gRPC address and its HTTP base URL."""
    port = free_port()
    process, address = start_server_process(
        ["worker", "--port", "0", "--http-port", str(port), "--api-key", KEY]
    )
    try:
        yield address, f"http://127.0.0.1:{port}"
    finally:
        stop(process)


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_completions_and_chat_run_on_the_worker(worker: tuple[str, str]) -> None:
    address, url = worker
    api = client(url)
    (card,) = api.models.list().data
    text = api.completions.with_raw_response.create(
        model=card.id, prompt=PROMPT, max_tokens=5, temperature=0
    )
    # The worker serves it itself, and says so as a router names its worker.
    assert text.headers["x-kvswitch-worker"] == address
    completion = text.parse()
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 5
    # The same prompt again, as token ids: its full blocks are cached now.
    ids = api.completions.create(model=card.id, prompt=[256, *PROMPT.encode()], max_tokens=3)
    assert ids.usage.prompt_tokens == completion.usage.prompt_tokens
    assert ids.usage.prompt_tokens_details.cached_tokens >= 16 * (ids.usage.prompt_tokens // 16 - 1)
    # vLLM's return_token_ids: the output's tokens with its text.
    with_ids = api.completions.create(
        model=card.id, prompt=[1, 2, 3], max_tokens=4, extra_body={"return_token_ids": True}
    )
    assert len(with_ids.choices[0].model_extra["token_ids"]) == 4
    streamed = api.completions.create(
        model=card.id,
        prompt=[1, 2, 3],
        max_tokens=4,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    assert sum(len(c.choices[0].model_extra["token_ids"]) for c in streamed) == 4
    chunks = list(
        api.chat.completions.create(
            model=card.id,
            messages=[{"role": "user", "content": "Hello! 你好 🌍"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_the_worker_scores_prompts_and_embeds_them(worker: tuple[str, str]) -> None:
    _, url = worker
    api = client(url)
    (card,) = api.models.list().data
    scored = api.completions.create(
        model=card.id, prompt=[256, 1, 2, 3], echo=True, logprobs=2, max_tokens=0
    )
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == 4 and logprobs.token_logprobs[0] is None
    assert all(lp < 0 for lp in logprobs.token_logprobs[1:])
    assert scored.usage.completion_tokens == 0
    (embedding,) = api.embeddings.create(model=card.id, input=[256, 1, 2, 3]).data
    assert len(embedding.embedding) == 256  # the built-in model's hidden size
    assert sum(x * x for x in embedding.embedding) == pytest.approx(1.0, abs=1e-4)


def test_health_and_metrics_as_a_vllm_server_serves_them(worker: tuple[str, str]) -> None:
    _, url = worker
    # NOTE: open, as vLLM's are: a prober and a scraper carry no key.
    assert httpx2.get(f"{url}/health").status_code == 200
    metrics = httpx2.get(f"{url}/metrics")
    assert metrics.status_code == 200
    load = parse_engine_load(metrics.text)
    assert load.num_running_requests == load.num_waiting_requests == 0
    assert 0 <= load.kv_cache_usage <= 1


def test_what_the_worker_refuses(worker: tuple[str, str]) -> None:
    _, url = worker
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").models.list()
    api = client(url)
    with pytest.raises(openai.NotFoundError, match="served here: 'kvswitch-tiny'"):
        api.completions.create(model="another", prompt="hi", max_tokens=1)
    # Routing is a router's: accepted, it would do nothing.
    with pytest.raises(openai.BadRequestError, match="routing"):
        api.completions.create(
            model="kvswitch-tiny",
            prompt="hi",
            max_tokens=1,
            extra_body={"routing": {"policy": "prefix"}},
        )
    with pytest.raises(openai.BadRequestError, match="context length"):
        api.completions.create(model="kvswitch-tiny", prompt=[5] * 100_000, max_tokens=1)


def test_the_http_apis_keys() -> None:
    # The fleet token is its key, unless keys are given: beyond loopback it is never open.
    WorkerConfig(host="0.0.0.0", http_port=8000, fleet_token="t" * 32)
    assert WorkerConfig(fleet_token="t" * 32, http_port=0).http_keys() == ("t" * 32,)
    assert WorkerConfig(api_key="a,b", http_port=0).http_keys() == ("a", "b")
    with pytest.raises(ValueError, match="api_key is for the HTTP API"):
        WorkerConfig(api_key="a")
