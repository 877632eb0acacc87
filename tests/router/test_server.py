"""The router over real gRPC: a router and two CPU workers in this process, the client SDK.

Reference outputs come from an engine with the same built-in model: greedy and seeded
sampling are deterministic, so every token a client receives can be checked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import socket
import struct
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvswitch.cache_index.index import WorkerInfo
from kvswitch.cache_index.local_redis import LocalRedis
from kvswitch.client import Client, KvswitchError, KvswitchTimeoutError
from kvswitch.router import outcome as outcome_module
from kvswitch.router.metrics import RouterMetrics
from kvswitch.router.server import RouterConfig, RouterStartError, start_router
from kvswitch.tokenizer import ByteTokenizer, SentencePieceTokenizer
from kvswitch.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvswitch.worker.engine import LLMEngine
from kvswitch.worker.request import SamplingParams
from kvswitch.worker.server import WorkerServer
from tests.router.harness import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    ROUTER_CONFIG,
    WORKER_CONFIG,
    BackgroundCluster,
)
from tests.test_tokenizer import build_sentencepiece_model

TOKENIZER = ByteTokenizer()
DOCUMENTS = [
    "".join(f"| {row} | person {row * 7 + d} | {20 + (row * 13 + d) % 40} |\n" for row in range(24))
    for d in range(3)
]


def question(d: int, q: int) -> str:
    return f"{DOCUMENTS[d]}Question {q}: who is on row {q + 3}?\n"


@pytest.fixture(scope="module")
def cluster() -> Iterator[BackgroundCluster]:
    background = BackgroundCluster(num_workers=2)
    yield background
    background.close()


@pytest.fixture
def client(cluster: BackgroundCluster) -> Iterator[Client]:
    with Client(cluster.address, timeout_s=30, max_retries=2, initial_backoff_s=0.01) as c:
        yield c


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    return LLMEngine(WORKER_CONFIG.engine_config())


def expected(reference: LLMEngine, prompt: str | list[int], **params) -> list[int]:
    ids = TOKENIZER.encode(prompt) if isinstance(prompt, str) else prompt
    return reference.generate([ids], SamplingParams(**params))[0]


def wait_until_idle(worker: WorkerServer, timeout_s: float = 5.0) -> None:
    """Until the worker runs nothing and every block is free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = worker.engine.load
        idle = load.num_running_requests == 0 and load.num_waiting_requests == 0
        if idle and load.num_free_blocks == load.num_total_blocks:
            return
        assert time.monotonic() < deadline, f"worker {worker.worker_id} still busy: {load}"
        time.sleep(0.02)


def test_text_prompt_is_tokenized_routed_and_streamed(client: Client, reference: LLMEngine) -> None:
    result = client.generate("The quick brown fox", max_tokens=6)
    assert result.token_ids == expected(reference, "The quick brown fox", max_tokens=6)
    assert result.text == TOKENIZER.decode(result.token_ids)
    assert result.finish_reason == "length"
    stats, route = result.stats, result.route
    assert stats.num_prompt_tokens == len(TOKENIZER.encode("The quick brown fox"))
    assert stats.num_output_tokens == 6
    assert stats.ttft_s > 0
    assert route.worker_id == stats.worker_id and route.worker_id in ("w0", "w1")
    assert route.policy == "cost"


def test_later_questions_go_where_their_document_is_cached(
    cluster: BackgroundCluster, client: Client
) -> None:
    document_blocks = len(TOKENIZER.encode(DOCUMENTS[0])) // BLOCK_SIZE
    first = [client.generate(question(d, 0), max_tokens=2, cache_salt="later") for d in range(3)]
    for q in range(1, 3):
        for d in range(3):
            result = client.generate(question(d, q), max_tokens=2, cache_salt="later")
            assert result.stats.worker_id == first[d].stats.worker_id
            assert result.route.num_matched_blocks >= document_blocks
            assert result.stats.num_cached_tokens >= document_blocks * BLOCK_SIZE
            assert result.route.reason == "lowest cost"
    # Misses spread: three new documents did not all land on one worker.
    assert len({r.stats.worker_id for r in first}) == 2


def test_a_burst_on_one_document_stays_together(cluster: BackgroundCluster) -> None:
    """Sent at once, before any worker has reported the document's blocks: the router's own
    guesses keep them together, and in-flight accounting spreads the other document."""
    prompts = [question(d, q) for q in range(4) for d in range(2)]
    with Client(cluster.address, timeout_s=30) as c, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: c.generate(p, max_tokens=2, cache_salt="burst"), prompts))
    by_document = [{r.stats.worker_id for r in results[d::2]} for d in range(2)]
    assert all(len(workers) == 1 for workers in by_document), by_document


def test_a_burst_on_one_long_document_is_prefilled_once() -> None:
    """8 requests at once on one 4,000-token document, 4 idle workers: the first one's prefill of
    the document serves the other seven, so they follow it instead of prefilling it again."""
    document = "".join(f"| {row} | person {row * 7} | {row % 40} |\n" for row in range(170))
    worker_config = dataclasses.replace(WORKER_CONFIG, kv_cache_bytes=1024 * BLOCK_BYTES)
    cluster = BackgroundCluster(num_workers=4, worker_config=worker_config)
    try:
        prompts = [f"{document}Question {q}: who is on row {q + 3}?\n" for q in range(8)]
        with Client(cluster.address, timeout_s=60) as c, ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda p: c.generate(p, max_tokens=2), prompts))
    finally:
        cluster.close()
    assert len(TOKENIZER.encode(document)) >= 4000
    assert len({r.stats.worker_id for r in results}) == 1, [r.stats.worker_id for r in results]


def test_policy_override_and_bad_policy(client: Client) -> None:
    workers = [client.generate("same prompt", max_tokens=1, policy="round_robin") for _ in range(4)]
    assert {r.route.policy for r in workers} == {"round_robin"}
    assert len({r.stats.worker_id for r in workers}) == 2
    with pytest.raises(KvswitchError) as error:
        client.generate("x", policy="cheapest")
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown routing policy" in error.value.details


def test_token_ids_as_the_repeated_field_still_route(
    cluster: BackgroundCluster, reference: LLMEngine
) -> None:
    """An older sender's ``TokenIds.ids`` run as the SDK's ``ids_u32le`` do; a request that
    sets both, or neither, or a length that is not whole ids, is refused with what is wrong."""
    prompt = [256, *b"the old field"]
    sampling = common_pb2.SamplingParams(max_tokens=3)
    with grpc.insecure_channel(cluster.address) as channel:
        generate = router_pb2_grpc.RouterStub(channel).Generate

        def final(token_ids: router_pb2.TokenIds) -> router_pb2.GenerateFinal:
            request = router_pb2.GenerateRequest(token_ids=token_ids, sampling=sampling)
            responses = list(generate(request, timeout=30))
            received = [t for r in responses[:-1] for t in r.chunk.token_ids]
            assert received == expected(reference, prompt, max_tokens=3)
            return responses[-1].final

        old = final(router_pb2.TokenIds(ids=prompt))
        new = final(router_pb2.TokenIds(ids_u32le=struct.pack(f"<{len(prompt)}I", *prompt)))
        assert old.stats.num_prompt_tokens == new.stats.num_prompt_tokens == len(prompt)

        for token_ids, message in [
            (router_pb2.TokenIds(ids=prompt, ids_u32le=b"\x00" * 4), "sets both ids and ids_u32le"),
            (router_pb2.TokenIds(), "the prompt is empty: token_ids sets neither"),
            (router_pb2.TokenIds(ids_u32le=b"\x00" * 6), "4 bytes each; got 6 bytes"),
        ]:
            request = router_pb2.GenerateRequest(token_ids=token_ids, sampling=sampling)
            with pytest.raises(grpc.RpcError) as error:
                list(generate(request, timeout=30))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in error.value.details()


def test_worker_rejections_reach_the_client(client: Client) -> None:
    with pytest.raises(KvswitchError) as error:
        client.generate(prompt_token_ids=[256, 999_999], max_tokens=2)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in error.value.details


def test_a_registered_worker_that_does_not_answer_is_left_out(
    cluster: BackgroundCluster, client: Client, reference: LLMEngine
) -> None:
    """A registered worker that is gone (its port closed) and would look best: its first failed
    load poll leaves it out, and no request is sent there."""
    router = cluster.router.router
    prompt = question(2, 9)
    plan = router.plan(text=prompt)
    dead = WorkerInfo("a-dead", "127.0.0.1:1", plan.namespace, BLOCK_SIZE, num_blocks=256)
    cluster.run(router.index.register(dead, ttl_s=30))
    cluster.run(router.index.resync("a-dead", 1, plan.block_hashes))
    try:
        deadline = time.monotonic() + 5
        while "a-dead" not in {h.worker_id for h in router.directory.handles()}:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # Left out after a load poll or two (every 50 ms here), and kept out while it fails.
        time.sleep(0.3)
        assert "a-dead" not in {h.worker_id for h in router.directory.routable()}
        result = client.generate(prompt, max_tokens=5)
    finally:
        cluster.run(router.index.deregister("a-dead"))
    assert result.token_ids == expected(reference, prompt, max_tokens=5)
    assert result.stats.worker_id in ("w0", "w1")
    assert not result.route.reason.startswith("failover: ")


class _StoppingWorker(worker_pb2_grpc.WorkerServicer):
    """A worker that reports its load but is shutting down: Generate answers UNAVAILABLE."""

    async def GetLoad(self, request, context):
        return worker_pb2.WorkerLoad(num_total_blocks=256, num_free_blocks=256)

    async def Generate(self, request, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker is shutting down")


def test_a_worker_that_fails_before_the_first_token_is_skipped(
    cluster: BackgroundCluster, client: Client, reference: LLMEngine
) -> None:
    """It looks best (it holds the prompt) and answers its load polls, but fails the request
    before any token: the request is retried on the next best worker."""
    router = cluster.router.router
    prompt = question(2, 8)
    plan = router.plan(text=prompt)

    async def serve() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(_StoppingWorker(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = cluster.run(serve())
    address = f"127.0.0.1:{port}"
    stopping = WorkerInfo("a-stopping", address, plan.namespace, BLOCK_SIZE, num_blocks=256)
    cluster.run(router.index.register(stopping, ttl_s=30))
    cluster.run(router.index.resync("a-stopping", 1, plan.block_hashes))
    try:
        deadline = time.monotonic() + 5
        while "a-stopping" not in {h.worker_id for h in router.directory.routable()}:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        result = client.generate(prompt, max_tokens=5)
    finally:
        cluster.run(router.index.deregister("a-stopping"))
        cluster.run(server.stop(0))
    assert result.token_ids == expected(reference, prompt, max_tokens=5)
    assert result.stats.worker_id in ("w0", "w1")
    assert result.route.reason.startswith("failover: ")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_worker_dying_mid_stream_is_resumed_without_gap_or_duplicate(
    temperature: float, reference: LLMEngine
) -> None:
    cluster = BackgroundCluster(num_workers=2)
    try:
        prompt = question(1, 5)
        params = {"max_tokens": 120, "temperature": temperature, "seed": 3}
        with Client(cluster.address, timeout_s=60) as c:
            stream = c.stream(prompt, **params)
            received = list(next(stream).token_ids)
            busy = [
                h.worker_id for h in cluster.router.router.directory.handles() if h.num_in_flight
            ]
            assert len(busy) == 1
            cluster.stop_worker(cluster.worker(busy[0]))
            for chunk in stream:
                received += chunk.token_ids
            result = stream.result
        assert received == result.token_ids == expected(reference, prompt, **params)
        assert result.stats.worker_id != busy[0]
        assert result.route.reason.startswith("failover: ")
        assert result.stats.num_output_tokens == 120
        assert result.stats.num_prompt_tokens == len(TOKENIZER.encode(prompt))
        registry = cluster.router.metrics.registry
        failovers = "kvswitch_router_failovers_total"
        assert registry.get_sample_value(failovers, {"kind": "mid_stream"}) == 1
        assert registry.get_sample_value(failovers, {"kind": "before_first_token"}) == 0
    finally:
        cluster.close()


def test_only_the_first_chunk_of_a_resumed_stream_says_what_was_cached() -> None:
    """The cached-token count rides on the stream's first chunk; the worker that resumes the
    stream sends one on its own first chunk, which the router drops."""
    cluster = BackgroundCluster(num_workers=2)
    try:
        with grpc.insecure_channel(cluster.address) as channel:
            request = router_pb2.GenerateRequest(
                request_id="resumed",
                text=question(2, 5),
                sampling=common_pb2.SamplingParams(max_tokens=120, temperature=0.0),
            )
            stream = router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60)
            first = next(stream).chunk
            busy = [
                h.worker_id for h in cluster.router.router.directory.handles() if h.num_in_flight
            ]
            cluster.stop_worker(cluster.worker(busy[0]))
            rest = list(stream)
        assert first.HasField("num_cached_tokens")
        chunks = [m.chunk for m in rest if m.HasField("chunk")]
        assert rest[-1].final.route.reason.startswith("failover: ")
        assert len(first.token_ids) + sum(len(c.token_ids) for c in chunks) == 120
        assert not any(c.HasField("num_cached_tokens") for c in chunks)
    finally:
        cluster.close()


def test_a_resumed_stream_keeps_its_logprobs_and_asks_for_the_prompts_once(
    reference: LLMEngine,
) -> None:
    """Logprobs go on where the stream resumes, token for token; the prompt's logprobs and
    embedding came with the first worker's first chunk, and the next worker is asked for
    neither."""
    cluster = BackgroundCluster(num_workers=2)
    try:
        prompt = question(0, 7)
        asks = {"logprobs": 2, "prompt_logprobs": 1, "pooling": "last"}
        with Client(cluster.address, timeout_s=60) as c:
            stream = c.stream(prompt, max_tokens=120, temperature=0.0, **asks)
            first = next(stream)
            busy = [
                h.worker_id for h in cluster.router.router.directory.handles() if h.num_in_flight
            ]
            cluster.stop_worker(cluster.worker(busy[0]))
            rest = list(stream)
            result = stream.result
        assert result.route.reason.startswith("failover: ")
        ids = TOKENIZER.encode(prompt)
        assert len(first.prompt_logprobs) == len(ids) - 1 and len(first.embedding) == 256
        assert not any(c.prompt_logprobs or c.embedding for c in rest)
        assert result.prompt_logprobs == first.prompt_logprobs
        assert len(result.logprobs) == len(result.token_ids) == 120
        assert sum(len(c.logprobs or ()) for c in [first, *rest]) == 120
        # The reference engine's logprobs of the same greedy stream.
        reference.add_request("ref", ids, SamplingParams(max_tokens=120, logprobs=2))
        want = []
        while reference.has_unfinished():
            want += [o.logprobs.tokens()[0] for o in reference.step() if o.request_id == "ref"]
        for got, ref in zip(result.logprobs, want, strict=True):
            if ref.top_logprobs[0] - ref.top_logprobs[1] < 1e-3:
                break  # a near tie: computed in another order, either token is greedy
            assert got.top_token_ids == ref.top_token_ids
            assert got.logprob == pytest.approx(ref.logprob, abs=1e-3)
    finally:
        cluster.close()


def test_cancelling_a_stream_frees_the_request_on_its_worker(
    cluster: BackgroundCluster, client: Client
) -> None:
    # 3,000 tokens take seconds to decode here: idle within one means the request was aborted.
    stream = client.stream(question(0, 7), max_tokens=3000)
    next(stream)
    stream.close()
    for worker in cluster.workers:
        wait_until_idle(worker, timeout_s=1.0)


def test_a_deadline_reaches_the_worker(cluster: BackgroundCluster, client: Client) -> None:
    with pytest.raises(KvswitchTimeoutError):
        client.generate(question(1, 8), max_tokens=3000, timeout_s=0.3)
    for worker in cluster.workers:
        wait_until_idle(worker, timeout_s=1.0)


def test_health_reports_the_router_and_its_index(cluster: BackgroundCluster) -> None:
    with grpc.insecure_channel(cluster.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("kvswitch.v1.Router", "kvswitch.v1.CacheIndex", ""):
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_no_live_worker_is_unavailable_after_waiting_for_one() -> None:
    cluster = BackgroundCluster(num_workers=0)  # the router waits 0.3 s for a worker
    try:
        c = Client(cluster.address, max_retries=0)
        started_s = time.monotonic()
        with c, pytest.raises(KvswitchError) as error:
            c.generate("anyone there?")
        assert time.monotonic() - started_s >= ROUTER_CONFIG.wait_for_worker_s
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
        assert "no worker is live" in error.value.details
    finally:
        cluster.close()


def health_of(address: str) -> dict[str, int]:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {
            service: stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            for service in ("", "kvswitch.v1.Router", "kvswitch.v1.CacheIndex")
        }


def wait_for_health(address: str, wanted: dict[str, int], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (health := health_of(address)) != wanted:
        assert time.monotonic() < deadline, health
        time.sleep(0.02)


def test_the_router_is_not_serving_while_no_worker_is_routable() -> None:
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        (health_pb2.HealthCheckResponse.NOT_SERVING),
    )
    cluster = BackgroundCluster(num_workers=0)
    try:
        # The index it embeds serves at once: the workers register there.
        assert health_of(cluster.address) == {
            "": not_serving,
            "kvswitch.v1.Router": not_serving,
            "kvswitch.v1.CacheIndex": serving,
        }
        worker = cluster.add_worker("w0")
        wait_for_health(
            cluster.address,
            {"": serving, "kvswitch.v1.Router": serving, "kvswitch.v1.CacheIndex": serving},
        )
        cluster.stop_worker(worker)
        wait_for_health(
            cluster.address,
            {"": not_serving, "kvswitch.v1.Router": not_serving, "kvswitch.v1.CacheIndex": serving},
        )
    finally:
        cluster.close()


def test_a_request_that_finds_no_worker_waits_for_one(reference: LLMEngine) -> None:
    config = dataclasses.replace(ROUTER_CONFIG, wait_for_worker_s=30.0)
    cluster = BackgroundCluster(num_workers=0, router_config=config)
    try:
        with Client(cluster.address, max_retries=0) as c, ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(c.generate, "who is first?", max_tokens=4)
            time.sleep(0.5)
            assert not waiting.done()
            cluster.add_worker("w0")
            result = waiting.result(timeout=30)
            assert list(result.token_ids) == expected(reference, "who is first?", max_tokens=4)
            # ... but never past its deadline.
            cluster.stop_worker(cluster.workers[0])
            cluster.wait_for_workers()
            started_s = time.monotonic()
            with pytest.raises(KvswitchError) as error:
                c.generate("anyone?", max_tokens=4, timeout_s=0.5)
            assert time.monotonic() - started_s < 0.5
            assert error.value.code == grpc.StatusCode.UNAVAILABLE
            assert "no worker is live" in error.value.details
    finally:
        cluster.close()


def test_a_router_with_a_token_refuses_clients_without_it() -> None:
    config = RouterConfig(**{**ROUTER_CONFIG.__dict__, "token": "s3cret"})
    cluster = BackgroundCluster(num_workers=1, router_config=config)
    try:
        c = Client(cluster.address, max_retries=0)
        with c, pytest.raises(KvswitchError) as error:
            c.generate("hello")
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(cluster.address, token="s3cret") as c:
            assert len(c.generate("hello", max_tokens=3).token_ids) == 3
    finally:
        cluster.close()


@pytest.mark.parametrize("model", ["random:llama-1b", "checkpoint-without-tokenizer"])
def test_a_model_without_a_tokenizer_takes_token_ids_and_refuses_text(
    model: str, tmp_path: Path, reference: LLMEngine
) -> None:
    if model == "checkpoint-without-tokenizer":
        model = str(tmp_path)  # a directory with no tokenizer in it
    config = RouterConfig(**{**ROUTER_CONFIG.__dict__, "model": model})
    cluster = BackgroundCluster(num_workers=1, router_config=config)
    try:
        with Client(cluster.address, max_retries=0) as c:
            prompt = [256, *b"token ids need no tokenizer"]
            result = c.generate(prompt_token_ids=prompt, max_tokens=4)
            assert list(result.token_ids) == expected(reference, prompt, max_tokens=4)
            with pytest.raises(KvswitchError) as error:
                c.generate("text needs one", max_tokens=4)
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "send the prompt as token ids" in error.value.details
        if not model.startswith("random:"):
            assert f"{model} has neither tokenizer.json nor tokenizer.model" in error.value.details
    finally:
        cluster.close()


def test_a_checkpoint_with_only_a_sentencepiece_model_takes_text(
    tmp_path: Path, reference: LLMEngine
) -> None:
    # ASCII pieces only, so every id fits the built-in model's 257-token vocabulary.
    build_sentencepiece_model(tmp_path, vocab_size=200)
    tokenizer = SentencePieceTokenizer(tmp_path)
    config = RouterConfig(**{**ROUTER_CONFIG.__dict__, "model": str(tmp_path)})
    cluster = BackgroundCluster(num_workers=1, router_config=config)
    try:
        with Client(cluster.address, max_retries=0) as c:
            result = c.generate("hello router", max_tokens=4)
        prompt = tokenizer.encode("hello router")
        assert prompt[0] == 1 and max(prompt) < 200
        assert result.stats.num_prompt_tokens == len(prompt)
        assert list(result.token_ids) == expected(reference, prompt, max_tokens=4)
    finally:
        cluster.close()


def test_a_router_refuses_a_model_directory_that_does_not_exist(tmp_path: Path) -> None:
    config = RouterConfig(**{**ROUTER_CONFIG.__dict__, "model": str(tmp_path / "typo")})
    with pytest.raises(RouterStartError, match="no such checkpoint directory"):
        asyncio.run(start_router(config))


def test_a_router_whose_index_does_not_answer_says_so() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    index = f"redis+cluster://127.0.0.1:{port}"
    config = RouterConfig(**{**ROUTER_CONFIG.__dict__, "index": index})
    with pytest.raises(RouterStartError, match=re.escape(f"cannot use the Redis at {index}: ")):
        asyncio.run(start_router(config))


def test_a_router_refuses_a_tokenizer_it_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    config = RouterConfig(**{**ROUTER_CONFIG.__dict__, "model": str(tmp_path)})
    with pytest.raises(RouterStartError, match=r"tokenizer\.model cannot be read"):
        asyncio.run(start_router(config))


def test_router_config_is_checked() -> None:
    with pytest.raises(ValueError, match="policy must be one of"):
        RouterConfig(policy="best")
    with pytest.raises(ValueError, match="prefill_weight"):
        RouterConfig(prefill_weight=-1)
    with pytest.raises(ValueError, match="private_weight"):
        RouterConfig(private_weight=float("nan"))
    assert RouterConfig(private_weight=2).policy_weights()["private_weight"] == 2
    with pytest.raises(ValueError, match="max_failovers"):
        RouterConfig(max_failovers=-1)


def test_metrics_are_served_over_http() -> None:
    config = RouterConfig(**{**ROUTER_CONFIG.__dict__, "metrics_port": 0})
    cluster = BackgroundCluster(num_workers=2, router_config=config)
    try:
        with Client(cluster.address, max_retries=0) as c:
            for _ in range(2):
                c.generate("count me", max_tokens=3)
            with pytest.raises(KvswitchError):
                c.generate(prompt_token_ids=[256, 999_999])
        url = f"http://{cluster.router.metrics_address}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
        router = cluster.router.router
    finally:
        cluster.close()

    def value(family: str, sample: str, **labels: str) -> float:
        return sum(
            s.value
            for s in families[family].samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
        )

    requests = "kvswitch_router_requests"
    assert value(requests, f"{requests}_total", finish_reason="length") == 2
    assert value(requests, f"{requests}_total", finish_reason="rejected") == 1
    decisions = "kvswitch_router_routing_decisions"
    assert value(decisions, f"{decisions}_total", policy="cost") == 3
    lookups = "kvswitch_router_index_lookup_seconds"
    assert value(lookups, f"{lookups}_count") == 3
    assert value("kvswitch_router_ttft_seconds", "kvswitch_router_ttft_seconds_count") == 2
    in_flight = families["kvswitch_router_worker_in_flight_requests"]
    assert {s.labels["worker_id"] for s in in_flight.samples} == {"w0", "w1"}
    # What the router only logs now and then is counted, read from its parts at the scrape.
    for name, count in [
        ("index_errors", router.num_lookup_errors),
        ("pending_guesses_confirmed", router.pending.num_confirmed),
        ("pending_guesses_expired", router.pending.num_expired),
        ("background_errors", router.directory.num_loop_errors),
    ]:
        family = f"kvswitch_router_{name}"
        assert value(family, f"{family}_total") == count == 0


def test_requests_still_route_when_the_index_cannot_answer(
    reference: LLMEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """The Redis index goes away: the router keeps the workers it knows and routes on load,
    counts each failed lookup in its metrics, and says so in its log once, not per request."""
    with LocalRedis() as redis_server:
        config = RouterConfig(**{**ROUTER_CONFIG.__dict__, "index": redis_server.url})
        worker_config = dataclasses.replace(WORKER_CONFIG, metrics_port=0)
        cluster = BackgroundCluster(2, router_config=config, worker_config=worker_config)
        try:
            redis_server.stop()
            with (
                caplog.at_level(logging.WARNING, "kvswitch.router.router"),
                Client(cluster.address, max_retries=0) as c,
            ):
                for _ in range(3):
                    result = c.generate("still here?", max_tokens=4)
                    assert result.token_ids == expected(reference, "still here?", max_tokens=4)
                    assert result.route.num_matched_blocks == 0
            assert cluster.router.router.num_lookup_errors == 3
            warnings = [r for r in caplog.records if "the index cannot answer" in r.message]
            assert len(warnings) == 1
            # The workers' publishers find the index gone too, and count it.
            deadline = time.monotonic() + 10
            while not all(_counter(w.metrics_address, "index_errors") for w in cluster.workers):
                assert time.monotonic() < deadline, "a worker never counted the index failing"
                time.sleep(0.05)
        finally:
            cluster.close()


def _counter(metrics_address: str | None, name: str) -> float:
    """A worker's kvswitch_worker_<name>_total, scraped."""
    url = f"http://{metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        families = text_string_to_metric_families(response.read().decode())
        return next(
            s.value
            for f in families
            for s in f.samples
            if s.name == f"kvswitch_worker_{name}_total"
        )


class SlowTokenizer(ByteTokenizer):
    """Takes a second to tokenize, as a BPE tokenizer takes on a very long prompt (and says
    so: text past 1,024 characters goes to a thread)."""

    inline_chars = 1024

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        time.sleep(1.0)
        return super().encode(text, add_bos=add_bos)

    def encode_array(self, text: str) -> np.ndarray:
        time.sleep(1.0)
        return super().encode_array(text)


def test_a_long_text_prompt_is_tokenized_off_the_event_loop(reference: LLMEngine) -> None:
    cluster = BackgroundCluster(num_workers=1)
    cluster.router.router.tokenizer = SlowTokenizer()
    long_prompt = "a long prompt " * 200
    try:
        with Client(cluster.address, max_retries=0) as c, ThreadPoolExecutor(1) as pool:
            slow = pool.submit(c.generate, long_prompt, max_tokens=2)
            time.sleep(0.2)  # it is tokenizing now
            started_s = time.monotonic()
            quick = c.generate(prompt_token_ids=[256, *b"meanwhile"], max_tokens=2)
            assert time.monotonic() - started_s < 0.6  # not stuck behind the tokenizer
            assert not slow.done()
            assert list(slow.result(timeout=30).token_ids) == expected(
                reference, long_prompt, max_tokens=2
            )
        assert list(quick.token_ids) == expected(reference, [256, *b"meanwhile"], max_tokens=2)
    finally:
        cluster.close()


def test_a_request_is_counted_before_its_last_message_leaves() -> None:
    """A client that holds its answer (an error status, or the final response) finds its request
    in /metrics already: the count comes before the status or the final message is sent."""
    metrics = RouterMetrics()

    def count(reason: str) -> float | None:
        return metrics.registry.get_sample_value(
            "kvswitch_router_requests_total", {"finish_reason": reason}
        )

    class Context:  # stands in for grpc's ServicerContext: abort is where the status leaves
        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            seen.append(count("rejected"))

    seen: list[float | None] = []
    outcome = outcome_module.Outcome("r1", metrics)
    asyncio.run(outcome_module.abort(Context(), outcome, grpc.StatusCode.INVALID_ARGUMENT, "x"))
    assert seen == [1.0]
    outcome.record()  # the handler's finally: no second count
    assert count("rejected") == 1.0

    final = router_pb2.GenerateFinal(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    outcome_module.Outcome("r2", metrics).finished(final)  # just before the final is written
    assert count("length") == 1.0
