"""The router in engine mode on real processes: kvswitch workers standing in for vLLM servers
(``--http-port`` and ``--kv-events-config``), routed by the KV events they publish, their
requests forwarded over HTTP (``router/engines.py``, ``router/engine_forward.py``).

Shown: the follow-up questions about a document go to the engine that holds it, and its cached
tokens are the ones the router predicted; streams and errors come through as the engine sends
them; an engine killed is routed around; one restarted (its sequence back to 0) is cleared in the
index and rebuilt from what it holds then."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import openai
import pytest

from kvswitch.cache_index.connect import connect_index
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.cache_index.local_redis import LocalRedis
from kvswitch.loadtest.live import LoadTestConfig
from kvswitch.loadtest.live import run as run_loadtest
from kvswitch.serving import start_server_process

MODEL = "kvswitch-tiny"  # the built-in model's name
B = 16
DOCUMENTS = [
    f"Document {d}: the {kind} station logs, row after row of readings and remarks. " * 6
    for d, kind in enumerate(["weather", "river", "seismic", "traffic"])
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(process: subprocess.Popen, sig: signal.Signals = signal.SIGTERM) -> None:
    if process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass
class Engine:
    name: str
    http_port: int
    events: str
    replay: str
    args: tuple[str, ...] = ()  # more options of its worker
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> None:
        config = {
            "enable_kv_cache_events": True,
            "endpoint": self.events,
            "replay_endpoint": self.replay,
        }
        self.process, _ = start_server_process(
            [
                "worker",
                "--port",
                "0",
                "--http-port",
                str(self.http_port),
                "--kv-events-config",
                json.dumps(config),
                *self.args,
            ]
        )


@dataclass
class Fleet:
    engines: list[Engine]
    router: subprocess.Popen
    router_address: str
    http_port: int
    metrics_port: int
    index_url: str = ""  # where the router's index is; "" = its own, served on its port

    @property
    def index(self) -> str:
        return self.index_url or f"grpc://{self.router_address}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key="none", max_retries=0
        )

    def metric(self, name: str, **labels: str) -> float:
        text = httpx2.get(f"http://127.0.0.1:{self.metrics_port}/metrics").text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                series, _, value = line.rpartition(" ")
                found = series[len(name) :].strip("{}").split(",")
                if all(part in found for part in want.split(",") if part):
                    total += float(value)
        return total

    async def engines_holding(self, prompt_ids: list[int]) -> dict[str, int]:
        index = await connect_index(self.index)
        try:
            return await index.match(MODEL, hash_prompt_blocks(prompt_ids, B, MODEL))
        finally:
            await index.close()

    async def live(self) -> set[str]:
        index = await connect_index(self.index)
        try:
            return {w.worker_id for w in await index.live_workers()}
        finally:
            await index.close()


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def engine_fleet(
    tmp_path: Path,
    num_engines: int = 2,
    engine_args: tuple[str, ...] = (),
    block_size: int = B,
    index_url: str = "",
) -> Iterator[Fleet]:
    """Engines (kvswitch workers as vLLM servers) behind a router in engine mode."""
    engines = [
        Engine(
            f"e{i}",
            free_port(),
            f"ipc://{tmp_path}/e{i}-events",
            f"ipc://{tmp_path}/e{i}-replay",
            engine_args,
        )
        for i in range(num_engines)
    ]
    router = None
    try:
        # NOTE: inside the try: an engine or router that fails to start leaves none running.
        for engine in engines:
            engine.start()
        http_port, metrics_port = free_port(), free_port()
        args = ["router", "--port", "0", "--http-port", str(http_port)]
        args += ["--metrics-port", str(metrics_port), "--namespace", MODEL]
        args += ["--block-size", str(block_size)]
        if index_url:
            args += ["--index", index_url]
        for engine in engines:
            args += ["--engine", f"{engine.name}={engine.url}"]
            args += ["--engine-events", f"{engine.name}={engine.events}"]
            args += ["--engine-replay", f"{engine.name}={engine.replay}"]
        router, address = start_server_process(args)
        fleet = Fleet(engines, router, address, http_port, metrics_port, index_url)
        names = {engine.name for engine in engines}
        wait_until(lambda: asyncio.run(fleet.live()) == names, "the engines registered")
        yield fleet
    finally:
        if router is not None:
            stop(router)
        for engine in engines:
            if engine.process is not None:
                stop(engine.process)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One fleet for the tests in file order: the first finds it fresh, the last kills an engine."""
    with engine_fleet(tmp_path_factory.mktemp("shared")) as started:
        yield started


def ask(api: openai.OpenAI, document: str, question: int) -> tuple[str, openai.types.Completion]:
    raw = api.completions.with_raw_response.create(
        model=MODEL, prompt=f"{document}Question {question}: why?", max_tokens=3, temperature=0
    )
    return raw.headers["x-kvswitch-worker"], raw.parse()


def test_questions_about_a_document_go_where_it_is_cached(shared: Fleet) -> None:
    fleet = shared
    api = fleet.client()
    first = {d: ask(api, doc, 0)[0] for d, doc in enumerate(DOCUMENTS)}
    # The load spreads the first questions over both engines.
    assert set(first.values()) == {"e0", "e1"}
    num_cached = num_prompt = 0
    for question in (1, 2):
        for d, doc in enumerate(DOCUMENTS):
            engine, completion = ask(api, doc, question)
            assert engine == first[d], (d, question)
            usage = completion.usage
            num_prompt += usage.prompt_tokens
            num_cached += usage.prompt_tokens_details.cached_tokens
    # Every full block of the document was cached where the follow-ups went.
    assert num_cached / num_prompt > 0.9
    # The router's count of each prompt is the engine's; its predicted hit, the engine's.
    for engine in ("e0", "e1"):
        assert fleet.metric(
            "kvswitch_router_engine_prompt_tokens_total", engine=engine, counted_by="router"
        ) == fleet.metric(
            "kvswitch_router_engine_prompt_tokens_total", engine=engine, counted_by="engine"
        )
        assert fleet.metric(
            "kvswitch_router_engine_predicted_cached_tokens_total", engine=engine
        ) == fleet.metric("kvswitch_router_engine_cached_tokens_total", engine=engine)
    assert fleet.metric("kvswitch_router_engine_prompt_token_mismatches_total") == 0
    # What the router's feeds followed of each engine.
    for engine in ("e0", "e1"):
        assert fleet.metric("kvswitch_router_engine_feed_batches_total", engine=engine) > 0
        assert fleet.metric("kvswitch_router_engine_feed_blocks", engine=engine) > 0
        assert fleet.metric("kvswitch_router_engine_feed_degraded", engine=engine) == 0


def test_streams_and_errors_come_through_as_the_engine_sends_them(shared: Fleet) -> None:
    fleet = shared
    api = fleet.client()
    raw = api.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello! 你好 🌍"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    with raw as response:
        assert response.headers["x-kvswitch-worker"] in ("e0", "e1")
        chunks = list(response.parse())
    assert chunks[-1].usage.completion_tokens == 4
    # The engine refuses a prompt past its context: its status and message come through.
    with pytest.raises(openai.BadRequestError, match="context length"):
        api.completions.create(model=MODEL, prompt=[5] * 100_000, max_tokens=1)
    assert fleet.metric("kvswitch_router_engine_requests_total", status="400") == 1
    # A parameter the router does not read goes to the engine, which judges it (a vLLM server
    # takes top_k; a kvswitch worker refuses it), and its answer names the engine.
    with pytest.raises(openai.BadRequestError, match="top_k") as refused:
        api.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"top_k": 5})
    assert refused.value.response.headers["x-kvswitch-worker"] in ("e0", "e1")


def test_an_engine_restarted_is_cleared_and_rebuilt(tmp_path: Path) -> None:
    with engine_fleet(tmp_path, 1) as fleet:
        _restart_and_rebuild(fleet)


def _restart_and_rebuild(fleet: Fleet) -> None:
    api = fleet.client()
    holder, _ = ask(api, DOCUMENTS[0], 0)
    ids = [256, *f"{DOCUMENTS[0]}Question 0: why?".encode()]
    wait_until(
        lambda: asyncio.run(fleet.engines_holding(ids)).get(holder, 0) > 0, "the document indexed"
    )
    engine = next(e for e in fleet.engines if e.name == holder)
    assert engine.process is not None
    stop(engine.process)
    engine.start()  # the same endpoints, its cache empty, its events numbered from 0 again
    # It caches another document (asked straight, not through the router)...
    fresh = [256, *f"{DOCUMENTS[2]}Question 0: why?".encode()]
    direct = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="none", max_retries=0)
    direct.completions.create(model=MODEL, prompt=fresh, max_tokens=1)
    # ...which the index learns from its events, numbered from 0 again: the restart seen, the
    # blocks it held before are gone from the index, and those it holds now are there.
    wait_until(
        lambda: asyncio.run(fleet.engines_holding(fresh)).get(holder, 0) > 0,
        "the restarted engine's blocks indexed",
    )
    assert asyncio.run(fleet.engines_holding(ids)).get(holder, 0) == 0
    assert fleet.metric("kvswitch_router_engine_feed_restarts_total", engine=holder) == 1
    assert fleet.metric("kvswitch_router_engine_feed_degraded", engine=holder) == 0


def test_a_load_test_reaches_the_engines_through_the_http_api(shared: Fleet) -> None:
    fleet = shared
    """``kvswitch loadtest --target http://...``: each policy its own phase (its own cache salt,
    which the engines' events carry back), the output's tokens asked for (``return_token_ids``)
    so that a session's next turn holds them."""
    config = LoadTestConfig(
        target=f"http://127.0.0.1:{fleet.http_port}",
        workload="long_document_qa",
        workload_args="documents=3,questions=3,document_len=256",
        policies="cost,round_robin",
        concurrency=1,
        progress=False,
    )
    report = run_loadtest(config)
    cost, round_robin = report["policies"]["cost"], report["policies"]["round_robin"]
    assert cost["completed"] == round_robin["completed"] == 9 and cost["failed"] == 0
    assert set(cost["per_worker"]) <= {"e0", "e1"}
    # One request at a time: each follow-up goes where its document is, and finds it cached:
    # two questions of three, their document's blocks (about 90% of each prompt).
    assert cost["token_hit_rate"] > 0.55
    assert cost["token_hit_rate"] >= round_robin["token_hit_rate"]
    # A multi-turn session: the answer's tokens came back and were sent as the next prompt.
    chat = LoadTestConfig(
        target=config.target,
        workload="multi_turn_chat",
        workload_args="conversations=2,turns=3",
        policies="cost",
        concurrency=2,
        progress=False,
    )
    turns = run_loadtest(chat)["policies"]["cost"]
    assert turns["completed"] == 6 and turns["token_hit_rate"] > 0.5


def test_one_fleet_mixes_engines_and_workers(shared: Fleet) -> None:
    """A kvswitch worker registered with the router (gRPC) beside the two engines: each
    document's follow-ups go where it is cached, engine or worker."""
    fleet = shared
    worker, address = start_server_process(
        ["worker", "--port", "0", "--index", f"grpc://{fleet.router_address}"]
    )
    try:
        wait_until(lambda: address in asyncio.run(fleet.live()), "the worker registered")
        api = fleet.client()
        first = {}
        # NOTE: documents none of the fleet holds yet (the shared fleet answered others).
        documents = [doc.replace("station", f"mixed fleet {d}") for d, doc in enumerate(DOCUMENTS)]
        for d, doc in enumerate(documents + [d.replace("row", "line") for d in documents]):
            first[d] = ask(api, doc, 0)[0]
            for question in (1, 2):
                served, completion = ask(api, doc, question)
                assert served == first[d], (d, question)
                assert completion.usage.prompt_tokens_details.cached_tokens > 0
        # Documents went to the worker and to engines alike. (Which engine takes a new document
        # is the load's call, and the engines' loads here depend on the tests before this one:
        # one of the two may take none.)
        assert address in first.values() and {"e0", "e1"} & set(first.values())
    finally:
        stop(worker)


def test_an_engine_killed_is_routed_around(shared: Fleet) -> None:
    # NOTE: the last test of the shared fleet: it leaves one engine of the two.
    fleet = shared
    api = fleet.client()
    holder, _ = ask(api, DOCUMENTS[0], 0)
    victim = next(e for e in fleet.engines if e.name == holder)
    assert victim.process is not None
    stop(victim.process, signal.SIGKILL)
    # Its entries stay in the index until it lapses; the request that goes there finds it gone
    # and goes to the other engine.
    engine, completion = ask(api, DOCUMENTS[0], 1)
    assert engine != holder and completion.choices[0].finish_reason == "length"


def test_engines_that_take_a_key_get_the_routers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine started with --api-key (as vLLM's): the router sends its key (here from
    KVSWITCH_ENGINE_API_KEY) with each forwarded request; a client's own key is not passed on."""
    monkeypatch.setenv("KVSWITCH_ENGINE_API_KEY", "engine-key")
    with engine_fleet(tmp_path, 1, ("--api-key", "engine-key")) as keyed:
        engine, completion = ask(keyed.client(), DOCUMENTS[0], 0)
        assert engine == "e0" and completion.choices[0].finish_reason == "length"


def test_an_engine_whose_blocks_are_another_size_is_refused(tmp_path: Path) -> None:
    """The router told --block-size 32, the engines caching blocks of 16: the first events of an
    engine name both sizes in the router's error, and the engine leaves the index."""
    with engine_fleet(tmp_path, 1, block_size=32) as fleet:
        engine = fleet.engines[0]
        direct = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="none", max_retries=0)
        direct.completions.create(model=MODEL, prompt=[7] * 40, max_tokens=1)
        wait_until(lambda: asyncio.run(fleet.live()) == set(), "the engine refused")
        assert fleet.metric("kvswitch_router_engine_feed_failed", engine="e0") == 1


def test_routers_sharing_a_redis_index_share_the_engines_one_follows(tmp_path: Path) -> None:
    """One router follows the engines' events into a Redis index; another, named no engine,
    shares the index and routes to the engines it finds there, by the same cache."""
    with (
        LocalRedis() as redis_server,
        engine_fleet(tmp_path, 1, index_url=redis_server.url) as fleet,
    ):
        http_port = free_port()
        other, _ = start_server_process(
            ["router", "--port", "0", "--http-port", str(http_port), "--index", redis_server.url]
        )
        try:
            holder, _ = ask(fleet.client(), DOCUMENTS[0], 0)
            ids = [256, *f"{DOCUMENTS[0]}Question 0: why?".encode()]
            wait_until(
                lambda: asyncio.run(fleet.engines_holding(ids)).get(holder, 0) > 0,
                "the document indexed",
            )
            api = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none")
            served, completion = ask(api, DOCUMENTS[0], 1)
            assert served == holder
            assert completion.usage.prompt_tokens_details.cached_tokens > 0
        finally:
            stop(other)
