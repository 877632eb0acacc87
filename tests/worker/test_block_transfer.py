"""KV blocks between two live workers over real gRPC: one pulls a prefix the other computed, then
serves the prompt from its cache token for token as the first did."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import grpc
import pytest

from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.v1 import worker_pb2
from kvswitch.worker.server import WorkerConfig
from tests.worker.background import BackgroundWorker

BLOCK_SIZE = 16
BLOCK_BYTES = 32 << 10  # one 16-token block of the built-in model in fp32
CONFIG = WorkerConfig(port=0, kv_cache_bytes=64 * BLOCK_BYTES, grace_s=0.0)
PROMPT = [256, *b"A long shared document, block after block of it. " * 6]  # 301 tokens: 18 blocks


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[BackgroundWorker, BackgroundWorker]]:
    holder, taker = BackgroundWorker(CONFIG), BackgroundWorker(CONFIG)
    yield holder, taker
    holder.close()
    taker.close()


def chain(worker: BackgroundWorker, prompt: list[int] = PROMPT) -> list[bytes]:
    return hash_prompt_blocks(prompt, BLOCK_SIZE, worker.server.engine.namespace)


def cached(worker: BackgroundWorker) -> set[bytes]:
    return {h for c in worker.stub.Snapshot(worker_pb2.SnapshotRequest()) for h in c.block_hashes}


def pull(taker: BackgroundWorker, holder: BackgroundWorker, hashes: list[bytes]):
    request = worker_pb2.PullBlocksRequest(
        request_id="pull", peer_address=holder.server.address, block_hashes=hashes
    )
    return taker.stub.PullBlocks(request, timeout=30)


def test_a_pulled_prefix_serves_the_prompt_as_its_holder_did(pair) -> None:
    holder, taker = pair
    expected, _, _ = holder.generate(PROMPT, max_tokens=8)
    hashes = chain(holder)
    assert len(hashes) == 18

    reply = pull(taker, holder, hashes)
    assert (reply.num_cached_blocks, reply.num_transferred_blocks) == (18, 18)
    assert reply.num_transferred_bytes == 18 * BLOCK_BYTES
    assert set(hashes) <= cached(taker)
    taker.wait_until_idle()
    assert taker.load().num_free_blocks == 64  # taken in as evictable cache, held by nobody

    tokens, _, final = taker.generate(PROMPT, max_tokens=8)
    assert tokens == expected
    assert final.stats.num_cached_tokens == 18 * BLOCK_SIZE
    # Held already: nothing moves the second time.
    again = pull(taker, holder, hashes)
    assert (again.num_cached_blocks, again.num_transferred_blocks) == (18, 0)


def test_fetch_streams_whole_blocks_in_order_and_stops_where_the_cache_does(pair) -> None:
    holder, _ = pair
    prompt = [256, *b"Another document, fetched in small chunks of it. " * 4]
    holder.generate(prompt, max_tokens=2)
    hashes = chain(holder, prompt)
    request = worker_pb2.FetchBlocksRequest(
        request_id="f",
        block_hashes=[*hashes, b"\0" * 16, hashes[0]],
        max_chunk_bytes=BLOCK_BYTES * 5,
    )
    chunks = list(holder.stub.FetchBlocks(request, timeout=30))
    assert [(c.first_block, c.num_blocks) for c in chunks] == [(0, 5), (5, 5), (10, 2)]
    assert all(len(c.data) == c.num_blocks * BLOCK_BYTES for c in chunks)
    layout = chunks[0].layout
    assert (layout.num_layers, layout.block_size, layout.dtype) == (2, 16, "float32")


def test_a_peer_that_is_not_there_is_unavailable_and_nothing_is_cached(pair) -> None:
    _, taker = pair
    with pytest.raises(grpc.RpcError) as error:
        taker.stub.PullBlocks(
            worker_pb2.PullBlocksRequest(peer_address="127.0.0.1:1", block_hashes=[b"\1" * 16]),
            timeout=10,
        )
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "peer 127.0.0.1:1" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        taker.stub.PullBlocks(worker_pb2.PullBlocksRequest(block_hashes=[b"\1" * 16]), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_blocks_of_another_layout_are_refused(pair) -> None:
    holder, _ = pair
    holder.generate(PROMPT, max_tokens=2)
    other = BackgroundWorker(dataclasses.replace(CONFIG, dtype="bfloat16"))
    try:
        with pytest.raises(grpc.RpcError) as error:
            pull(other, holder, chain(holder))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "'dtype': ('float32', 'bfloat16')" in error.value.details()
        assert not set(chain(holder)) & cached(other)
    finally:
        other.close()
