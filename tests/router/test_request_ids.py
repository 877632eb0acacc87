"""A request's identity on the workers is the router's own (a fresh id per request), not the
client's ``request_id``: two routers, or a gateway reusing ids, never collide on a worker, and a
later request under the same client id never touches an earlier one's blocks."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
from collections.abc import Iterator

import pytest

from kvswitch.cache_index.index import ROLES
from kvswitch.client import Client
from kvswitch.router.server import RouterServer, start_router
from kvswitch.worker.engine import LLMEngine
from kvswitch.worker.engine_config import EngineConfig
from kvswitch.worker.request import SamplingParams
from tests.router.harness import ROUTER_CONFIG, BackgroundCluster, paused_core, wait_until
from tests.router.test_disaggregation import num_held_blocks_now, prompt_of

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    return LLMEngine(EngineConfig())


def expected(engine: LLMEngine, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]


@contextlib.contextmanager
def second_router(cluster: BackgroundCluster) -> Iterator[RouterServer]:
    """Another router over the same workers (it reads the first one's index), sharing no state
    with it: no guesses, no in-flight counts, no running ids."""
    config = dataclasses.replace(ROUTER_CONFIG, index=f"grpc://{cluster.address}")
    router = cluster.run(start_router(config))
    try:
        wanted = {w.worker_id for w in cluster.workers}
        wait_until(
            lambda: {h.worker_id for h in router.router.directory.routable(roles=ROLES)} == wanted,
            "the second router sees the workers",
        )
        yield router
    finally:
        cluster.run(router.stop(0))


def test_one_client_id_through_two_routers_at_once_on_one_worker(reference: LLMEngine) -> None:
    """Two routers send requests with the same client id to the one worker, both running there
    at once: each gets its own tokens (the worker knew them apart), under the client's id."""
    with BackgroundCluster(num_workers=1) as cluster:
        worker = cluster.workers[0]
        prompts = [[256, 1, *b"The first question?"], [256, 2, *b"The second question?"]]
        with (
            second_router(cluster) as other,
            concurrent.futures.ThreadPoolExecutor(2) as pool,
            Client(cluster.address, max_retries=0) as one,
            Client(other.address, max_retries=0) as two,
        ):
            with paused_core(worker):
                running = [
                    pool.submit(
                        client.generate,
                        prompt_token_ids=prompt,
                        max_tokens=MAX_TOKENS,
                        request_id="twin",
                        timeout_s=120,
                    )
                    for client, prompt in zip((one, two), prompts, strict=True)
                ]
                wait_until(
                    lambda: worker.engine.num_requests == 2 or any(r.done() for r in running),
                    "both requests submitted to the worker",
                )
            results = [r.result(timeout=120) for r in running]
        for prompt, result in zip(prompts, results, strict=True):
            assert result.request_id == "twin"
            assert result.token_ids == expected(reference, prompt)
            assert result.stats.worker_id == worker.worker_id


def test_the_same_client_id_twice_on_one_router_is_served_twice(reference: LLMEngine) -> None:
    """A gateway reusing its ids: the client's id is a label, so one router serves two requests
    under it at once."""
    with BackgroundCluster(num_workers=1) as cluster:
        worker = cluster.workers[0]
        prompts = [[256, 3, *b"One more question?"], [256, 4, *b"And another one?"]]
        with (
            concurrent.futures.ThreadPoolExecutor(2) as pool,
            Client(cluster.address, max_retries=0) as client,
        ):
            with paused_core(worker):
                running = [
                    pool.submit(
                        client.generate,
                        prompt_token_ids=prompt,
                        max_tokens=MAX_TOKENS,
                        request_id="again",
                        timeout_s=120,
                    )
                    for prompt in prompts
                ]
                wait_until(
                    lambda: worker.engine.num_requests == 2 or any(r.done() for r in running),
                    "both requests submitted to the worker",
                )
            results = [r.result(timeout=120) for r in running]
        for prompt, result in zip(prompts, results, strict=True):
            assert result.token_ids == expected(reference, prompt)


def test_a_later_request_under_the_same_client_id_leaves_an_earlier_lease_alone(
    reference: LLMEngine,
) -> None:
    """The first request's prompt is prefilled and its blocks leased for the decode worker, which
    cannot take them yet; a second request with the same client id, through another router, is
    prefilled on the same worker and done at its first token: its lease is released, the first
    one's stays (18 blocks) until the decode worker takes them."""
    config = dataclasses.replace(ROUTER_CONFIG, kv_lease_s=60.0)
    with BackgroundCluster(num_workers=0, router_config=config) as cluster:
        prefiller = cluster.add_worker("p0", role="prefill")
        decoder = cluster.add_worker("d0", role="decode")
        first, second = prompt_of(80), prompt_of(81)
        with (
            second_router(cluster) as other,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
            Client(cluster.address, max_retries=0) as one,
            Client(other.address, max_retries=0) as two,
        ):
            with paused_core(decoder):
                running = pool.submit(
                    one.generate,
                    prompt_token_ids=first,
                    max_tokens=MAX_TOKENS,
                    request_id="reused",
                    timeout_s=120,
                )
                wait_until(
                    lambda: (
                        prefiller.engine.num_requests == 0
                        and num_held_blocks_now(prefiller, first) == 18
                    ),
                    "the first prompt prefilled and its blocks leased",
                )
                done = two.generate(
                    prompt_token_ids=second, max_tokens=1, request_id="reused", timeout_s=60
                )
                assert done.stats.prefill_worker_id == "p0"
                assert num_held_blocks_now(prefiller, first) == 18
            result = running.result(timeout=120)
        assert done.token_ids == expected(reference, second, max_tokens=1)
        assert result.token_ids == expected(reference, first)
        assert (result.stats.prefill_worker_id, result.stats.decode_worker_id) == ("p0", "d0")
        assert result.stats.num_transferred_blocks == 18
        wait_until(lambda: num_held_blocks_now(prefiller, first) == 0, "the lease released")
