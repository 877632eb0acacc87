"""Disaggregated prefill between two live workers over real gRPC: a prefill worker computes the
prompt and holds its blocks under a lease; a decode worker takes the ones it lacks and decodes the
rest, token for token as one worker alone would. Both publish to the embedded index of a router
process: a worker takes blocks only from the live workers listed there."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator

import grpc
import pytest

from kvswitch.cache_index.grpc_index import GrpcIndex
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.cache_index.index import WorkerInfo
from kvswitch.serving import start_server_process
from kvswitch.v1 import common_pb2, worker_pb2
from kvswitch.worker.server import WorkerConfig
from tests.worker.background import BackgroundWorker

BLOCK_SIZE = 16
NUM_BLOCKS = 64
CONFIG = WorkerConfig(port=0, kv_cache_bytes=NUM_BLOCKS * (32 << 10), grace_s=0.0)
DOCUMENT = b"A long shared document, block after block of it. "
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def index_address() -> Iterator[str]:
    """A router process, for its embedded index."""
    router, address = start_server_process(["router", "--port", "0"])
    yield address
    router.terminate()
    router.wait(timeout=30)


async def on_index(index_address: str, call):
    index = GrpcIndex(index_address)
    try:
        return await call(index)
    finally:
        await index.close()


def live_addresses(index_address: str) -> set[str]:
    workers = asyncio.run(on_index(index_address, lambda index: index.live_workers()))
    return {w.address for w in workers}


@pytest.fixture(scope="module")
def workers(
    index_address: str,
) -> Iterator[tuple[BackgroundWorker, BackgroundWorker, BackgroundWorker]]:
    """(prefill, decode, alone): the first two in the index's fleet; the third, outside it,
    serves each prompt by itself, for reference."""
    in_fleet = dataclasses.replace(CONFIG, index=f"grpc://{index_address}")
    started = [BackgroundWorker(in_fleet), BackgroundWorker(in_fleet), BackgroundWorker(CONFIG)]
    deadline = time.monotonic() + 30
    while not {w.server.address for w in started[:2]} <= live_addresses(index_address):
        assert time.monotonic() < deadline, "the workers did not register"
        time.sleep(0.05)
    yield tuple(started)
    for worker in started:
        worker.close()


def prompt_of(tag: int, num_repeats: int = 6) -> list[int]:
    return [256, tag, *DOCUMENT * num_repeats]


def prefill(worker: BackgroundWorker, prompt: list[int], request_id: str, hold_ms: int) -> int:
    """The first token, sampled where the prompt was computed; its blocks stay held."""
    tokens, _, final = worker.generate(
        prompt, request_id=request_id, max_tokens=1, hold_blocks_ms=hold_ms
    )
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    return tokens[0]


def decode(
    worker: BackgroundWorker,
    prompt: list[int],
    first: int,
    source: worker_pb2.KVSource,
    request_id: str = "decode",
) -> tuple[list[int], worker_pb2.WorkerGenerateFinal]:
    request = worker_pb2.WorkerGenerateRequest(
        request_id=request_id,
        prompt_token_ids=[*prompt, first],
        num_resumed_tokens=1,
        sampling=common_pb2.SamplingParams(max_tokens=NUM_TOKENS - 1),
        kv_source=source,
    )
    responses = list(worker.stub.Generate(request, timeout=30))
    return [t for r in responses[:-1] for t in r.chunk.token_ids], responses[-1].final


def num_held(worker: BackgroundWorker) -> int:
    """Blocks held by no running request but kept from eviction: a lease's."""
    load = worker.load()
    while load.num_running_requests or load.num_waiting_requests:
        time.sleep(0.01)
        load = worker.load()
    return load.num_total_blocks - load.num_free_blocks


def wait_for_no_lease(worker: BackgroundWorker, timeout_s: float) -> float:
    """Seconds until the worker holds no block."""
    start = time.monotonic()
    while num_held(worker) and time.monotonic() - start < timeout_s:
        time.sleep(0.02)
    return time.monotonic() - start


def test_decoding_what_a_peer_prefilled_gives_the_tokens_of_one_worker(workers) -> None:
    p, d, alone = workers
    prompt = prompt_of(1)  # 302 tokens: 18 full blocks
    expected, _, _ = alone.generate(prompt, max_tokens=NUM_TOKENS)

    first = prefill(p, prompt, "pd-1", hold_ms=60_000)
    assert first == expected[0]
    assert num_held(p) == 18  # the prompt's full blocks, kept for the decode worker
    source = worker_pb2.KVSource(peer_address=p.server.address, transfer_id="pd-1")
    tokens, final = decode(d, prompt, first, source)

    assert [first, *tokens] == expected
    assert final.stats.num_transferred_blocks == 18
    assert final.stats.num_cached_tokens == 18 * BLOCK_SIZE  # the decode side computed the tail
    assert wait_for_no_lease(p, timeout_s=5) < 1  # released when the fetch ended, not at 60 s
    assert set(hash_prompt_blocks(prompt, BLOCK_SIZE, d.server.engine.namespace)) <= cached(d)


def test_only_blocks_the_decode_worker_lacks_move(workers) -> None:
    p, d, alone = workers
    prompt = prompt_of(2)
    expected, _, _ = alone.generate(prompt, max_tokens=NUM_TOKENS)
    d.generate(prompt[: 7 * BLOCK_SIZE + 3], max_tokens=1)  # 7 of the 18 blocks cached there

    first = prefill(p, prompt, "pd-2", hold_ms=60_000)
    source = worker_pb2.KVSource(peer_address=p.server.address, transfer_id="pd-2")
    tokens, final = decode(d, prompt, first, source)
    assert [first, *tokens] == expected
    assert final.stats.num_transferred_blocks == 11
    assert wait_for_no_lease(p, timeout_s=5) < 1

    # A full local hit: nothing moves, and the prefill side is still told to let go.
    first = prefill(p, prompt, "pd-3", hold_ms=60_000)
    assert num_held(p) == 18
    source = worker_pb2.KVSource(peer_address=p.server.address, transfer_id="pd-3")
    tokens, final = decode(d, prompt, first, source, request_id="decode-again")
    assert [first, *tokens] == expected
    assert final.stats.num_transferred_blocks == 0
    assert wait_for_no_lease(p, timeout_s=5) < 1


def test_a_lease_nobody_fetches_runs_out_on_an_idle_worker(workers) -> None:
    p, _, _ = workers
    prefill(p, prompt_of(3), "pd-orphan", hold_ms=300)
    assert num_held(p) == 18
    waited_s = wait_for_no_lease(p, timeout_s=5)
    assert 0.1 < waited_s < 1.5  # the core woke up for it: no request came to wake it


def test_a_failed_transfer_is_recomputed_or_fails_as_asked(workers, index_address) -> None:
    _, d, alone = workers
    prompt = prompt_of(4)
    expected, _, _ = alone.generate(prompt, max_tokens=NUM_TOKENS)
    # A worker of the fleet, as far as the index knows, that no longer answers.
    gone_info = WorkerInfo("gone", "127.0.0.1:1", d.server.engine.namespace, BLOCK_SIZE)
    asyncio.run(on_index(index_address, lambda index: index.register(gone_info, 60.0)))
    gone = worker_pb2.KVSource(peer_address="127.0.0.1:1", transfer_id="x", timeout_ms=2000)
    tokens, final = decode(d, prompt, expected[0], gone)
    assert [expected[0], *tokens] == expected
    assert (final.stats.num_transferred_blocks, final.stats.num_cached_tokens) == (0, 0)

    failing = worker_pb2.KVSource()
    failing.CopyFrom(gone)
    failing.on_failure = "fail"
    with pytest.raises(grpc.RpcError) as error:
        decode(d, prompt_of(5), expected[0], failing, request_id="must-fail")
    assert error.value.code() == grpc.StatusCode.ABORTED
    assert "the KV transfer from 127.0.0.1:1 failed" in error.value.details()
    assert d.wait_until_idle().num_running_requests == 0

    bad = worker_pb2.KVSource(peer_address="127.0.0.1:1", on_failure="retry")
    with pytest.raises(grpc.RpcError) as error:
        decode(d, prompt, expected[0], bad, request_id="bad")
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_request_that_can_never_run_pulls_nothing(workers) -> None:
    p, d, _ = workers
    prompt = prompt_of(7)
    first = prefill(p, prompt, "pd-bad", hold_ms=60_000)
    source = worker_pb2.KVSource(peer_address=p.server.address, transfer_id="pd-bad")
    with pytest.raises(grpc.RpcError) as error:  # a token outside the vocabulary
        decode(d, [*prompt, 99_999], first, source, request_id="out-of-vocabulary")
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert num_held(p) == 18  # not fetched: the lease is still held
    assert not set(hash_prompt_blocks(prompt, BLOCK_SIZE, d.server.engine.namespace)) & cached(d)
    p.stub.ReleaseBlocks(worker_pb2.ReleaseBlocksRequest(transfer_id="pd-bad"))
    assert wait_for_no_lease(p, timeout_s=5) < 1


def test_a_lease_longer_than_the_limit_is_refused(workers) -> None:
    p, _, _ = workers
    with pytest.raises(grpc.RpcError) as error:
        p.generate(prompt_of(6), max_tokens=1, hold_blocks_ms=601_000)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "a lease lasts 0 to 600 s" in error.value.details()


def cached(worker: BackgroundWorker) -> set[bytes]:
    return {h for c in worker.stub.Snapshot(worker_pb2.SnapshotRequest()) for h in c.block_hashes}


def test_a_peer_outside_the_fleet_is_never_asked(workers) -> None:
    """A worker takes blocks only from a live worker of its index: a kv_source naming any other
    address, even a real worker's that holds the prompt, is never asked. The request is computed
    here instead, or ends ABORTED when its source says ``fail``, as after a failed pull."""
    _, d, alone = workers
    prompt = prompt_of(8)
    expected, _, _ = alone.generate(prompt, max_tokens=NUM_TOKENS)  # alone holds its blocks
    hashes = set(hash_prompt_blocks(prompt, BLOCK_SIZE, d.server.engine.namespace))
    for address in (alone.server.address, "127.0.0.1:3"):
        source = worker_pb2.KVSource(peer_address=address, transfer_id="x", on_failure="fail")
        with pytest.raises(grpc.RpcError) as error:
            decode(d, prompt, expected[0], source, request_id=f"outsider-{address}")
        assert error.value.code() == grpc.StatusCode.ABORTED
        assert f"{address} is not a live worker of model" in error.value.details()
        assert not hashes & cached(d)
    source = worker_pb2.KVSource(peer_address=alone.server.address, transfer_id="x")
    tokens, final = decode(d, prompt, expected[0], source, request_id="outsider-recomputed")
    assert tokens == expected[1:]
    assert final.stats.num_transferred_blocks == 0  # computed here: nothing from the outsider


def test_pull_blocks_is_off_unless_allowed(workers) -> None:
    p, d, _ = workers
    request = worker_pb2.PullBlocksRequest(peer_address=p.server.address, block_hashes=[b"\1" * 16])
    with pytest.raises(grpc.RpcError) as error:
        d.stub.PullBlocks(request, timeout=10)
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "--allow-pull-blocks" in error.value.details()
