"""KV blocks between two live workers over real gRPC: one pulls a prefix the other computed, then
serves the prompt from its cache token for token as the first did."""

from __future__ import annotations

import dataclasses
import glob
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.serving import start_server_process
from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvswitch.worker.block_transfer import ShmFiles, ShmRefused
from kvswitch.worker.kv_layout import CACHE_PREFIX, SHM_DIR, SHM_PREFIX, KVLayout
from kvswitch.worker.kv_transfer import PeerCache
from kvswitch.worker.server import WorkerConfig
from tests.worker.background import TRANSFER_AND_CACHE, BackgroundWorker, shm_files
from tests.worker.test_nixl_kv import needs_nixl

BLOCK_SIZE = 16
BLOCK_BYTES = 32 << 10  # one 16-token block of the built-in model in fp32
# NOTE: PullBlocks is what these tests drive: a worker serves it only when allowed to.
CONFIG = WorkerConfig(port=0, kv_cache_bytes=64 * BLOCK_BYTES, grace_s=0.0, allow_pull_blocks=True)
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


CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]


def pull(
    taker: BackgroundWorker,
    holder: BackgroundWorker | str,
    hashes: list[bytes],
    transport: str = "",
):
    address = holder if isinstance(holder, str) else holder.server.address
    request = worker_pb2.PullBlocksRequest(
        request_id="pull", peer_address=address, block_hashes=hashes, transport=transport
    )
    return taker.stub.PullBlocks(request, timeout=30)


@pytest.mark.parametrize(
    "transport", ["grpc", "shm", "mapped", pytest.param("nixl", marks=needs_nixl)]
)
def test_a_pulled_prefix_serves_the_prompt_as_its_holder_did(transport: str) -> None:
    before = shm_files(prefixes=TRANSFER_AND_CACHE)
    config = dataclasses.replace(CONFIG, kv_cache_shm=transport == "mapped")
    holder, taker = BackgroundWorker(config), BackgroundWorker(config)
    try:
        pull_and_serve(holder, taker, transport)
    finally:
        holder.close()
        taker.close()
    # The shared-memory files went with the workers.
    assert shm_files(holder, taker, prefixes=TRANSFER_AND_CACHE) <= before


def pull_and_serve(holder: BackgroundWorker, taker: BackgroundWorker, transport: str) -> None:
    expected, _, _ = holder.generate(PROMPT, max_tokens=8)
    hashes = chain(holder)
    assert len(hashes) == 18

    reply = pull(taker, holder, hashes, transport)
    assert reply.transport == transport
    assert (reply.num_cached_blocks, reply.num_transferred_blocks) == (18, 18)
    assert reply.num_transferred_bytes == 18 * BLOCK_BYTES
    assert set(hashes) <= cached(taker)
    taker.wait_until_idle()
    assert taker.load().num_free_blocks == 64  # taken in as evictable cache, held by nobody

    tokens, _, final = taker.generate(PROMPT, max_tokens=8)
    assert tokens == expected
    assert final.stats.num_cached_tokens == 18 * BLOCK_SIZE
    # Held already: nothing moves the second time.
    again = pull(taker, holder, hashes, transport)
    assert (again.num_cached_blocks, again.num_transferred_blocks) == (18, 0)
    assert again.transport == ""


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


def test_a_worker_writes_blocks_into_no_shared_memory_but_a_transfer_file(pair) -> None:
    holder, _ = pair
    holder.generate(PROMPT, max_tokens=2)
    for path, why in [
        ("/dev/shm/some-other-process", "is not a block-transfer file"),
        ("/tmp/kvswitch-blocks-x", "is not a block-transfer file"),
        (f"{SHM_DIR}/{SHM_PREFIX}not-there", "cannot open"),
    ]:
        request = worker_pb2.FetchBlocksRequest(block_hashes=chain(holder), shm_path=path)
        with pytest.raises(grpc.RpcError) as error:
            list(holder.stub.FetchBlocks(request, timeout=30))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert why in error.value.details()
    bad = worker_pb2.PullBlocksRequest(peer_address="x:1", block_hashes=[b"1"], transport="rdma")
    with pytest.raises(grpc.RpcError) as error:
        holder.stub.PullBlocks(bad, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_transfer_file_that_is_a_link_or_someone_elses_is_refused(pair, tmp_path) -> None:
    """Anyone on the host may create files in /dev/shm: a worker opens a transfer file, or a
    peer's cache file, only when it is a plain file of its own user, never through a link (to a
    file of ours it would write over) nor one another user could read our blocks from."""
    holder, _ = pair
    holder.generate(PROMPT, max_tokens=2)
    size = 64 * BLOCK_BYTES
    target = tmp_path / "ours"
    target.write_bytes(b"\0" * size)
    made = []

    def planted(prefix: str, kind: str) -> str:
        path = f"{SHM_DIR}/{prefix}{kind}-{os.getpid()}"
        made.append(path)
        if kind == "link":
            os.symlink(target, path)
        else:
            with open(path, "wb") as file:
                file.write(b"\0" * size)
            os.chown(path, 65534, 65534)
        return path

    # NOTE: only root can give a file away; as another user, the link case alone.
    kinds = {"link": "cannot open", "theirs": "not a plain file of this worker's user"}
    if os.getuid() != 0:
        del kinds["theirs"]
    layout = KVLayout(2, BLOCK_SIZE, 2, 64, "float32")
    try:
        for kind, why in kinds.items():
            path = planted(SHM_PREFIX, kind)
            request = worker_pb2.FetchBlocksRequest(block_hashes=chain(holder), shm_path=path)
            with pytest.raises(grpc.RpcError) as error:
                list(holder.stub.FetchBlocks(request, timeout=30))
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert why in error.value.details()
            with pytest.raises(ValueError, match=why):
                PeerCache(planted(CACHE_PREFIX, kind), layout, 64)
        assert target.read_bytes() == b"\0" * size  # nothing written through the link
    finally:
        for path in made:
            os.unlink(path)


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


@pytest.mark.parametrize("transport", ["grpc", "shm", "mapped"])
def test_a_holder_killed_mid_pull_leaves_the_taker_whole_blocks_in_chain_order(
    transport: str,
) -> None:
    """Killed whenever the kill lands (before, during or after the pull), the holder leaves the
    taker with a leading run of the chain, each block byte for byte the holder's, serving the
    prompt from its cache; nothing half-written, nothing out of order."""
    num_blocks = 512
    prompt = [256, *np.random.default_rng(7).integers(0, 256, num_blocks * BLOCK_SIZE - 1).tolist()]
    kv_cache_bytes = 600 * BLOCK_BYTES
    mapped = ["--kv-cache-shm"] if transport == "mapped" else []
    holder, address = start_server_process(
        ["worker", "--port", "0", "--kv-cache-bytes", str(kv_cache_bytes), *mapped]
    )
    taker = BackgroundWorker(dataclasses.replace(CONFIG, kv_cache_bytes=kv_cache_bytes))
    try:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            holder_stub = worker_pb2_grpc.WorkerStub(channel)
            request = worker_pb2.WorkerGenerateRequest(
                prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=4)
            )
            responses = list(holder_stub.Generate(request, timeout=120))
            expected = [t for r in responses[:-1] for t in r.chunk.token_ids]
            hashes = chain(taker, prompt)
            fetched = holder_stub.FetchBlocks(
                worker_pb2.FetchBlocksRequest(block_hashes=hashes), timeout=60
            )
            reference = b"".join(c.data for c in fetched)
        assert len(reference) == num_blocks * BLOCK_BYTES

        with ThreadPoolExecutor(1) as pool:
            pulling = pool.submit(pull, taker, address, hashes, transport)
            while not (pulling.done() or set(hashes) & cached(taker)):
                time.sleep(0.001)
            holder.kill()
            try:
                reply = pulling.result()
                assert reply.num_cached_blocks == num_blocks
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE

        held = set(hashes) & cached(taker)
        num_held = len(held)
        assert held == set(hashes[:num_held])  # a leading run of the chain
        fetched = taker.stub.FetchBlocks(worker_pb2.FetchBlocksRequest(block_hashes=hashes))
        assert b"".join(c.data for c in fetched) == reference[: num_held * BLOCK_BYTES]
        tokens, _, final = taker.generate(prompt, max_tokens=4, timeout=120)
        assert tokens == expected
        assert final.stats.num_cached_tokens == min(num_held, num_blocks - 1) * BLOCK_SIZE
    finally:
        holder.kill()
        holder.wait()
        taker.close()


def test_no_room_in_shared_memory_is_refused_before_a_peer_writes() -> None:
    before = shm_files()
    files = ShmFiles()
    try:
        with pytest.raises(ShmRefused, match="no room for"), files.take(1 << 50):
            pass
        assert shm_files() <= before  # the refused file is gone at once
        with files.take(BLOCK_BYTES) as path:
            assert os.path.getsize(path) == BLOCK_BYTES
    finally:
        files.close()
    assert shm_files() <= before


def test_a_mapped_fetch_holds_the_blocks_until_the_asker_releases_them() -> None:
    holder = BackgroundWorker(dataclasses.replace(CONFIG, kv_cache_shm=True))
    try:
        holder.generate(PROMPT, max_tokens=2)
        request = worker_pb2.FetchBlocksRequest(block_hashes=chain(holder), mapped=True)
        (chunk,) = list(holder.stub.FetchBlocks(request, timeout=30))
        assert chunk.cache_file == holder.server.engine.facts.kv_cache_file
        assert chunk.cache_file.startswith(f"{SHM_DIR}/{CACHE_PREFIX}")
        assert (chunk.num_blocks, len(chunk.block_ids), chunk.data) == (18, 18, b"")
        assert chunk.cache_num_blocks == 64 and chunk.lease_id.startswith("fetch-")
        assert holder.wait_for_free_blocks(64 - 18) == 64 - 18  # held for the asker to copy
        holder.stub.ReleaseBlocks(worker_pb2.ReleaseBlocksRequest(transfer_id=chunk.lease_id))
        assert holder.wait_until_idle().num_free_blocks == 64
    finally:
        holder.close()
    assert not glob.glob(chunk.cache_file)  # the cache file went with the worker


def test_mapped_falls_back_when_the_holders_cache_is_private(pair) -> None:
    holder, taker = pair  # neither keeps its cache in shared memory
    holder.generate(PROMPT, max_tokens=2)
    with pytest.raises(grpc.RpcError) as error:
        pull(taker, holder, chain(holder), "mapped")
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not in shared memory (--kv-cache-shm)" in error.value.details()
    reply = pull(taker, holder, chain(holder))
    assert (reply.transport, reply.num_transferred_blocks) == ("shm", 18)


def test_only_a_kv_cache_file_is_mapped() -> None:
    layout = KVLayout(2, 16, 4, 32, "float32")
    with pytest.raises(ValueError, match="is not a KV cache file"):
        PeerCache("/dev/shm/other", layout, 4)
    with pytest.raises(ValueError, match="cannot open"):
        PeerCache(f"{SHM_DIR}/{CACHE_PREFIX}1-gone", layout, 4)
    with pytest.raises(ValueError, match="kv_cache_shm puts a CPU worker's KV cache"):
        dataclasses.replace(CONFIG, kv_cache_shm=True, device="cuda")
