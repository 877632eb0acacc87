"""Disaggregated prefill over NIXL between live workers: the decode worker's engine core reads
the prompt's blocks one-sided out of the prefill worker's KV cache, into the blocks it holds for
the request; the prefill worker only leases them and answers their ids.

The decode worker runs in the test's process (its serving side; its engine core is a process of
its own) with its KV cache's invariants checked whenever it falls idle; prefill workers are
processes of their own where a test stops or kills one."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import grpc
import pytest

from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.serving import start_server_process
from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvswitch.worker.server import WorkerConfig
from tests.worker.background import BackgroundWorker
from tests.worker.test_disaggregated_pulls import (
    BLOCK_SIZE,
    NUM_TOKENS,
    cached,
    decode,
    decode_request,
    live_addresses,
    num_integrity_checks,
    prefill,
    prompt_of,
    pull_failures,
    settled,
    wait_for,
)
from tests.worker.test_nixl_kv import needs_nixl

pytestmark = needs_nixl

BLOCK_BYTES = 32 << 10  # one 16-token block of the built-in model in fp32
CONFIG = WorkerConfig(port=0, kv_cache_bytes=256 * BLOCK_BYTES, grace_s=0.0)
NUM_PULLED = 43  # full blocks of prompt_of's prompts


@pytest.fixture(scope="module")
def index_url() -> Iterator[str]:
    """A router's index: a decode worker takes KV blocks only from workers of its fleet."""
    router, index_address = start_server_process(["router", "--port", "0"])
    yield f"grpc://{index_address}"
    router.terminate()
    router.wait(timeout=30)


@pytest.fixture(scope="module")
def decode_worker(index_url: str) -> Iterator[BackgroundWorker]:
    config = dataclasses.replace(
        CONFIG, index=index_url, kv_cache_bytes=128 * BLOCK_BYTES, check_integrity=True
    )
    worker = BackgroundWorker(config)
    yield worker
    worker.close()


def in_fleet(index_url: str, address: str) -> str:
    """``address`` once the fleet's index lists it live."""
    assert wait_for(lambda: address in live_addresses(index_url.removeprefix("grpc://")), 30)
    return address


@pytest.fixture(scope="module")
def alone() -> Iterator[BackgroundWorker]:
    """Serves each prompt by itself, for reference."""
    worker = BackgroundWorker(CONFIG)
    yield worker
    worker.close()


def expected_tokens(alone: BackgroundWorker, prompt: list[int]) -> list[int]:
    tokens, _, _ = alone.generate(prompt, max_tokens=NUM_TOKENS)
    return tokens


def nixl_reads(worker: BackgroundWorker) -> list[int]:
    """Counts the blocks of each NIXL read the worker's engine core is asked for, from now."""
    reads: list[int] = []
    engine = worker.server.engine
    original = engine.write_blocks_nixl

    def counted(block_hashes, *args, **kwargs) -> Future:
        reads.append(len(block_hashes))
        return original(block_hashes, *args, **kwargs)

    engine.write_blocks_nixl = counted
    return reads


def test_a_prompt_pulled_over_nixl_serves_as_if_computed_here(
    index_url: str, decode_worker: BackgroundWorker, alone: BackgroundWorker
) -> None:
    """Named, nixl is one read of the 43 blocks into those held for the request, the prefill
    worker's lease let go, the tokens those of a worker that computed the prompt itself. A CPU
    worker's auto does not take it (a NIXL agent's progress thread spins a core)."""
    holder = BackgroundWorker(dataclasses.replace(CONFIG, index=index_url))
    try:
        in_fleet(index_url, holder.server.address)
        checks = num_integrity_checks(decode_worker)
        reads = nixl_reads(decode_worker)
        prompt = prompt_of(51)
        first = prefill(holder, prompt, "over-nixl")
        address = holder.server.address
        request = decode_request(address, prompt, first, "over-nixl", transport="nixl")
        tokens, final = decode(decode_worker, request)
        assert [first, *tokens] == expected_tokens(alone, prompt)
        assert reads == [NUM_PULLED]
        assert final.stats.num_transferred_blocks == NUM_PULLED
        assert final.stats.num_cached_tokens == NUM_PULLED * BLOCK_SIZE
        hashes = hash_prompt_blocks(prompt, BLOCK_SIZE, decode_worker.server.engine.namespace)
        assert set(hashes[:NUM_PULLED]) <= cached(decode_worker)
        assert wait_for(lambda: holder.load().num_free_blocks == 256)  # the lease let go

        other = prompt_of(57)
        first = prefill(holder, other, "auto")
        tokens, final = decode(decode_worker, decode_request(address, other, first, "auto"))
        assert [first, *tokens] == expected_tokens(alone, other)
        assert final.stats.num_transferred_blocks == NUM_PULLED
        assert reads == [NUM_PULLED]  # moved, but not over NIXL
        settled(decode_worker, checks)
    finally:
        holder.close()


def test_a_holder_without_nixl_is_pulled_from_another_way_and_remembered(
    index_url: str, decode_worker: BackgroundWorker, alone: BackgroundWorker
) -> None:
    """A prefill worker that answers it has no NIXL (FAILED_PRECONDITION): a GPU worker's auto
    (which tries NIXL first) falls back to the shared-memory and gRPC transports at once, and
    asks that peer no more; a pull that names nixl fails, and the request computes its prompt
    here."""
    holder = BackgroundWorker(dataclasses.replace(CONFIG, index=index_url))
    decode_worker.server.transfers.nixl = True  # auto as on a GPU worker
    try:
        in_fleet(index_url, holder.server.address)

        def no_nixl() -> Future:
            refused: Future = Future()
            refused.set_exception(ValueError("NIXL is not installed: pip install 'kvswitch[nixl]'"))
            return refused

        holder.server.engine.nixl_info = no_nixl
        reads = nixl_reads(decode_worker)
        address = holder.server.address
        for tag, source in ((52, {}), (53, {}), (54, {"transport": "nixl"})):
            prompt = prompt_of(tag)
            first = prefill(holder, prompt, f"elsewhere-{tag}")
            failed = pull_failures(decode_worker, "failed")
            tokens, final = decode(
                decode_worker, decode_request(address, prompt, first, f"elsewhere-{tag}", **source)
            )
            assert [first, *tokens] == expected_tokens(alone, prompt)
            if source:
                assert final.stats.num_transferred_blocks == 0
                assert pull_failures(decode_worker, "failed") == failed + 1
            else:
                assert final.stats.num_transferred_blocks == NUM_PULLED
        assert reads == []
        assert address in decode_worker.server.transfers._peers_without_nixl
    finally:
        decode_worker.server.transfers.nixl = False
        holder.close()


def test_a_decode_request_cancelled_before_its_holder_answers_lets_the_lease_go(
    index_url: str, decode_worker: BackgroundWorker
) -> None:
    """The client leaves while the prefill worker is still holding the blocks for the NIXL
    fetch (before it answered their ids): the prefill worker lets the lease go at once (the
    asker is gone; it would otherwise hold them a minute), and the decode worker frees what it
    held for the request."""
    holder = BackgroundWorker(dataclasses.replace(CONFIG, index=index_url))
    try:
        in_fleet(index_url, holder.server.address)
        checks = num_integrity_checks(decode_worker)
        prompt = prompt_of(58)
        first = prefill(holder, prompt, "cancelled")  # held for 60 s
        holding, gate = answers_held(holder)
        request = decode_request(
            holder.server.address, prompt, first, "cancelled", transport="nixl"
        )
        call = decode_worker.stub.Generate(request, timeout=60)
        assert holding.wait(30)
        call.cancel()
        gate.set()
        with pytest.raises(grpc.RpcError) as error:
            next(call)
        assert error.value.code() == grpc.StatusCode.CANCELLED
        # Held again for the fetch, the blocks would stay 10 s; for the prefill, 60.
        assert wait_for(lambda: holder.load().num_free_blocks == 256, 8)
        settled(decode_worker, checks)
    finally:
        holder.close()


def test_a_holder_stopped_or_killed_before_the_read_costs_a_recompute(
    index_url: str, decode_worker: BackgroundWorker, alone: BackgroundWorker
) -> None:
    """The prefill worker answers the fetch, then its engine core (the process whose memory the
    KV cache is, and whose UCX thread serves the read) is stopped (SIGSTOP), or killed
    (SIGKILL), before the decode worker reads: the read fails or runs out the kv_source's 2 s,
    nothing half-read is cached, each request computes its prompt and serves the tokens of a
    worker that computed it alone, and the decode worker's cache is clean after."""
    holder, address = start_server_process(
        ["worker", "--port", "0", "--kv-cache-bytes", str(256 * BLOCK_BYTES), "--index", index_url]
    )
    try:
        in_fleet(index_url, address)
        prompts = [prompt_of(55), prompt_of(56)]
        firsts = []
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for i, prompt in enumerate(prompts):
                request = worker_pb2.WorkerGenerateRequest(
                    request_id=f"held-{i}",
                    prompt_token_ids=prompt,
                    sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0),
                    hold_blocks_ms=60_000,
                )
                responses = list(stub.Generate(request, timeout=60))
                firsts.append(responses[0].chunk.token_ids[0])
        checks = num_integrity_checks(decode_worker)
        core = engine_core_pid(holder.pid)
        namespace = decode_worker.server.engine.namespace
        for i, signum in enumerate((signal.SIGSTOP, signal.SIGKILL)):
            failed = pull_failures(decode_worker, "failed")
            signal_before_read(decode_worker, core, signum)
            request = decode_request(
                address, prompts[i], firsts[i], f"held-{i}", transport="nixl", timeout_ms=2000
            )
            tokens, final = decode(decode_worker, request)
            assert [firsts[i], *tokens] == expected_tokens(alone, prompts[i])
            assert final.stats.num_transferred_blocks == 0
            assert final.stats.num_cached_tokens == 0
            assert pull_failures(decode_worker, "failed") == failed + 1
            hashes = hash_prompt_blocks(prompts[i], BLOCK_SIZE, namespace)
            assert set(hashes[:NUM_PULLED]) <= cached(decode_worker)  # computed here, cached
            if signum == signal.SIGSTOP:
                os.kill(core, signal.SIGCONT)  # to answer the next fetch
        settled(decode_worker, checks)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)


def test_a_decode_worker_killed_while_it_waits_for_its_holder_lets_the_lease_go(
    index_url: str,
) -> None:
    """The decode worker's processes are SIGKILLed while it waits for the prefill worker's
    answer to its NIXL fetch: once the prefill worker answers, it finds the asker gone and lets
    the blocks go at once (not after the prefill's minute), and serves on."""
    holder = BackgroundWorker(dataclasses.replace(CONFIG, index=index_url))
    args = ["worker", "--port", "0", "--kv-cache-bytes", str(128 * BLOCK_BYTES)]
    decoder, decoder_address = start_server_process([*args, "--index", index_url])
    try:
        in_fleet(index_url, holder.server.address)
        in_fleet(index_url, decoder_address)
        prompt = prompt_of(61)
        first = prefill(holder, prompt, "orphaned")  # held for 60 s
        holding, gate = answers_held(holder)
        request = decode_request(holder.server.address, prompt, first, "orphaned", transport="nixl")
        channel = grpc.insecure_channel(decoder_address)
        call = worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=60)
        assert holding.wait(30)
        core = engine_core_pid(decoder.pid)
        os.kill(decoder.pid, signal.SIGKILL)
        os.kill(core, signal.SIGKILL)
        decoder.wait(timeout=30)
        gate.set()
        with pytest.raises(grpc.RpcError):
            next(call)
        channel.close()
        assert wait_for(lambda: holder.load().num_free_blocks == 256, 8)
        tokens, _, _ = holder.generate(prompt_of(62), max_tokens=2)
        assert len(tokens) == 2
    finally:
        if decoder.poll() is None:
            decoder.kill()
            decoder.wait(timeout=30)
        holder.close()


def answers_held(holder: BackgroundWorker) -> tuple[threading.Event, threading.Event]:
    """(holding, gate): ``holding`` is set once a fetch asks the holder's engine core to hold
    blocks; the core holds them at once, but its answer is passed on only once ``gate`` is set."""
    engine = holder.server.engine
    original = engine.hold_blocks
    holding, gate = threading.Event(), threading.Event()

    def held_late(*args, **kwargs) -> Future:
        inner = original(*args, **kwargs)
        holding.set()
        result: Future = Future()

        def later() -> None:
            gate.wait()
            error = inner.exception()
            if result.set_running_or_notify_cancel():  # else its reader went away
                if error is None:
                    result.set_result(inner.result())
                else:
                    result.set_exception(error)

        threading.Thread(target=later, daemon=True).start()
        return result

    engine.hold_blocks = held_late
    return holding, gate


def test_the_decode_worker_steps_on_while_a_nixl_read_runs(
    index_url: str, decode_worker: BackgroundWorker, alone: BackgroundWorker
) -> None:
    """The decode worker's engine core posts the read and goes on: while a read from a stopped
    prefill worker waits out its 5 s, the core answers other calls (a snapshot of its cache)
    and a request running there streams on (a read waited for inside the step loop would stall
    both until it ended); the pulled request then computes its prompt."""
    holder, address = start_server_process(
        ["worker", "--port", "0", "--kv-cache-bytes", str(256 * BLOCK_BYTES), "--index", index_url]
    )
    streamed: list[int] = []
    running = decode_worker.stub.Generate(
        worker_pb2.WorkerGenerateRequest(
            request_id="streaming",
            prompt_token_ids=[256, 7, 8, 9],
            sampling=common_pb2.SamplingParams(max_tokens=8000, temperature=0.0),
        ),
        timeout=300,
    )
    reader = threading.Thread(target=stream_into, args=(running, streamed), daemon=True)
    try:
        in_fleet(index_url, address)
        prompt = prompt_of(59)
        first = held_first_token(address, prompt, "beside")
        reader.start()
        assert wait_for(lambda: len(streamed) > 0, 30)
        checks = num_integrity_checks(decode_worker)
        core = engine_core_pid(holder.pid)
        signal_before_read(decode_worker, core, signal.SIGSTOP)
        window = streamed_during_reads(decode_worker, streamed)
        request = decode_request(
            address, prompt, first, "beside", transport="nixl", timeout_ms=5000
        )
        decoded: Future = Future()
        threading.Thread(target=lambda: decoded.set_result(decode(decode_worker, request))).start()
        assert wait_for(lambda: len(window) == 1, 30)  # the read is asked for
        cached(decode_worker)  # a snapshot: the core answers it
        num_streamed = len(streamed)
        assert wait_for(lambda: len(streamed) > num_streamed + 1 or bool(window[0]), 30)
        assert not window[0], "the core answered nothing else, or streamed nothing, while it read"
        tokens, final = decoded.result(timeout=60)
        assert [first, *tokens] == expected_tokens(alone, prompt)
        assert final.stats.num_transferred_blocks == 0
        assert reader.is_alive(), "the running request ended before the read did"
        os.kill(core, signal.SIGCONT)
        running.cancel()
        reader.join(30)
        settled(decode_worker, checks)
    finally:
        running.cancel()
        holder.kill()
        holder.wait(timeout=30)


def test_blocks_a_nixl_read_writes_stay_held_when_their_request_leaves(
    index_url: str, decode_worker: BackgroundWorker
) -> None:
    """The client leaves while the read into its request's blocks runs (from a stopped prefill
    worker): the request is gone at once, but the blocks the read writes stay out of the free
    queue until it ends (its time runs out), so that no other request takes them under it;
    then every block is free and the cache clean."""
    holder, address = start_server_process(
        ["worker", "--port", "0", "--kv-cache-bytes", str(256 * BLOCK_BYTES), "--index", index_url]
    )
    try:
        in_fleet(index_url, address)
        prompt = prompt_of(60)
        first = held_first_token(address, prompt, "left")
        checks = num_integrity_checks(decode_worker)
        core = engine_core_pid(holder.pid)
        signal_before_read(decode_worker, core, signal.SIGSTOP)
        window = streamed_during_reads(decode_worker, [])
        total = decode_worker.load().num_total_blocks
        request = decode_request(address, prompt, first, "left", transport="nixl", timeout_ms=8000)
        call = decode_worker.stub.Generate(request, timeout=60)
        assert wait_for(lambda: len(window) == 1, 30)  # the read is asked for
        call.cancel()
        assert wait_for(
            lambda: decode_worker.load().num_waiting_requests == 0, 30
        )  # the request left
        assert decode_worker.load().num_free_blocks == total - NUM_PULLED
        assert wait_for(lambda: decode_worker.load().num_free_blocks == total, 30)  # 8 s ran out
        os.kill(core, signal.SIGCONT)
        settled(decode_worker, checks)
    finally:
        holder.kill()
        holder.wait(timeout=30)


def stream_into(call: Iterator[worker_pb2.WorkerGenerateResponse], tokens: list[int]) -> None:
    """Append the streamed tokens to ``tokens`` until the call ends or is cancelled."""
    try:
        for response in call:
            if response.HasField("chunk"):
                tokens.extend(response.chunk.token_ids)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            raise


def held_first_token(address: str, prompt: list[int], request_id: str) -> int:
    """Prefill ``prompt`` on the worker at ``address``, its blocks held a minute; the first
    token."""
    with grpc.insecure_channel(address) as channel:
        request = worker_pb2.WorkerGenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0),
            hold_blocks_ms=60_000,
        )
        responses = list(worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=60))
    return responses[0].chunk.token_ids[0]


def streamed_during_reads(worker: BackgroundWorker, streamed: list[int]) -> list[list[int]]:
    """For each NIXL read ``worker``'s engine core is asked for from now: ``len(streamed)``
    when it was asked, and again when it answered (an empty list until then)."""
    windows: list[list[int]] = []
    engine = worker.server.engine
    original: Callable[..., Future] = engine.write_blocks_nixl

    def watched(*args, **kwargs) -> Future:
        window: list[int] = []
        before = len(streamed)
        future = original(*args, **kwargs)
        future.add_done_callback(lambda _: window.extend((before, len(streamed))))
        windows.append(window)
        return future

    engine.write_blocks_nixl = watched
    return windows


def engine_core_pid(worker_pid: int) -> int:
    """The pid of a worker's engine core: the child its serving process spawned (the other
    is multiprocessing's resource tracker)."""
    tasks = Path(f"/proc/{worker_pid}/task").iterdir()
    children = [c for task in tasks for c in (task / "children").read_text().split()]
    cores = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(cores) == 1, children
    return int(cores[0])


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie's memory is gone too)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def signal_before_read(worker: BackgroundWorker, pid: int, signum: int) -> None:
    """Send process ``pid`` ``signum`` just before ``worker``'s next NIXL read, once (a kill
    waited for: the memory read is gone before the read starts)."""
    engine = worker.server.engine
    original: Callable[..., Future] = engine.write_blocks_nixl

    def read_once_signalled(*args, **kwargs) -> Future:
        engine.write_blocks_nixl = original
        os.kill(pid, signum)
        if signum == signal.SIGKILL:
            assert wait_for(lambda: gone(pid), 30)
        return original(*args, **kwargs)

    engine.write_blocks_nixl = read_once_signalled
