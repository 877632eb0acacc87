"""A decode worker holds the blocks of a request's prompt before its pull writes them: live
workers over real gRPC (prefill, decode, and one alone for reference), the decode worker's pool
small and its KV cache's invariants checked whenever it falls idle.

Faults are put into the prefill worker's reads of its own blocks (what it streams to the decode
worker), in the test's process, where that worker's serving side runs (a CPU worker's "auto"
does not read over NIXL, where the prefill worker makes no reads: tests/worker/test_nixl_pulls.py
has those)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest

from kvswitch.cache_index.grpc_index import GrpcIndex
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.serving import start_server_process
from kvswitch.v1 import common_pb2, worker_pb2
from kvswitch.worker.block_transfer import DEFAULT_CHUNK_BYTES
from kvswitch.worker.server import WorkerConfig
from tests.worker.background import BackgroundWorker

BLOCK_SIZE = 16
BLOCK_BYTES = 32 << 10  # one 16-token block of the built-in model in fp32
DOCUMENT = b"A long shared document, block after block of it. "
NUM_TOKENS = 8
# A decode prompt of 43 full blocks and 6 tokens: 44 blocks held for it, 43 of them pulled.
PROMPT_LEN = 43 * BLOCK_SIZE + 5
NUM_PULLED = 43
NUM_DECODE_BLOCKS = 128  # room for two such pulls, not three
CONFIG = WorkerConfig(port=0, kv_cache_bytes=256 * BLOCK_BYTES, grace_s=0.0)


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[BackgroundWorker, BackgroundWorker, BackgroundWorker]]:
    """(prefill, decode, alone): the first two in a router's fleet; the third serves each
    prompt by itself, for reference. The decode worker runs one request at a time."""
    router, index_address = start_server_process(["router", "--port", "0"])
    in_fleet = dataclasses.replace(CONFIG, index=f"grpc://{index_address}")
    decode_config = dataclasses.replace(
        in_fleet,
        kv_cache_bytes=NUM_DECODE_BLOCKS * BLOCK_BYTES,
        max_num_seqs=1,
        check_integrity=True,
    )
    started = [
        BackgroundWorker(in_fleet),
        BackgroundWorker(decode_config),
        BackgroundWorker(CONFIG),
    ]
    try:
        addresses = {w.server.address for w in started[:2]}
        assert wait_for(lambda: addresses <= live_addresses(index_address), 30)
        yield tuple(started)
    finally:
        for worker in started:
            worker.close()
        router.terminate()
        router.wait(timeout=30)


def live_addresses(index_address: str) -> set[str]:
    async def live() -> set[str]:
        index = GrpcIndex(index_address)
        try:
            return {w.address for w in await index.live_workers()}
        finally:
            await index.close()

    return asyncio.run(live())


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def prompt_of(tag: int) -> list[int]:
    return [256, tag, *DOCUMENT * 14][: PROMPT_LEN - 1]


def prefill(worker: BackgroundWorker, prompt: list[int], request_id: str) -> int:
    """The first token, sampled where the prompt was computed; its blocks stay held."""
    tokens, _, _ = worker.generate(
        prompt, request_id=request_id, max_tokens=1, hold_blocks_ms=60_000
    )
    return tokens[0]


def decode_request(
    prefill_worker: BackgroundWorker | str,
    prompt: list[int],
    first: int,
    transfer_id: str,
    **source,
) -> worker_pb2.WorkerGenerateRequest:
    """The decode half of a request whose prompt the prefill worker (or the worker at that
    address) computed, sampling ``first``."""
    address = prefill_worker if isinstance(prefill_worker, str) else prefill_worker.server.address
    return worker_pb2.WorkerGenerateRequest(
        request_id=f"decode-{transfer_id}",
        prompt_token_ids=[*prompt, first],
        num_resumed_tokens=1,
        sampling=common_pb2.SamplingParams(max_tokens=NUM_TOKENS - 1),
        kv_source=worker_pb2.KVSource(peer_address=address, transfer_id=transfer_id, **source),
    )


def decode(
    worker: BackgroundWorker, request: worker_pb2.WorkerGenerateRequest
) -> tuple[list[int], worker_pb2.WorkerGenerateFinal]:
    responses = list(worker.stub.Generate(request, timeout=60))
    return [t for r in responses[:-1] for t in r.chunk.token_ids], responses[-1].final


def pull_failures(worker: BackgroundWorker, reason: str) -> float | None:
    registry = worker.server.metrics.registry
    return registry.get_sample_value("kvswitch_worker_kv_pull_failures_total", {"reason": reason})


def num_integrity_checks(worker: BackgroundWorker) -> int:
    return worker.server.engine.counters.num_integrity_checks


def settled(worker: BackgroundWorker, checks_before: int) -> None:
    """The worker is idle with every block free (none leaked), and its KV cache's invariants
    were checked since ``checks_before`` (a broken one would have ended its engine core)."""
    load = worker.wait_until_idle(timeout_s=30)
    assert load.num_free_blocks == load.num_total_blocks
    assert wait_for(lambda: num_integrity_checks(worker) > checks_before)


def no_lease(worker: BackgroundWorker) -> bool:
    load = worker.load()
    return load.num_free_blocks == load.num_total_blocks


@contextlib.contextmanager
def reads_replaced(worker: BackgroundWorker, read: Callable) -> Iterator[None]:
    """Replace the worker's reads of its cached blocks (what FetchBlocks streams) with
    ``read(original, *args, **kwargs)``."""
    engine = worker.server.engine
    original = engine.read_blocks
    engine.read_blocks = lambda *args, **kwargs: read(original, *args, **kwargs)
    try:
        yield
    finally:
        del engine.read_blocks


def test_a_burst_of_pulls_keeps_each_requests_blocks_until_it_runs(workers) -> None:
    """Three pulls of a third of the decode pool each, while a request runs there (the others
    wait for it): the first two hold their blocks until they run and hit every pulled block;
    the third finds no room for its prompt, so its pull is refused and it computes instead."""
    p, d, alone = workers
    prompts = [prompt_of(10 + i) for i in range(3)]
    expected = [alone.generate(prompt, max_tokens=NUM_TOKENS)[0] for prompt in prompts]
    firsts = [prefill(p, prompt, f"burst-{i}") for i, prompt in enumerate(prompts)]
    checks, refused = num_integrity_checks(d), pull_failures(d, "refused")

    # At most 38 blocks: it leaves room for the first two pulls whenever they come.
    blocker = d.stub.Generate(
        worker_pb2.WorkerGenerateRequest(
            request_id="blocker",
            prompt_token_ids=[256, 1, 2, 3],
            sampling=common_pb2.SamplingParams(max_tokens=600),
        ),
        timeout=60,
    )
    next(blocker)  # it runs
    with ThreadPoolExecutor(3) as pool:
        results = []
        for i, (prompt, first) in enumerate(zip(prompts, firsts, strict=True)):
            request = decode_request(p, prompt, first, f"burst-{i}")
            results.append(pool.submit(decode, d, request))
            # One at a time, so that they come in this order.
            assert wait_for(lambda n=i + 1: d.load().num_waiting_requests == n)
        blocker.cancel()
        served = [future.result() for future in results]

    for (tokens, _), first, want in zip(served, firsts, expected, strict=True):
        assert [first, *tokens] == want
    stats = [final.stats for _, final in served]
    assert [s.num_cached_tokens for s in stats] == [NUM_PULLED * BLOCK_SIZE] * 2 + [0]
    assert [s.num_transferred_blocks for s in stats] == [NUM_PULLED, NUM_PULLED, 0]
    assert pull_failures(d, "refused") == refused + 1
    assert wait_for(lambda: no_lease(p))  # the refused pull's lease was let go too
    settled(d, checks)


def test_a_transfer_that_fails_midway_caches_what_landed_and_computes_the_rest(workers) -> None:
    p, d, alone = workers
    prompt = prompt_of(20)
    expected, _, _ = alone.generate(prompt, max_tokens=NUM_TOKENS)
    first = prefill(p, prompt, "midway")
    checks, failed = num_integrity_checks(d), pull_failures(d, "failed")
    num_first_chunk = DEFAULT_CHUNK_BYTES // BLOCK_BYTES  # the blocks of one FetchBlocks chunk
    num_reads = [0]

    def fail_after_one_chunk(original, *args, **kwargs) -> Future:
        num_reads[0] += 1
        if num_reads[0] == 1:
            return original(*args, **kwargs)
        failure: Future = Future()
        failure.set_exception(RuntimeError("the prefill worker failed mid-transfer"))
        return failure

    with reads_replaced(p, fail_after_one_chunk):
        tokens, final = decode(d, decode_request(p, prompt, first, "midway", transport="grpc"))

    assert [first, *tokens] == expected  # nothing it computed from was garbage
    assert final.stats.num_transferred_blocks == 0  # the pull failed
    assert final.stats.num_cached_tokens == num_first_chunk * BLOCK_SIZE  # what landed, a hit
    assert pull_failures(d, "failed") == failed + 1
    hashes = hash_prompt_blocks(prompt, BLOCK_SIZE, d.server.engine.namespace)
    assert set(hashes) <= cached(d)  # the landed chunk, then what the request computed
    assert wait_for(lambda: no_lease(p))
    settled(d, checks)


def test_a_request_aborted_while_its_kv_is_on_the_way_frees_its_blocks(workers) -> None:
    p, d, _ = workers
    prompt = prompt_of(30)
    first = prefill(p, prompt, "abandoned")
    checks = num_integrity_checks(d)
    reading, gate = threading.Event(), threading.Event()

    def held(original, *args, **kwargs) -> Future:
        reading.set()
        result: Future = Future()

        def later() -> None:
            gate.wait()
            try:
                value = original(*args, **kwargs).result()
            except Exception as e:
                value, error = None, e
            else:
                error = None
            if result.set_running_or_notify_cancel():  # else its reader went away
                if error is None:
                    result.set_result(value)
                else:
                    result.set_exception(error)

        threading.Thread(target=later, daemon=True).start()
        return result

    with reads_replaced(p, held):
        call = d.stub.Generate(decode_request(p, prompt, first, "abandoned"), timeout=60)
        # Waiting for its KV, it counts as waiting and holds its whole prompt's blocks.
        waiting = (1, NUM_DECODE_BLOCKS - (NUM_PULLED + 1))
        load = d.load
        assert wait_for(lambda: (load().num_waiting_requests, load().num_free_blocks) == waiting)
        assert reading.wait(10)  # the prefill worker is reading the blocks for it
        call.cancel()
        assert wait_for(lambda: (load().num_waiting_requests, load().num_free_blocks) == (0, 128))
        # The fetch went with the request: the prefill worker let its lease go, its read still
        # held.
        assert wait_for(lambda: no_lease(p))
        gate.set()
    with pytest.raises(grpc.RpcError) as error:
        next(call)
    assert error.value.code() == grpc.StatusCode.CANCELLED
    hashes = hash_prompt_blocks(prompt, BLOCK_SIZE, d.server.engine.namespace)
    assert not set(hashes) & cached(d)
    settled(d, checks)


def cached(worker: BackgroundWorker) -> set[bytes]:
    return {h for c in worker.stub.Snapshot(worker_pb2.SnapshotRequest()) for h in c.block_hashes}
