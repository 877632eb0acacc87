"""Which transport a pull takes, by whose shared memory each side sees: shared memory only with a
peer whose host id is this worker's own, gRPC at once with any other, with no file made first.
Ids faked in one process, and real ones: a holder in a mount namespace with its own /dev/shm."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import grpc
import pytest

from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.serving import start_server_process
from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvswitch.worker.kv_layout import SHM_DIR, SHM_PREFIX
from kvswitch.worker.server import WorkerConfig
from tests.worker.background import BackgroundWorker, shm_files

BLOCK_SIZE = 16
BLOCK_BYTES = 32 << 10  # one 16-token block of the built-in model in fp32
CONFIG = WorkerConfig(port=0, kv_cache_bytes=64 * BLOCK_BYTES, grace_s=0.0, allow_pull_blocks=True)
PROMPT = [256, *b"A long shared document, block after block of it. " * 6]  # 18 blocks
OTHER = [256, *b"Another long document, one more block after another. " * 6]
NOT_HELD = [b"\1" * 16]  # a chain no worker holds
# Runs the rest of the command in a mount namespace with a /dev/shm of its own, as a pod has.
OWN_SHM = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
OWN_SHM += [f'mount -t tmpfs tmpfs {SHM_DIR} && exec "$@"', "sh"]


@pytest.fixture
def pair() -> Iterator[tuple[BackgroundWorker, BackgroundWorker]]:
    config = dataclasses.replace(CONFIG, kv_cache_shm=True)  # mapped, the first choice
    holder, taker = BackgroundWorker(config), BackgroundWorker(config)
    yield holder, taker
    holder.close()
    taker.close()


def pull(taker: BackgroundWorker, address: str, hashes: list[bytes], transport: str = ""):
    request = worker_pb2.PullBlocksRequest(
        request_id="pull", peer_address=address, block_hashes=hashes, transport=transport
    )
    return taker.stub.PullBlocks(request, timeout=30)


def test_a_peer_with_another_host_id_gets_grpc_at_once_and_an_equal_one_shared_memory(
    pair,
) -> None:
    holder, taker = pair
    holder.generate(PROMPT, max_tokens=2)
    holder.generate(OTHER, max_tokens=2)
    hashes = hash_prompt_blocks(PROMPT, BLOCK_SIZE, holder.server.engine.namespace)
    other = hash_prompt_blocks(OTHER, BLOCK_SIZE, holder.server.engine.namespace)
    address = holder.server.address
    holder.server.transfers.host_id = "host-a"
    taker.server.transfers.host_id = "host-b"
    before = shm_files(holder, taker)

    reply = pull(taker, address, hashes)
    assert (reply.transport, reply.num_transferred_blocks) == ("grpc", 18)
    for transport in ("shm", "mapped"):  # asked for by name: refused, nothing made
        with pytest.raises(grpc.RpcError) as error:
            pull(taker, address, NOT_HELD, transport)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"{address} does not share this worker's {SHM_DIR}" in error.value.details()
    reply = pull(taker, address, other[:4])  # the holder is known now: not even asked
    assert (reply.transport, reply.num_transferred_blocks) == ("grpc", 4)
    assert taker.server.transfers.shm_files.num_files_made == 0
    assert shm_files(holder, taker) == before

    taker.server.transfers.host_id = "host-a"  # the holder's own id now: mapped again
    reply = pull(taker, address, other)
    assert (reply.transport, reply.num_transferred_blocks) == ("mapped", len(other) - 4)


def test_a_holder_elsewhere_answers_a_shared_memory_fetch_with_its_id_alone(pair) -> None:
    holder, _ = pair
    holder.generate(PROMPT, max_tokens=2, request_id="t", hold_blocks_ms=60_000)
    hashes = hash_prompt_blocks(PROMPT, BLOCK_SIZE, holder.server.engine.namespace)
    holder.server.transfers.host_id = "host-a"
    num_free = holder.wait_for_free_blocks(64 - 18)
    for fast in ({"mapped": True}, {"shm_path": f"{SHM_DIR}/{SHM_PREFIX}1-00"}):
        request = worker_pb2.FetchBlocksRequest(
            block_hashes=hashes, transfer_id="t", host_id="host-b", **fast
        )
        (chunk,) = list(holder.stub.FetchBlocks(request, timeout=30))
        assert chunk == worker_pb2.KVBlockChunk(host_id="host-a")
    assert holder.load().num_free_blocks == num_free == 64 - 18  # the lease is still held
    chunks = list(holder.stub.FetchBlocks(worker_pb2.FetchBlocksRequest(block_hashes=hashes)))
    assert {c.host_id for c in chunks} == {"host-a"}


def test_a_holder_with_its_own_dev_shm_is_pulled_from_over_grpc_without_trying() -> None:
    holder, address = start_server_process(
        ["worker", "--port", "0", "--kv-cache-bytes", str(64 * BLOCK_BYTES), "--kv-cache-shm"],
        prefix=OWN_SHM,
    )
    taker = BackgroundWorker(CONFIG)
    try:
        with grpc.insecure_channel(address) as channel:
            request = worker_pb2.WorkerGenerateRequest(
                prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=2)
            )
            list(worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=60))
        hashes = hash_prompt_blocks(PROMPT, BLOCK_SIZE, taker.server.engine.namespace)
        reply = pull(taker, address, hashes)
        assert (reply.transport, reply.num_transferred_blocks) == ("grpc", 18)
        with pytest.raises(grpc.RpcError) as error:
            pull(taker, address, NOT_HELD, "shm")
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "does not share this worker's" in error.value.details()
        assert taker.server.transfers.shm_files.num_files_made == 0
    finally:
        holder.kill()
        holder.wait()
        taker.close()


def test_a_pull_over_the_takers_shared_memory_cap_goes_over_grpc() -> None:
    holder, taker = BackgroundWorker(CONFIG), BackgroundWorker(CONFIG)  # caches private: shm
    try:
        holder.generate(PROMPT, max_tokens=2)
        holder.generate(OTHER, max_tokens=2)
        namespace = holder.server.engine.namespace
        taker.server.transfers.shm_files.max_bytes = 4 * BLOCK_BYTES
        before = shm_files(holder, taker)
        with pytest.raises(grpc.RpcError) as error:
            pull(
                taker,
                holder.server.address,
                hash_prompt_blocks(OTHER, BLOCK_SIZE, namespace),
                "shm",
            )
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "this worker keeps at most 131,072 bytes there" in error.value.details()
        reply = pull(
            taker, holder.server.address, hash_prompt_blocks(PROMPT, BLOCK_SIZE, namespace)
        )
        assert (reply.transport, reply.num_transferred_blocks) == ("grpc", 18)
        assert shm_files(holder, taker) == before
    finally:
        holder.close()
        taker.close()
