"""Disaggregated prefill through the router, over real gRPC: a long prompt is prefilled on the
prefill worker and decoded on the decode worker, which takes its KV blocks; the client sees one
stream with the tokens one worker alone would have produced."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Iterator

import grpc
import pytest

from kvswitch.cache_index.audit import audit
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.client import Client, KvswitchError
from kvswitch.router.disagg import DisaggConfig, prefill_locally
from kvswitch.router.policy import WorkerState
from kvswitch.v1 import common_pb2, router_pb2, router_pb2_grpc
from kvswitch.worker.engine import LLMEngine
from kvswitch.worker.engine_config import EngineConfig
from kvswitch.worker.request import SamplingParams
from kvswitch.worker.server import WorkerServer
from tests.router.harness import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    ROUTER_CONFIG,
    BackgroundCluster,
    paused_core,
    wait_until,
)

DOCUMENT = b"A long shared document, block after block of it. "
MAX_TOKENS = 8
STREAMED = dataclasses.replace(ROUTER_CONFIG, kv_transport="grpc")


def prompt_of(tag: int, num_repeats: int = 6) -> list[int]:
    return [256, tag, *DOCUMENT * num_repeats]  # 6 repeats: 296 tokens, 18 full blocks


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    return LLMEngine(EngineConfig())


def expected(engine: LLMEngine, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]


@pytest.fixture(scope="module")
def cluster() -> Iterator[BackgroundCluster]:
    cluster = BackgroundCluster(num_workers=0)
    cluster.add_worker("p0", role="prefill")
    cluster.add_worker("d0", role="decode")
    cluster.add_worker("d1", role="decode")
    yield cluster
    cluster.close()


def num_cached_blocks(cluster: BackgroundCluster, worker: WorkerServer, prompt: list[int]) -> int:
    hashes = hash_prompt_blocks(prompt, BLOCK_SIZE, worker.engine.namespace)
    future = worker.engine.read_blocks(hashes, with_data=False)
    return future.result(timeout=10)[0]


def num_held_blocks(worker: WorkerServer, timeout_s: float = 2.0) -> int:
    """Blocks no request holds but a lease does, once the leases have had ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = worker.engine.load
        held = load.num_total_blocks - load.num_free_blocks
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.02)


def num_held_blocks_now(worker: WorkerServer, prompt: list[int]) -> int:
    """Blocks no request holds but a lease does, as the engine core has them once it has
    handled every command sent to it so far."""
    hashes = hash_prompt_blocks(prompt, BLOCK_SIZE, worker.engine.namespace)
    # NOTE: two calls in a row: the core answers a call before it sends the load of that round,
    # and that load is here before the answer to the next call.
    for _ in range(2):
        worker.engine.read_blocks(hashes, with_data=False).result(timeout=10)
    load = worker.engine.load
    assert not load.num_running_requests and not load.num_waiting_requests, load
    return load.num_total_blocks - load.num_free_blocks


def guessed(cluster: BackgroundCluster, prompt: list[int], lora: str = "") -> dict[str, int]:
    """The workers this router guesses will soon hold the prompt's blocks, and how many."""

    async def read() -> dict[str, int]:
        router = cluster.router.router
        plan = router.plan(token_ids=prompt, lora=lora or None)
        return router.pending.match(plan.block_hashes, {})

    return cluster.run(read())


def num_failovers(cluster: BackgroundCluster) -> float:
    registry = cluster.router.metrics.registry
    return sum(
        registry.get_sample_value("kvswitch_router_failovers_total", {"kind": kind}) or 0.0
        for kind in ("mid_stream", "before_first_token")
    )


def test_a_long_prompt_is_prefilled_on_the_prefill_worker_and_decoded_elsewhere(
    cluster: BackgroundCluster, reference: LLMEngine
) -> None:
    prompt = prompt_of(1)
    with Client(cluster.address) as client:
        result = client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, timeout_s=60)
    assert result.token_ids == expected(reference, prompt)
    stats = result.stats
    assert stats.prefill_worker_id == "p0"
    assert stats.decode_worker_id in ("d0", "d1") and stats.worker_id == stats.decode_worker_id
    assert stats.num_transferred_blocks == 18
    assert (stats.num_prompt_tokens, stats.num_output_tokens) == (len(prompt), MAX_TOKENS)
    decoder = cluster.worker(stats.decode_worker_id)
    assert num_cached_blocks(cluster, decoder, prompt) == 18
    assert num_held_blocks(cluster.worker("p0")) == 0  # released once taken, no leak
    assert num_held_blocks(decoder) == 0

    # The decode worker that holds the prompt now prefills what little is new itself.
    follow_up = [*prompt, *b" And a question."]
    with Client(cluster.address) as client:
        again = client.generate(prompt_token_ids=follow_up, max_tokens=MAX_TOKENS, timeout_s=60)
    assert again.token_ids == expected(reference, follow_up)
    assert again.stats.prefill_worker_id == again.stats.decode_worker_id == decoder.worker_id
    assert again.stats.num_cached_tokens == 18 * BLOCK_SIZE
    assert again.stats.num_transferred_blocks == 0


def test_a_short_prompt_is_prefilled_where_it_is_decoded(
    cluster: BackgroundCluster, reference: LLMEngine
) -> None:
    prompt = [256, 2, *b"A short question?"]
    with Client(cluster.address) as client:
        result = client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, timeout_s=60)
    assert result.token_ids == expected(reference, prompt)
    assert result.stats.prefill_worker_id == result.stats.decode_worker_id != "p0"


def test_a_request_done_at_its_first_token_frees_the_prefill_workers_blocks(
    cluster: BackgroundCluster, reference: LLMEngine
) -> None:
    prompt = prompt_of(3)
    first = expected(reference, prompt, max_tokens=1)[0]
    with Client(cluster.address) as client:
        stopped = client.generate(
            prompt_token_ids=prompt, max_tokens=MAX_TOKENS, stop_token_ids=[first], timeout_s=60
        )
        one = client.generate(prompt_token_ids=prompt_of(4), max_tokens=1, timeout_s=60)
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert one.token_ids == expected(reference, prompt_of(4), max_tokens=1)
    for result in (stopped, one):
        assert result.stats.prefill_worker_id == result.stats.decode_worker_id == "p0"
    # Told to let go, not left to the lease (5 s).
    assert num_held_blocks(cluster.worker("p0"), timeout_s=1.0) == 0


def test_the_decode_side_dying_mid_transfer_fails_over_with_the_same_tokens(
    reference: LLMEngine,
) -> None:
    """The decode worker stops once the first blocks reached it (mid-transfer, or later, wherever
    the stop lands); the router resumes the stream on the other decode worker, which takes the
    blocks too: the client's tokens are one worker's, and no worker is left holding blocks."""
    # NOTE: over gRPC, in chunks of 32 blocks: through shared memory the whole prompt moves in
    # one chunk, and the stop would land after it.
    with BackgroundCluster(num_workers=0, router_config=STREAMED) as cluster:
        cluster.add_worker("p0", role="prefill")
        decoders = [cluster.add_worker(f"d{i}", role="decode") for i in range(2)]
        prompt = [256, *range(1, 256), *DOCUMENT * 70]  # 3686 tokens: 230 blocks
        want = expected(reference, prompt)
        with (
            concurrent.futures.ThreadPoolExecutor(1) as pool,
            Client(cluster.address) as client,
        ):
            running = pool.submit(
                client.generate, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, timeout_s=120
            )
            taker = None
            while taker is None and not running.done():
                taker = next((d for d in decoders if num_cached_blocks(cluster, d, prompt)), None)
            assert taker is not None, "the request ended before any block moved"
            cluster.stop_worker(taker)
            result = running.result(timeout=120)
        assert result.token_ids == want
        assert result.stats.prefill_worker_id == "p0"
        survivor = next(d for d in decoders if d is not taker)
        assert result.stats.decode_worker_id == survivor.worker_id
        assert num_held_blocks(cluster.worker("p0")) == 0
        assert num_held_blocks(survivor) == 0
        time.sleep(0.3)  # the workers publish their events every 20 ms
        audits = cluster.run(audit(cluster.router.index))
        assert sorted((a.worker_id, a.num_stale, a.num_missing) for a in audits) == sorted(
            [("p0", 0, 0), (survivor.worker_id, 0, 0)]
        )


def test_the_prefill_side_dying_mid_transfer_is_recomputed_with_the_same_tokens(
    reference: LLMEngine,
) -> None:
    """The prefill worker stops once the first blocks left it: the decode worker computes what
    did not arrive (recompute, the default), and the client's tokens are one worker's."""
    # NOTE: over gRPC, in chunks of 32 blocks: through shared memory the whole prompt moves in
    # one chunk, and the stop would land after it.
    with BackgroundCluster(num_workers=0, router_config=STREAMED) as cluster:
        prefiller = cluster.add_worker("p0", role="prefill")
        decoder = cluster.add_worker("d0", role="decode")
        prompt = [256, *range(2, 256), *DOCUMENT * 70]
        want = expected(reference, prompt)
        with (
            concurrent.futures.ThreadPoolExecutor(1) as pool,
            Client(cluster.address) as client,
        ):
            running = pool.submit(
                client.generate, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, timeout_s=120
            )
            while not running.done() and not num_cached_blocks(cluster, decoder, prompt):
                pass
            cluster.stop_worker(prefiller)
            result = running.result(timeout=120)
        assert result.token_ids == want
        assert (result.stats.prefill_worker_id, result.stats.decode_worker_id) == ("p0", "d0")
        assert num_held_blocks(decoder) == 0
        time.sleep(0.3)  # the worker publishes its events every 20 ms
        audits = cluster.run(audit(cluster.router.index))
        assert [(a.worker_id, a.num_stale, a.num_missing) for a in audits] == [("d0", 0, 0)]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_transfer_that_cannot_be_made_is_recomputed_or_fails_as_configured(policy: str) -> None:
    """Blocks of another layout (a bfloat16 decode worker, a float32 prefill worker) never
    move: the decode worker computes the prompt itself, or the client gets ABORTED."""
    config = dataclasses.replace(ROUTER_CONFIG, on_transfer_failure=policy)
    with BackgroundCluster(num_workers=0, router_config=config) as cluster:
        cluster.add_worker("p0", role="prefill")
        decoder = cluster.add_worker("d0", role="decode", dtype="bfloat16")
        prompt = prompt_of(7)
        with Client(cluster.address, max_retries=0) as client:
            if policy == "fail":
                with pytest.raises(KvswitchError) as error:
                    client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, timeout_s=60)
                assert error.value.code == grpc.StatusCode.ABORTED
                assert "the KV transfer from" in str(error.value)
            else:
                result = client.generate(
                    prompt_token_ids=prompt, max_tokens=MAX_TOKENS, timeout_s=60
                )
                assert len(result.token_ids) == MAX_TOKENS
                assert result.stats.num_transferred_blocks == 0
                assert result.stats.decode_worker_id == "d0"
        assert num_held_blocks(cluster.worker("p0")) == 0
        assert num_held_blocks(decoder) == 0


def test_chunked_prefill_and_preemption_on_the_decode_side_keep_the_tokens(
    reference: LLMEngine,
) -> None:
    """Both sides prefill in chunks of 48 tokens; the decode worker holds 40 blocks, too few for
    the four prompts of 18 blocks at once, so it preempts and recomputes some: every client still
    gets one worker's tokens."""
    with BackgroundCluster(num_workers=0) as cluster:
        cluster.add_worker("p0", role="prefill", max_num_batched_tokens=48)
        decoder = cluster.add_worker(
            "d0", role="decode", max_num_batched_tokens=48, kv_cache_bytes=40 * BLOCK_BYTES
        )
        prompts = [prompt_of(10 + i) for i in range(4)]
        with (
            concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool,
            Client(cluster.address) as client,
        ):
            results = list(
                pool.map(
                    lambda p: client.generate(prompt_token_ids=p, max_tokens=128, timeout_s=120),
                    prompts,
                )
            )
        for prompt, result in zip(prompts, results, strict=True):
            assert result.token_ids == expected(reference, prompt, max_tokens=128)
            assert (result.stats.prefill_worker_id, result.stats.decode_worker_id) == ("p0", "d0")
        assert decoder.engine.counters.num_preemptions > 0
        assert num_held_blocks(cluster.worker("p0")) == 0
        assert num_held_blocks(decoder) == 0


def test_an_idle_worker_takes_a_busy_holders_prefix_instead_of_computing_it(
    reference: LLMEngine,
) -> None:
    """Peer block fetch between two workers of role both: the document's holder is busy with a
    long answer, so the next question about it goes to the idle worker, which takes the
    document's blocks from the holder and computes only the question."""
    with BackgroundCluster(num_workers=2) as cluster:
        document = prompt_of(20)
        fetch = {"fetch_token_cost": 0.01, "fetch_latency_tokens": 1.0}
        with Client(cluster.address) as client:
            first = client.generate(prompt_token_ids=document, max_tokens=2, timeout_s=60)
            holder = first.stats.worker_id
            # The same document with a long answer: its holder is the cheapest, and stays busy.
            busy = client.stream(
                prompt_token_ids=[*document, 1], max_tokens=1500, weights=fetch, timeout_s=120
            )
            next(iter(busy))  # its first token: it runs
            deadline = time.monotonic() + 10
            while not cluster.worker(holder).engine.load.num_running_requests:
                assert time.monotonic() < deadline, "the long answer does not run on the holder"
                time.sleep(0.005)
            question = [*document, *b" A question?"]
            asked = client.generate(
                prompt_token_ids=question, max_tokens=MAX_TOKENS, weights=fetch, timeout_s=60
            )
            # NOTE: asked while the long answer ran; the rest of its 1,500 tokens (a minute on a
            # busy machine) is not needed.
            busy.close()
        assert asked.token_ids == expected(reference, question)
        assert asked.stats.worker_id != holder
        assert asked.route.reason.endswith("its prefix taken from a peer")
        assert asked.stats.num_transferred_blocks == 18
        assert asked.stats.num_cached_tokens == 18 * BLOCK_SIZE


@pytest.mark.parametrize(
    ("num_uncached", "queued", "why"),
    [
        (255, 0, "255 uncached tokens"),
        (256, 0, None),
        (4096, 32769, "prefill queue 32769 tokens"),
        (4096, 32768, None),
    ],
)
def test_the_decode_worker_prefills_short_prompts_and_when_prefill_queues_are_deep(
    num_uncached: int, queued: int, why: str | None
) -> None:
    prefill_worker = WorkerState("p", 0, queued, num_prefill_tokens=queued)
    assert prefill_locally(num_uncached, prefill_worker, DisaggConfig()) == why
    assert prefill_locally(num_uncached, None, DisaggConfig()) == "no prefill worker"


def test_bad_disaggregation_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="on_transfer_failure must be one of recompute, fail"):
        DisaggConfig(on_transfer_failure="retry")
    with pytest.raises(ValueError, match="lease_s must be in"):
        DisaggConfig(lease_s=0)
    with pytest.raises(ValueError, match="transport must be"):
        DisaggConfig(transport="rdma")


def test_a_character_split_between_the_prefill_and_the_decode_worker_is_whole(
    cluster: BackgroundCluster, reference: LLMEngine
) -> None:
    # The prefill worker's one token starts a UTF-8 character the decode worker's tokens end:
    # the prefill side must hold its half back (not flush it as U+FFFD) for the other to write.
    prompt = next(
        p
        for p in (prompt_of(tag) for tag in range(1, 256))
        if 0xC2 <= expected(reference, p, max_tokens=1)[0] <= 0xF4
    )
    with Client(cluster.address) as client:
        result = client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, timeout_s=60)
    assert result.stats.prefill_worker_id == "p0" != result.stats.decode_worker_id
    assert result.token_ids == expected(reference, prompt)
    assert result.text == bytes(result.token_ids).decode("utf-8", errors="replace")


def test_a_burst_of_disaggregated_requests_spreads_over_the_decode_workers(
    reference: LLMEngine,
) -> None:
    """Eight long prompts at once on four decode workers: each decode worker is charged as it
    is chosen, before its request's prefill ends, so the burst does not pile onto the one that
    looked best (d0, the largest cache: every tie goes to it). The prefill worker's core is
    held until all eight are routed."""
    with BackgroundCluster(num_workers=0) as cluster:
        prefiller = cluster.add_worker("p0", role="prefill")
        cluster.add_worker("d0", role="decode", kv_cache_bytes=512 * BLOCK_BYTES)
        for i in range(1, 4):
            cluster.add_worker(f"d{i}", role="decode")
        directory = cluster.router.router.directory
        wait_until(
            lambda: all(h.load is not None for h in directory.handles()), "a load report each"
        )
        prompts = [prompt_of(40 + i) for i in range(8)]
        with (
            concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool,
            Client(cluster.address) as client,
        ):
            with paused_core(prefiller):
                running = [
                    pool.submit(
                        client.generate, prompt_token_ids=p, max_tokens=MAX_TOKENS, timeout_s=120
                    )
                    for p in prompts
                ]
                wait_until(
                    lambda: (
                        prefiller.engine.num_requests == len(prompts)
                        or any(r.done() for r in running)
                    ),
                    "all eight prefills submitted",
                )
            results = [r.result(timeout=120) for r in running]
        for prompt, result in zip(prompts, results, strict=True):
            assert result.token_ids == expected(reference, prompt)
            assert result.stats.prefill_worker_id == "p0"
        per_decoder = collections.Counter(r.stats.decode_worker_id for r in results)
        assert max(per_decoder.values()) <= 3, per_decoder
        assert num_failovers(cluster) == 0


def test_a_decode_worker_that_leaves_during_the_prefill_is_replaced_without_a_failover(
    reference: LLMEngine,
) -> None:
    """The decode worker chosen with the prefill worker leaves while the prompt is prefilled:
    the router chooses another decode worker once the prefill is done, and counts no failover
    (nothing failed on the one that left: it never got the request)."""
    with BackgroundCluster(num_workers=0) as cluster:
        prefiller = cluster.add_worker("p0", role="prefill")
        leaving = cluster.add_worker("d0", role="decode")
        prompt = prompt_of(50)
        with (
            concurrent.futures.ThreadPoolExecutor(1) as pool,
            Client(cluster.address, max_retries=0) as client,
        ):
            with paused_core(prefiller):
                running = pool.submit(
                    client.generate, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, timeout_s=120
                )
                wait_until(
                    lambda: prefiller.engine.num_requests == 1 or running.done(),
                    "the prefill submitted",
                )
                cluster.add_worker("d1", role="decode")
                cluster.stop_worker(leaving)
                cluster.wait_for_workers()
            result = running.result(timeout=120)
        assert result.token_ids == expected(reference, prompt)
        assert (result.stats.prefill_worker_id, result.stats.decode_worker_id) == ("p0", "d1")
        assert result.stats.num_transferred_blocks == 18
        assert not result.route.reason.startswith("failover"), result.route.reason
        assert num_failovers(cluster) == 0
        handles = cluster.router.router.directory.handles()
        assert {h.worker_id: h.num_in_flight for h in handles} == {"p0": 0, "d1": 0}


def test_a_refused_disaggregated_request_leaves_no_guess_and_no_load_behind(
    cluster: BackgroundCluster,
) -> None:
    """The prefill worker refuses the request (INVALID_ARGUMENT: a token outside its vocabulary,
    which the router does not know): neither it nor the decode worker chosen with it is guessed
    to hold the prompt, nor charged for it, and the client reads its own request id in the
    error."""
    prompt = [*prompt_of(60), 257]
    with Client(cluster.address, max_retries=0) as client, pytest.raises(KvswitchError) as error:
        client.generate(
            prompt_token_ids=prompt, max_tokens=MAX_TOKENS, request_id="mine", timeout_s=60
        )
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(error.value) == (
        "request mine failed with INVALID_ARGUMENT: token id 257 is outside the vocabulary [0, 257)"
    )
    assert guessed(cluster, prompt) == {}
    directory = cluster.router.router.directory
    assert all(
        (h.num_in_flight, h.num_prefill_tokens, h.num_output_tokens) == (0, 0, 0)
        for h in directory.handles()
    )


def test_a_request_cancelled_after_its_prefill_releases_the_lease_at_once() -> None:
    """The client goes away after its first token, before the decode worker took the blocks:
    the router tells the prefill worker to let them go then, not a lease (60 s here) later."""
    config = dataclasses.replace(ROUTER_CONFIG, kv_lease_s=60.0)
    with BackgroundCluster(num_workers=0, router_config=config) as cluster:
        prefiller = cluster.add_worker("p0", role="prefill")
        decoder = cluster.add_worker("d0", role="decode")
        prompt = prompt_of(70)
        request = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS),
        )
        with grpc.insecure_channel(cluster.address) as channel, paused_core(decoder):
            call = router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120)
            first = next(call)
            assert first.chunk.token_ids  # the prefill worker's token
            # The decode worker cannot start its pull: the prompt's 18 blocks stay leased.
            wait_until(
                lambda: (
                    prefiller.engine.num_requests == 0
                    and num_held_blocks_now(prefiller, prompt) == 18
                ),
                "the prefill finished and its blocks leased",
            )
            call.cancel()
            wait_until(
                lambda: num_held_blocks_now(prefiller, prompt) == 0,
                "the lease released",
                timeout_s=30.0,
            )
