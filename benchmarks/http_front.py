"""``kvswitch bench http``: what the router's OpenAI-compatible HTTP API costs over its gRPC API.

A router (``--http-port``) and one CPU worker, as processes. The same requests go through both
doors, one at a time and alternating, so that drift in the machine hits both alike:

- gRPC: the client SDK (``Client.generate`` / ``Client.stream``);
- HTTP: ``POST /v1/completions`` over one kept-alive connection (the standard library's
  ``http.client``: no client library's own cost in the figure), whole or streamed (SSE).

Reported per door: the latency of a whole request of ``max_tokens`` 1 (the fixed cost of a
request) and of ``--num-output-tokens``, and the time to the first token of a stream; then the
HTTP API's overhead, the difference of the medians.
"""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvswitch.benchmarks.timing import machine_info
from kvswitch.cache_index.local_redis import free_port


@dataclass(frozen=True)
class HttpBenchConfig:
    num_requests: int = 200  # per door and kind of request
    num_output_tokens: int = 32
    prompt_words: int = 40  # words of the prompt (the built-in model's bytes: ~6 tokens a word)

    def __post_init__(self) -> None:
        if self.num_requests < 5:
            raise ValueError(f"num_requests must be at least 5, got {self.num_requests}")
        if self.num_output_tokens < 2:
            raise ValueError(f"num_output_tokens must be at least 2, got {self.num_output_tokens}")
        if self.prompt_words < 1:
            raise ValueError(f"prompt_words must be at least 1, got {self.prompt_words}")


def run(config: HttpBenchConfig) -> dict[str, Any]:
    from kvswitch.serving import start_server_process

    http_port = free_port()
    router, address = start_server_process(
        ["router", "--port", "0", "--http-port", str(http_port), "--wait-for-worker-s", "10"]
    )
    worker = None
    try:
        worker, _ = start_server_process(
            ["worker", "--port", "0", "--index", f"grpc://{address}", "--cpu-threads", "1"]
        )
        return _measure(config, address, http_port)
    finally:
        for process in (worker, router):
            if process is not None:
                process.terminate()
                process.wait(timeout=30)


def _measure(config: HttpBenchConfig, address: str, http_port: int) -> dict[str, Any]:
    from kvswitch.client import Client

    words = " ".join(f"word{i}" for i in range(config.prompt_words))
    with Client(address, timeout_s=60) as client:
        model = ""
        connection = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
        try:
            client.generate(words, max_tokens=1)  # waits for the worker; warms both sides
            model = _get_json(connection, "/v1/models")["data"][0]["id"]
            doors: dict[str, dict[str, Callable[[str], float]]] = {
                "grpc": {
                    "one_token_ms": lambda p: _timed(lambda: client.generate(p, max_tokens=1)),
                    "whole_ms": lambda p: _timed(
                        lambda: client.generate(p, max_tokens=config.num_output_tokens)
                    ),
                    "first_token_ms": lambda p: _grpc_first_token_s(client, p, config),
                },
                "http": {
                    "one_token_ms": lambda p: _http_completion_s(connection, model, p, 1),
                    "whole_ms": lambda p: _http_completion_s(
                        connection, model, p, config.num_output_tokens
                    ),
                    "first_token_ms": lambda p: _http_first_token_s(
                        connection, model, p, config.num_output_tokens
                    ),
                },
            }
            samples_s: dict[str, dict[str, list[float]]] = {d: {} for d in doors}
            for kind in doors["grpc"]:
                print(f"{kind}: {config.num_requests} requests per door", file=sys.stderr)
                for n in range(config.num_requests):
                    # NOTE: a prompt of its own per pair: both doors see it cold, then cached.
                    prompt = f"{n} {kind}: {words}"
                    order = ("grpc", "http") if n % 2 else ("http", "grpc")
                    for door in order:
                        spent_s = doors[door][kind](prompt)
                        samples_s[door].setdefault(kind, []).append(spent_s)
        finally:
            connection.close()
    figures: dict[str, Any] = {
        door: {kind: _summary_ms(samples) for kind, samples in kinds.items()}
        for door, kinds in samples_s.items()
    }
    figures["http_overhead_ms"] = {
        kind: figures["http"][kind]["median"] - figures["grpc"][kind]["median"]
        for kind in samples_s["grpc"]
    }
    return {**figures, "config": asdict(config), "machine": machine_info()}


def _timed(call: Callable[[], object]) -> float:
    started_s = time.perf_counter()
    call()
    return time.perf_counter() - started_s


def _grpc_first_token_s(client: Any, prompt: str, config: HttpBenchConfig) -> float:
    started_s = time.perf_counter()
    with client.stream(prompt, max_tokens=config.num_output_tokens) as stream:
        first_s = 0.0
        for _ in stream:
            first_s = first_s or time.perf_counter() - started_s
    return first_s


def _http_completion_s(
    connection: http.client.HTTPConnection, model: str, prompt: str, max_tokens: int
) -> float:
    started_s = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    reply = _post(connection, "/v1/completions", body)
    data = reply.read()
    if reply.status != 200:
        raise RuntimeError(f"/v1/completions answered {reply.status}: {data[:200]!r}")
    return time.perf_counter() - started_s


def _http_first_token_s(
    connection: http.client.HTTPConnection, model: str, prompt: str, max_tokens: int
) -> float:
    started_s = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    reply = _post(connection, "/v1/completions", body)
    if reply.status != 200:
        raise RuntimeError(f"/v1/completions answered {reply.status}: {reply.read()[:200]!r}")
    first_s = 0.0
    for line in reply:  # server-sent events: "data: {...}" lines, then "data: [DONE]"
        if not first_s and line.startswith(b"data: {"):
            first_s = time.perf_counter() - started_s
    return first_s


def _post(
    connection: http.client.HTTPConnection, path: str, body: dict[str, Any]
) -> http.client.HTTPResponse:
    connection.request(
        "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    return connection.getresponse()


def _get_json(connection: http.client.HTTPConnection, path: str) -> Any:
    connection.request("GET", path)
    reply = connection.getresponse()
    return json.loads(reply.read())


def _summary_ms(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    return {
        "median": statistics.median(ordered) * 1000,
        "p90": ordered[int(0.9 * (len(ordered) - 1))] * 1000,
        "p99": ordered[int(0.99 * (len(ordered) - 1))] * 1000,
    }
