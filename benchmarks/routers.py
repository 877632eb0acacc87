"""``kvswitch bench routers``: kvswitch's router beside the routers people would pick instead, in
front of the same stub engines, from the same client, in one run.

The engines are stubs with no model (``benchmarks/stub_engines.py``): each answers a completion
at once with ``num_output_tokens`` tokens, or streams ``stream_tokens`` of them one server-sent
event a token. Routers, each started alone in front of ``num_engines`` of them:

- ``kvswitch-engines``: ``kvswitch router`` in engine mode (``--engine``: the stubs as OpenAI-API
  engines, their KV events followed), its HTTP API;
- ``kvswitch-grpc`` and ``kvswitch-http``: ``kvswitch router`` before gRPC stub workers answering
  the same way, over its gRPC API and over its HTTP API;
- ``sglang-router`` (``launch --policy cache_aware``) and ``vllm-router`` (``--policy
  cache_aware``), where their executables are found (``pip install sglang-router==0.3.2
  vllm-router==0.1.17``; elsewhere, ``--sglang-router PATH``); a router not found is reported as
  such, never silently left out.

Per router: ``p50_ms`` / ``p99_ms`` of ``num_requests`` non-streamed completions sent one after
another (a prompt of ``prompt_chars`` characters; over gRPC read whole as the SDK's ``generate``
reads them, ``stream_interval`` 64), and ``added_p50_ms`` / ``added_p99_ms``, less the
same straight to a stub (the HTTP stubs for the HTTP routers, the gRPC stubs for gRPC), and
``cpu_us_per_request``, the router's CPU time over them (its background work included); then
``cpu_us_per_token``: the router's CPU time (its processes, from ``/proc``) while ``concurrency``
streams of ``stream_tokens`` tokens run for ``duration_s``, over the tokens the clients read.
Then, where ``step_ms`` > 0 and the router speaks HTTP to the HTTP stubs, paced streams (a token
every ``step_ms``, stamped with the stub's clock when it left) for ``duration_s``:
``event_delay_us`` from the stub's send to the client's read (p50, p99), and
``added_event_delay_us``, less the same straight to a stub (``direct_event_delay_us``): the
router's added latency a token. Everything shares the machine's cores.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import multiprocessing
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from kvswitch.benchmarks.stub_engines import (
    MODEL,
    PACED,
    serve_grpc_stubs,
    serve_http_stubs,
    stamp_us,
)
from kvswitch.benchmarks.timing import cpu_seconds, machine_info, p50_p99
from kvswitch.cache_index.local_redis import free_port, free_ports
from kvswitch.serving import start_server_process

ROUTERS = ("kvswitch-engines", "kvswitch-http", "kvswitch-grpc", "sglang-router", "vllm-router")
READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RoutersBenchConfig:
    routers: str = ",".join(ROUTERS)
    num_engines: int = 2
    num_requests: int = 400  # non-streamed, one after another, per router (and straight)
    prompt_chars: int = 2000
    num_output_tokens: int = 16
    stream_tokens: int = 256  # a streamed request's tokens
    concurrency: int = 4  # streams open at once
    duration_s: float = 3.0
    step_ms: float = 10.0  # paced streams: an event every step_ms (0: no paced streams)
    paced_tokens: int = 50  # a paced stream's tokens
    sglang_router: str = "sglang-router"  # its executable
    vllm_router: str = "vllm-router"

    def __post_init__(self) -> None:
        unknown = set(self.names()) - set(ROUTERS)
        if unknown or not self.names():
            raise ValueError(
                f"routers must list some of {', '.join(ROUTERS)}, got {self.routers!r}"
            )
        for name in ("num_engines", "num_requests", "prompt_chars", "num_output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.stream_tokens < 2 or self.concurrency < 1 or not self.duration_s > 0:
            raise ValueError("stream_tokens >= 2, concurrency >= 1 and duration_s > 0, please")
        if self.step_ms < 0 or self.paced_tokens < 2:
            raise ValueError("step_ms >= 0 and paced_tokens >= 2, please")

    def names(self) -> list[str]:
        return [n.strip() for n in self.routers.split(",") if n.strip()]


def run(config: RoutersBenchConfig) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    results: dict[str, Any] = {}
    ports = free_ports(2 * config.num_engines)
    ports, event_ports = ports[: config.num_engines], ports[config.num_engines :]
    ready = context.Queue()
    stubs = context.Process(
        target=serve_http_stubs,
        args=(config.num_engines, config.num_output_tokens, ports, event_ports, ready),
        daemon=True,
    )
    stubs.start()
    try:
        ready.get(timeout=READY_TIMEOUT_S)
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        print("  straight to the HTTP stubs", file=sys.stderr)
        direct_http = _latencies(config, _http_completion(config, ports))
        http_routers = [n for n in config.names() if n not in ("kvswitch-grpc", "kvswitch-http")]
        direct_delays = _event_delays(config, ports[0]) if http_routers else []
        for name in http_routers:
            command = _http_router_command(name, config, urls, event_ports)
            if command is None:
                results[name] = {"skipped": f"{name} is not installed"}
                continue
            print(f"  {name}", file=sys.stderr)
            with _router(command) as (pid, port):
                results[name] = _measure_http(config, pid, port, direct_http)
                results[name].update(_delay_figures(_event_delays(config, port), direct_delays))
        if {"kvswitch-grpc", "kvswitch-http"} & set(config.names()):
            results.update(_measure_kvswitch_workers(config, context, direct_http))
    finally:
        stubs.kill()
    return {
        "config": asdict(config),
        "machine": machine_info(),
        "direct_http_p50_ms": _ms(direct_http, 0.5),
        **({"direct_event_delay_us": p50_p99(direct_delays)} if direct_delays else {}),
        "routers": results,
    }


# -- the routers -----------------------------------------------------------------------------------


def _http_router_command(
    name: str, config: RoutersBenchConfig, urls: list[str], event_ports: list[int]
) -> tuple[list[str], int] | None:
    port = free_port()
    if name == "kvswitch-engines":
        engines: list[str] = []
        for k, (url, event_port) in enumerate(zip(urls, event_ports, strict=True)):
            engines += ["--engine", f"e{k}={url}"]
            engines += ["--engine-events", f"e{k}=tcp://127.0.0.1:{event_port}"]
        return [
            *_kvswitch(),
            "router",
            "--port",
            "0",
            "--http-port",
            str(port),
            "--namespace",
            MODEL,
            *engines,
        ], port
    executable = shutil.which(
        config.sglang_router if name == "sglang-router" else config.vllm_router
    )
    if executable is None:
        return None
    common = ["--worker-urls", *urls, "--policy", "cache_aware", "--host", "127.0.0.1"]
    if name == "sglang-router":
        return [executable, "launch", *common, "--port", str(port), "--log-level", "warn"], port
    return [executable, *common, "--port", str(port), "--log-level", "warning"], port


def _kvswitch() -> list[str]:
    return [sys.executable, "-m", "kvswitch.app.cli"]


@contextlib.contextmanager
def _router(command: tuple[list[str], int]) -> Iterator[tuple[int, int]]:
    """The router started, its pid and HTTP port once a completion goes through it."""
    args, port = command
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        body = json.dumps({"model": MODEL, "prompt": "ready?", "max_tokens": 1}).encode()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{args[0]} exited with {process.returncode} while starting")
            with contextlib.suppress(OSError, http.client.HTTPException):
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                connection.request("POST", "/v1/completions", body, _JSON)
                if connection.getresponse().status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{args[0]} did not route a completion in {READY_TIMEOUT_S} s")
            time.sleep(0.2)
        yield process.pid, port
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _measure_kvswitch_workers(
    config: RoutersBenchConfig, context: Any, direct_http: list[float]
) -> dict[str, Any]:
    """kvswitch's router before gRPC stub workers: over gRPC (against the stubs straight) and
    over its HTTP API (against the HTTP stubs straight)."""
    import grpc

    from kvswitch.client.request import WHOLE_ANSWER_STREAM_INTERVAL
    from kvswitch.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

    http_port = free_port()
    popen, address = start_server_process(["router", "--port", "0", "--http-port", str(http_port)])
    addresses = context.Queue()
    stubs = context.Process(
        target=serve_grpc_stubs,
        args=(config.num_engines, f"grpc://{address}", addresses),
        daemon=True,
    )
    stubs.start()
    results: dict[str, Any] = {}
    try:
        workers = [addresses.get(timeout=READY_TIMEOUT_S) for _ in range(config.num_engines)]
        prompt = ("The quick brown fox. " * (config.prompt_chars // 20 + 1))[: config.prompt_chars]
        ids = list(prompt.encode())
        sampling = common_pb2.SamplingParams(max_tokens=config.num_output_tokens)
        router_channel = grpc.insecure_channel(address)
        route = router_pb2_grpc.RouterStub(router_channel).Generate
        # NOTE: read whole, as the SDK's generate asks for it: the first token, then the rest.
        request = router_pb2.GenerateRequest(
            text=prompt, sampling=sampling, stream_interval=WHOLE_ANSWER_STREAM_INTERVAL
        )
        _wait_for(lambda: _grpc_ok(route, request), "kvswitch's router to see its workers")
        if "kvswitch-grpc" in config.names():
            print("  kvswitch-grpc", file=sys.stderr)
            channels = [grpc.insecure_channel(w) for w in workers]
            worker_calls = [worker_pb2_grpc.WorkerStub(c).Generate for c in channels]
            worker_request = worker_pb2.WorkerGenerateRequest(
                prompt_token_ids=ids,
                sampling=sampling,
                stream_interval=WHOLE_ANSWER_STREAM_INTERVAL,
            )
            turn = iter(range(1 << 62))

            def straight() -> None:
                list(worker_calls[next(turn) % len(worker_calls)](worker_request))

            direct_grpc = _latencies(config, straight)
            cpu_before = cpu_seconds(popen.pid)
            routed = _latencies(config, lambda: list(route(request)))
            cpu_us_per_request = _cpu_us_per_request(config, popen.pid, cpu_before)
            stream_request = router_pb2.GenerateRequest(
                text=prompt, sampling=common_pb2.SamplingParams(max_tokens=config.stream_tokens)
            )

            def stream() -> int:
                return sum(
                    len(r.chunk.token_ids) for r in route(stream_request) if r.HasField("chunk")
                )

            results["kvswitch-grpc"] = {
                **_figures(routed, direct_grpc),
                "direct_p50_ms": _ms(direct_grpc, 0.5),
                "cpu_us_per_request": cpu_us_per_request,
                **_cpu_per_token(config, popen.pid, stream),
            }
            for channel in channels:
                channel.close()
        if "kvswitch-http" in config.names():
            print("  kvswitch-http", file=sys.stderr)
            results["kvswitch-http"] = _measure_http(config, popen.pid, http_port, direct_http)
        router_channel.close()
    finally:
        stubs.kill()
        popen.terminate()
        popen.wait(30)
    return results


def _grpc_ok(call: Callable, request: Any) -> bool:
    import grpc

    try:
        list(call(request, timeout=5))
    except grpc.RpcError:
        return False
    return True


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


# -- the client ------------------------------------------------------------------------------------

_JSON = {"content-type": "application/json"}


def _http_completion(config: RoutersBenchConfig, ports: list[int]) -> Callable[[], None]:
    """One non-streamed completion per call, on keep-alive connections to ``ports`` in turn."""
    prompt = ("The quick brown fox. " * (config.prompt_chars // 20 + 1))[: config.prompt_chars]
    body = json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": config.num_output_tokens}
    ).encode()
    connections = [http.client.HTTPConnection("127.0.0.1", p, timeout=30) for p in ports]
    turn = iter(range(1 << 62))

    def call() -> None:
        connection = connections[next(turn) % len(connections)]
        connection.request("POST", "/v1/completions", body, _JSON)
        response = connection.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"a completion answered {response.status}: {data[:200]!r}")

    return call


def _http_stream(config: RoutersBenchConfig, port: int) -> Callable[[], int]:
    """One streamed completion per call; the tokens read (the stubs' tokens are an "x" each; a
    router may relay several in one event)."""
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "Stream, please.",
            "max_tokens": config.stream_tokens,
            "stream": True,
        }
    ).encode()
    local = threading.local()

    def call() -> int:
        if not hasattr(local, "connection"):
            local.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        local.connection.request("POST", "/v1/completions", body, _JSON)
        response = local.connection.getresponse()
        num_tokens = 0
        for line in response:
            if line.startswith(b"data: {"):
                num_tokens += sum(len(c["text"]) for c in json.loads(line[6:])["choices"])
        return num_tokens

    return call


def _measure_http(
    config: RoutersBenchConfig, pid: int, port: int, direct: list[float]
) -> dict[str, Any]:
    cpu_before = cpu_seconds(pid)
    routed = _latencies(config, _http_completion(config, [port]))
    cpu_us_per_request = _cpu_us_per_request(config, pid, cpu_before)
    return {
        **_figures(routed, direct),
        "cpu_us_per_request": cpu_us_per_request,
        **_cpu_per_token(config, pid, _http_stream(config, port)),
    }


def _cpu_us_per_request(config: RoutersBenchConfig, pid: int, cpu_before: float) -> float:
    """The router's CPU a non-streamed completion, since ``cpu_before`` (warm-up included)."""
    num_requests = config.num_requests + min(50, config.num_requests)
    return (cpu_seconds(pid) - cpu_before) / num_requests * 1e6


def _event_delays(config: RoutersBenchConfig, port: int) -> list[float]:
    """Paced streams (an event every ``step_ms``, each stamped when the stub sent it) read from
    ``port`` by ``concurrency`` clients for ``duration_s``: each event's delay, in us, sorted.
    Empty with ``step_ms`` 0."""
    if not config.step_ms:
        return []
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": f"{PACED}{config.step_ms:g} ms",
            "max_tokens": config.paced_tokens,
            "stream": True,
        }
    ).encode()
    delays: list[float] = []
    deadline = time.monotonic() + config.duration_s

    def run() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while time.monotonic() < deadline:
            connection.request("POST", "/v1/completions", body, _JSON)
            for line in connection.getresponse():
                read_us = stamp_us()
                if line.startswith(b"data: {"):
                    text = "".join(c["text"] for c in json.loads(line[6:])["choices"])
                    if text.isdigit():
                        delays.append(read_us - int(text))

    threads = [threading.Thread(target=run) for _ in range(config.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if not delays:
        raise RuntimeError("no paced event came through")
    return sorted(delays)


def _delay_figures(routed: list[float], direct: list[float]) -> dict[str, Any]:
    """A router's paced events' delay (us, p50 and p99) and what it adds to the stubs'."""
    if not routed:
        return {}
    delay, straight = p50_p99(routed), p50_p99(direct)
    added = {q: delay[q] - straight[q] for q in delay}
    return {"event_delay_us": delay, "added_event_delay_us": added}


def _latencies(config: RoutersBenchConfig, call: Callable[[], object]) -> list[float]:
    for _ in range(min(50, config.num_requests)):
        call()  # warm up: connections, caches, a JIT
    samples = []
    for _ in range(config.num_requests):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return sorted(samples)


def _cpu_per_token(config: RoutersBenchConfig, pid: int, stream: Callable[[], int]) -> dict:
    counts = [0] * config.concurrency
    deadline = time.monotonic() + config.duration_s

    def run(slot: int) -> None:
        while time.monotonic() < deadline:
            counts[slot] += stream()

    threads = [threading.Thread(target=run, args=(slot,)) for slot in range(config.concurrency)]
    cpu_before = cpu_seconds(pid)
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed_s = time.monotonic() - started
    cpu_s = cpu_seconds(pid) - cpu_before
    num_tokens = sum(counts)
    if not num_tokens:
        raise RuntimeError("no streamed token came through")
    return {
        "tokens_per_s": num_tokens / elapsed_s,
        "cpu_us_per_token": cpu_s / num_tokens * 1e6,
        "router_cores": cpu_s / elapsed_s,
    }


def _figures(routed: list[float], direct: list[float]) -> dict[str, float]:
    return {
        "p50_ms": _ms(routed, 0.5),
        "p99_ms": _ms(routed, 0.99),
        "added_p50_ms": _ms(routed, 0.5) - _ms(direct, 0.5),
        "added_p99_ms": _ms(routed, 0.99) - _ms(direct, 0.99),
    }


def _ms(sorted_s: list[float], q: float) -> float:
    return sorted_s[min(int(q * len(sorted_s)), len(sorted_s) - 1)] * 1000
