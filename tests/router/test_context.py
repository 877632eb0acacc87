"""The model's context length: workers announce theirs when they register, the router refuses a
prompt no worker can hold before routing it, sends a long prompt only where it fits, and counts
a request's outstanding output from what the context leaves, not from what a client asked."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator

import grpc
import pytest

from kvswitch.client import Client, KvswitchError
from kvswitch.router.servicer import DEFAULT_MAX_TOKENS
from tests.router.harness import BLOCK_BYTES, BLOCK_SIZE, WORKER_CONFIG, BackgroundCluster

SHORT_BLOCKS = 24  # the short worker's KV cache holds a context of 24 blocks
SHORT_CONTEXT = SHORT_BLOCKS * BLOCK_SIZE  # 384 tokens
LONG_CONTEXT = 256 * BLOCK_SIZE  # the harness's worker: 4096 tokens


@pytest.fixture(scope="module")
def cluster() -> Iterator[BackgroundCluster]:
    short = dataclasses.replace(WORKER_CONFIG, kv_cache_bytes=SHORT_BLOCKS * BLOCK_BYTES)
    with BackgroundCluster(1, worker_config=short) as cluster:
        yield cluster


def prompt(num_tokens: int, seed: int) -> list[int]:
    return [256, *random.Random(seed).choices(range(256), k=num_tokens - 1)]


def handles(cluster: BackgroundCluster) -> dict[str, int]:
    """Each live worker's context length, as the router learned it."""
    return {h.worker_id: h.info.max_model_len for h in cluster.router.router.directory.handles()}


def num_requests_ended(cluster: BackgroundCluster, worker_id: str) -> float:
    """Requests the worker has ended, whatever their end (refusals included)."""
    registry = cluster.worker(worker_id).metrics.registry
    return sum(
        sample.value
        for metric in registry.collect()
        if metric.name == "kvswitch_worker_requests"
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


def test_the_router_learns_each_workers_context(cluster: BackgroundCluster) -> None:
    assert cluster.worker("w0").engine.facts.max_model_len == SHORT_CONTEXT
    assert handles(cluster) == {"w0": SHORT_CONTEXT}


def test_output_past_the_context_is_counted_as_what_the_context_leaves(
    cluster: BackgroundCluster,
) -> None:
    num_prompt_tokens = SHORT_CONTEXT - 40
    (handle,) = cluster.router.router.directory.handles()
    with Client(cluster.address, timeout_s=60) as client:
        stream = client.stream(
            prompt_token_ids=prompt(num_prompt_tokens, 1), max_tokens=32768, temperature=0
        )
        next(iter(stream))
        # NOTE: read while the request runs: a client's 32768 would make this worker look
        # busy for 32768 more tokens, and the next request about its cached prompt go elsewhere.
        assert 0 < handle.num_outstanding_tokens() <= 40
        for _ in stream:
            pass
    result = stream.result
    assert result.finish_reason == "length"
    assert result.stats.output_tokens == 40
    assert handle.num_outstanding_tokens() == 0


def test_a_prompt_that_fills_the_context_is_refused_before_routing(
    cluster: BackgroundCluster,
) -> None:
    num_ended = num_requests_ended(cluster, "w0")
    with Client(cluster.address, max_retries=0) as client, pytest.raises(KvswitchError) as error:
        client.generate(prompt_token_ids=prompt(SHORT_CONTEXT, 2))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the prompt has {SHORT_CONTEXT} tokens" in error.value.details
    assert f"the model's context length is {SHORT_CONTEXT} tokens" in error.value.details
    assert num_requests_ended(cluster, "w0") == num_ended  # the worker never saw it


def test_a_long_prompt_goes_only_to_a_worker_whose_context_holds_it(
    cluster: BackgroundCluster,
) -> None:
    cluster.add_worker("long", kv_cache_bytes=WORKER_CONFIG.kv_cache_bytes)  # 4096 tokens
    try:
        assert handles(cluster) == {"w0": SHORT_CONTEXT, "long": LONG_CONTEXT}
        with Client(cluster.address) as client:
            for seed in range(4):
                result = client.generate(
                    prompt_token_ids=prompt(SHORT_CONTEXT + 50, 10 + seed),
                    max_tokens=2,
                    policy="round_robin",
                )
                assert result.stats.worker_id == "long"
            # a short one may go to either; round robin sends two of them one to each
            served = {
                client.generate(
                    prompt_token_ids=prompt(20, 20 + seed), policy="round_robin"
                ).stats.worker_id
                for seed in range(2)
            }
            assert served == {"w0", "long"}
    finally:
        cluster.stop_worker(cluster.worker("long"))
        deadline = time.monotonic() + 10
        while "long" in handles(cluster):
            assert time.monotonic() < deadline
            time.sleep(0.02)


def test_max_tokens_zero_still_means_the_default(cluster: BackgroundCluster) -> None:
    with Client(cluster.address) as client:
        result = client.generate(prompt_token_ids=prompt(20, 3), max_tokens=0)
    assert result.stats.output_tokens == DEFAULT_MAX_TOKENS
