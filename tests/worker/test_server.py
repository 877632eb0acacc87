"""The worker's gRPC server, over real gRPC on 127.0.0.1, with the built-in model on CPU.

The server runs in-process on its own event-loop thread; the tests are plain gRPC clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvswitch.app.cli import main
from kvswitch.cache_index.events import replay
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.tokenizer import ByteTokenizer
from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvswitch.worker.core_protocol import CoreCounters
from kvswitch.worker.engine import EngineConfig, LLMEngine
from kvswitch.worker.engine_client import EngineClient
from kvswitch.worker.request import SamplingParams
from kvswitch.worker.server import WorkerConfig, WorkerStartError, start_worker
from tests.worker.background import BackgroundWorker, engine_core_pids
from tests.worker.test_model import save_checkpoint

BLOCK_SIZE = 16
BLOCK_BYTES = 32 << 10  # one 16-token block of the built-in model in fp32
NUM_BLOCKS = 64  # a context of 1024 tokens
CONFIG = WorkerConfig(port=0, kv_cache_bytes=NUM_BLOCKS * BLOCK_BYTES, grace_s=0.0)

# 36 tokens: two full blocks and four tokens of a third; with 4 output tokens no new block fills.
PROMPT = [256, *b"Q: what is the capital of France?  "]
assert len(PROMPT) == 36


@pytest.fixture(scope="module")
def worker() -> Iterator[BackgroundWorker]:
    background = BackgroundWorker(CONFIG)
    yield background
    background.close()


@pytest.fixture
def fresh_worker() -> Iterator[BackgroundWorker]:
    background = BackgroundWorker(CONFIG)
    yield background
    background.close()


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    return LLMEngine(CONFIG.engine_config())


def test_config_defaults_match_the_engine() -> None:
    # The fields' own defaults: EngineConfig resolves some (cuda_graphs None: by the device).
    engine_defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    engine_defaults["model"] = ""
    # Made from fleet_token and block_hash, which the worker has instead.
    del engine_defaults["block_naming"]
    assert WorkerConfig().engine_config().block_naming == EngineConfig().block_naming
    # Made from kv_events_config: on when the worker publishes vLLM-format events.
    del engine_defaults["record_block_tokens"]
    assert not WorkerConfig().engine_config().record_block_tokens
    worker_defaults = dataclasses.asdict(WorkerConfig())
    missing = set(engine_defaults) - set(worker_defaults)
    assert not missing, f"add {missing} to WorkerConfig (and their help to the CLI)"
    assert {k: worker_defaults[k] for k in engine_defaults} == engine_defaults


def test_generate_streams_the_engines_tokens(
    worker: BackgroundWorker, reference: LLMEngine
) -> None:
    [expected] = reference.generate([PROMPT], SamplingParams(max_tokens=8))
    tokens, text, final = worker.generate(PROMPT, max_tokens=8, request_id="first")
    assert tokens == expected
    assert text == ByteTokenizer().decode(expected)
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final.stats.worker_id == worker.server.worker_id
    assert final.stats.num_prompt_tokens == len(PROMPT)
    assert final.stats.num_output_tokens == 8
    assert final.stats.ttft_s > 0

    # The same prompt again finds its two full blocks cached; max_tokens 0 means 16.
    tokens, _, final = worker.generate(PROMPT, request_id="second")
    assert final.stats.num_cached_tokens == 2 * BLOCK_SIZE
    assert final.stats.num_output_tokens == 16
    assert tokens[:8] == expected


@pytest.mark.parametrize(("worker_interval", "request_interval"), [(4, 0), (1, 4)])
def test_a_stream_interval_sends_several_tokens_a_chunk_and_the_first_at_once(
    reference: LLMEngine, worker_interval: int, request_interval: int
) -> None:
    """--stream-interval 4, or a request's stream_interval 4 (on a worker of 1): the first
    token at once (its chunk carries the TTFT: with any already decoded), then chunks of four
    tokens at least, the last of what is left: at most four chunks for eleven tokens, the same
    tokens and text as one by one."""
    [expected] = reference.generate([PROMPT], SamplingParams(max_tokens=11))
    background = BackgroundWorker(dataclasses.replace(CONFIG, stream_interval=worker_interval))
    try:
        request = worker_pb2.WorkerGenerateRequest(
            prompt_token_ids=PROMPT,
            sampling=common_pb2.SamplingParams(max_tokens=11),
            stream_interval=request_interval,
        )
        chunks = [
            r.chunk for r in background.stub.Generate(request, timeout=30) if r.chunk.token_ids
        ]
    finally:
        background.close()
    sizes = [len(c.token_ids) for c in chunks]
    assert all(n >= 4 for n in sizes[1:-1]) and len(sizes) <= 4, sizes
    assert [t for c in chunks for t in c.token_ids] == expected
    assert "".join(c.text for c in chunks) == ByteTokenizer().decode(expected)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        ([], {}, "the prompt is empty"),
        ([256, 65, 257], {}, "token id 257 is outside the vocabulary [0, 257)"),
        (PROMPT, {"temperature": -0.5}, "temperature must be a finite number >= 0"),
        (PROMPT, {"top_p": 1.5}, "top_p must be in (0, 1]"),
        ([256] + [65] * 1100, {}, "the prompt has 1101 tokens; this worker's context length is"),
        (PROMPT, {"lora": "sql-adapter"}, "lora: unknown adapter 'sql-adapter'"),
    ],
    ids=["empty", "vocab", "temperature", "top_p", "too-long", "lora"],
)
def test_bad_requests_are_invalid_argument(
    worker: BackgroundWorker, prompt: list[int], kwargs: dict, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as error:
        worker.generate(prompt, request_id="bad", **kwargs)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error.value.details()
    assert details.startswith("request bad: ") and message in details
    # The worker keeps serving.
    tokens, _, final = worker.generate(PROMPT, max_tokens=2)
    assert len(tokens) == 2 and final.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_the_prompt_as_bytes_runs_as_the_repeated_field_does(
    worker: BackgroundWorker, reference: LLMEngine
) -> None:
    """What the router sends (``prompt_token_ids_u32le``) and what older senders do."""
    [expected] = reference.generate([PROMPT], SamplingParams(max_tokens=4))
    packed = struct.pack(f"<{len(PROMPT)}I", *PROMPT)
    for request in [
        worker_pb2.WorkerGenerateRequest(prompt_token_ids_u32le=packed),
        worker_pb2.WorkerGenerateRequest(prompt_token_ids=PROMPT),
    ]:
        request.sampling.max_tokens = 4
        responses = list(worker.stub.Generate(request, timeout=30))
        assert [t for r in responses[:-1] for t in r.chunk.token_ids] == expected
        assert responses[-1].final.stats.num_prompt_tokens == len(PROMPT)


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({}, "the prompt is empty: the request sets neither"),
        (
            {"prompt_token_ids": PROMPT, "prompt_token_ids_u32le": b"\x00" * 4},
            "the request sets both prompt_token_ids and prompt_token_ids_u32le",
        ),
        ({"prompt_token_ids_u32le": b"\x00" * 7}, "4 bytes each; got 7 bytes"),
    ],
    ids=["neither", "both", "partial-id"],
)
def test_a_prompt_in_neither_or_both_fields_is_invalid_argument(
    worker: BackgroundWorker, request_fields: dict, message: str
) -> None:
    request = worker_pb2.WorkerGenerateRequest(request_id="bad", **request_fields)
    with pytest.raises(grpc.RpcError) as error:
        list(worker.stub.Generate(request, timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error.value.details()
    assert details.startswith("request bad: ") and message in details


def test_load_and_snapshot(fresh_worker: BackgroundWorker, reference: LLMEngine) -> None:
    load = fresh_worker.load()
    assert load.worker_id == fresh_worker.server.worker_id
    assert (load.num_total_blocks, load.num_free_blocks, load.block_size) == (64, 64, BLOCK_SIZE)
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0)
    [empty] = fresh_worker.stub.Snapshot(worker_pb2.SnapshotRequest())
    assert (empty.event_seq, list(empty.block_hashes)) == (0, [])

    fresh_worker.generate(PROMPT, max_tokens=4)
    assert fresh_worker.load().num_free_blocks == 64  # cached blocks are free blocks
    expected = hash_prompt_blocks(PROMPT, BLOCK_SIZE, reference.namespace)
    assert len(expected) == 2
    chunks = list(fresh_worker.stub.Snapshot(worker_pb2.SnapshotRequest(max_hashes_per_chunk=1)))
    assert [len(c.block_hashes) for c in chunks] == [1, 1]
    assert sorted(h for c in chunks for h in c.block_hashes) == sorted(expected)
    for chunk in chunks:
        assert chunk.worker_id == fresh_worker.server.worker_id
        assert chunk.model == reference.namespace == "kvswitch-tiny"
        assert chunk.block_size == BLOCK_SIZE
        assert chunk.event_seq == chunks[0].event_seq > 0

    # The event batches replay to the snapshot, and the last one is its event_seq.
    batches = fresh_worker.server.engine.take_cache_events()
    assert [b.seq for b in batches] == list(range(1, chunks[0].event_seq + 1))
    assert replay([e for b in batches for e in b.events]) == set(expected)


def test_health_reports_serving(worker: BackgroundWorker) -> None:
    health = health_pb2_grpc.HealthStub(worker.channel)
    for service in ("kvswitch.v1.Worker", ""):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_cancelled_and_timed_out_requests_free_their_blocks(worker: BackgroundWorker) -> None:
    request = worker_pb2.WorkerGenerateRequest(
        request_id="cancelled",
        prompt_token_ids=[256, *b"tell me a long story " * 4],
        sampling=common_pb2.SamplingParams(max_tokens=900),
    )
    engine = worker.server.engine
    call = worker.stub.Generate(request)
    first = next(call)
    assert first.chunk.token_ids
    call.cancel()
    num_steps = engine.counters.num_steps
    load = worker.wait_until_idle()
    assert load.num_running_requests == 0 and load.num_free_blocks == load.num_total_blocks
    # Aborted, not run to its end.
    assert engine.counters.num_steps - num_steps < 100

    with pytest.raises(grpc.RpcError) as error:
        list(worker.stub.Generate(request, timeout=0.3))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    load = worker.wait_until_idle()
    assert load.num_running_requests == 0 and load.num_free_blocks == load.num_total_blocks


def test_concurrent_requests(worker: BackgroundWorker, reference: LLMEngine) -> None:
    prompts = [[256, *f"request number {i} asks something".encode()] for i in range(4)]
    expected = reference.generate(prompts, SamplingParams(max_tokens=6))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: worker.generate(p, max_tokens=6), prompts))
    assert [tokens for tokens, _, _ in results] == expected
    assert all(final.stats.num_output_tokens == 6 for _, _, final in results)


def test_a_stream_of_calls_runs_each_as_generate_does_and_a_cancel_frees_its_blocks(
    worker: BackgroundWorker, reference: LLMEngine
) -> None:
    """GenerateStream on a real worker: three calls with the tokens Generate gives, a bad one
    with Generate's verdict, and a long one the router cancels, whose blocks come back."""
    [expected] = reference.generate([PROMPT], SamplingParams(max_tokens=8))

    def call(call_id: int, prompt: list[int], max_tokens: int) -> worker_pb2.StreamedCall:
        request = worker_pb2.WorkerGenerateRequest(
            request_id=f"streamed-{call_id}",
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
        )
        return worker_pb2.StreamedCall(call_id=call_id, request=request)

    long_prompt = [256, *b"tell me a long story " * 4]
    calls = [call(i, PROMPT, 8) for i in (1, 2, 3)] + [call(4, [], 8), call(5, long_prompt, 900)]
    cancel = threading.Event()

    def requests() -> Iterator[worker_pb2.GenerateStreamRequest]:
        yield worker_pb2.GenerateStreamRequest(calls=calls)
        cancel.wait(60)
        yield worker_pb2.GenerateStreamRequest(cancelled=[5])

    tokens: dict[int, list[int]] = {i: [] for i in range(1, 6)}
    statuses: dict[int, worker_pb2.CallStatus] = {}
    finals: dict[int, worker_pb2.WorkerGenerateFinal] = {}
    stream = worker.stub.GenerateStream(requests(), timeout=60)
    for message in stream:
        for response in message.responses:
            if response.HasField("status"):
                statuses[response.call_id] = response.status
            elif response.response.HasField("final"):
                finals[response.call_id] = response.response.final
            else:
                tokens[response.call_id] += response.response.chunk.token_ids
        if tokens[5] and not cancel.is_set():
            cancel.set()  # NOTE: the long call has begun: the router leaves it
        if len(statuses) == 4 and cancel.is_set():
            break
    engine = worker.server.engine
    num_steps = engine.counters.num_steps
    load = worker.wait_until_idle()
    stream.cancel()
    assert {i: tokens[i] for i in (1, 2, 3)} == {i: expected for i in (1, 2, 3)}
    assert {i: finals[i].stats.num_output_tokens for i in (1, 2, 3)} == {1: 8, 2: 8, 3: 8}
    assert {i: grpc.StatusCode.OK.value[0] for i in (1, 2, 3)} == {
        i: statuses[i].code for i in (1, 2, 3)
    }
    assert statuses[4].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "prompt" in statuses[4].details
    assert 5 not in statuses  # cancelled: no status for it
    assert load.num_running_requests == 0 and load.num_free_blocks == load.num_total_blocks
    assert engine.counters.num_steps - num_steps < 100  # aborted, not run to its 900 tokens


def test_event_buffer_keeps_the_newest_batches() -> None:
    engine = EngineClient.start(CONFIG.engine_config(), max_event_batches=2)

    async def run_requests() -> None:
        for i in range(4):
            prompt = [256, *bytes([65 + i]) * 40]  # two full blocks, new ones each time
            queue = await engine.submit(f"r{i}", prompt, SamplingParams(max_tokens=1))
            output = await queue.get()
            assert output.finished

    try:
        asyncio.run(run_requests())
    finally:
        engine.stop()
    event_seq = engine.event_seq
    assert event_seq >= 4
    assert [b.seq for b in engine.take_cache_events()] == [event_seq - 1, event_seq]
    assert engine.num_dropped_event_batches == event_seq - 2
    assert engine.take_cache_events() == []


def test_a_taken_port_fails_to_start(worker: BackgroundWorker) -> None:
    port = int(worker.server.address.rsplit(":", 1)[1])
    with pytest.raises(WorkerStartError, match=f"cannot listen on 127.0.0.1:{port}"):
        asyncio.run(start_worker(dataclasses.replace(CONFIG, port=port)))


def test_a_checkpoint_whose_tokenizer_cannot_be_read_fails_to_start(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, "llama")
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    config = dataclasses.replace(CONFIG, model=str(tmp_path))
    with pytest.raises(WorkerStartError, match=r"tokenizer\.json cannot be read"):
        asyncio.run(start_worker(config))


def test_worker_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["worker", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--port" in out and "--no-enable-prefix-caching" in out


def test_worker_rejects_a_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["worker", "--dtype", "int8"])
    assert exit_info.value.code == 2
    assert "dtype must be float32, float16 or bfloat16" in capsys.readouterr().err


@contextlib.contextmanager
def worker_process() -> Iterator[tuple[subprocess.Popen, str]]:
    """``kvswitch worker`` on a free port: the process and its address, once it is ready."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvswitch.app.cli",
            "worker",
            "--port",
            "0",
            "--kv-cache-bytes",
            str(NUM_BLOCKS * BLOCK_BYTES),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = process.stdout.readline()
        assert " listening on 127.0.0.1:" in line, process.stderr.read()
        yield process, line.split(" listening on ")[1].strip()
    finally:
        process.kill()
        process.wait()


def test_worker_command_serves_until_sigterm() -> None:
    with worker_process() as (process, address):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(service="kvswitch.v1.Worker"))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_a_worker_whose_engine_core_dies_fails_its_streams_and_exits() -> None:
    with worker_process() as (process, address):
        (core_pid,) = engine_core_pids(process.pid)
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            call = stub.Generate(
                worker_pb2.WorkerGenerateRequest(
                    prompt_token_ids=PROMPT,
                    sampling=common_pb2.SamplingParams(max_tokens=100_000),
                ),
                timeout=30,
            )
            assert next(call).chunk.token_ids
            os.kill(core_pid, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as error:
                list(call)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert error.value.details().endswith(
                ": this worker is stopping: the engine core died (killed by SIGKILL)"
            )
        # Not serving any more: the worker stops, saying why, with a failure exit code.
        assert process.wait(timeout=30) == 1
        assert "kvswitch worker: the engine core died (killed by SIGKILL)" in process.stderr.read()


def test_worker_publishes_its_cache_to_the_index() -> None:
    worker = BackgroundWorker(dataclasses.replace(CONFIG, index="memory://"))
    try:
        publisher = worker.server.publisher
        assert publisher is not None
        worker.generate(PROMPT, max_tokens=4)
        chain = hash_prompt_blocks(PROMPT, BLOCK_SIZE, worker.server.engine.namespace)

        async def matched() -> dict[str, int]:
            return await publisher.index.match(worker.server.engine.namespace, chain)

        deadline = time.monotonic() + 5
        while worker._run(matched()) != {worker.server.worker_id: len(chain)}:
            assert time.monotonic() < deadline, worker._run(matched())
            time.sleep(0.02)
        (info,) = worker._run(publisher.index.live_workers())
        assert (info.role, info.block_size, info.num_blocks) == ("both", 16, NUM_BLOCKS)
    finally:
        worker.close()
    assert worker._loop.is_closed()


def test_an_index_that_does_not_answer_stops_the_start_with_a_message() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    config = dataclasses.replace(CONFIG, index=f"redis://user:s3cret@127.0.0.1:{port}")
    with pytest.raises(WorkerStartError) as error:
        asyncio.run(start_worker(config))
    assert str(error.value).startswith(
        f"cannot open the block index: cannot use the Redis at redis://user:***@127.0.0.1:{port}"
    )
    assert "s3cret" not in str(error.value)


def test_a_device_this_machine_lacks_stops_the_start_with_a_message() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(WorkerStartError, match=r"'cuda'.* sees no CUDA GPU.*use --device cpu"):
        asyncio.run(start_worker(dataclasses.replace(CONFIG, device="cuda")))
    with pytest.raises(WorkerStartError, match="'tpu' is not a torch device"):
        asyncio.run(start_worker(dataclasses.replace(CONFIG, device="tpu")))


def test_worker_refuses_a_bad_index_url() -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        dataclasses.replace(CONFIG, role="router")
    assert dataclasses.replace(CONFIG, role="prefill").role == "prefill"
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(WorkerStartError, match="cannot open the block index"):
            loop.run_until_complete(start_worker(dataclasses.replace(CONFIG, index="etcd://x")))
    finally:
        loop.close()


def _scrape(address: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample that ``/metrics`` at ``address`` shows, by name and labels."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_endpoint_counts_requests_and_shows_load(worker: BackgroundWorker) -> None:
    assert worker.server.metrics_address is None  # metrics_port -1: no endpoint

    metered = BackgroundWorker(dataclasses.replace(CONFIG, metrics_port=0))
    try:
        address = metered.server.metrics_address
        assert address is not None and address.startswith("127.0.0.1:")
        metered.generate(PROMPT, max_tokens=4, request_id="metered")
        samples = _scrape(address)

        def value(name: str, **labels: str) -> float | None:
            return samples.get((name, frozenset(labels.items())))

        requests = "kvswitch_worker_requests_total"
        assert value(requests, finish_reason="length") == 1
        assert value(requests, finish_reason="stop") == value(requests, finish_reason="abort") == 0
        assert value("kvswitch_worker_prompt_tokens_total") == len(PROMPT)
        assert value("kvswitch_worker_cached_prompt_tokens_total") == 0
        assert value("kvswitch_worker_output_tokens_total") == 4
        assert value("kvswitch_worker_ttft_seconds_count") == 1
        assert value("kvswitch_worker_ttft_seconds_bucket", le="+Inf") == 1
        assert value("kvswitch_worker_total_blocks") == value("kvswitch_worker_free_blocks") == 64
        assert value("kvswitch_worker_running_requests") == 0
        assert value("kvswitch_worker_waiting_requests") == 0
        assert value("kvswitch_worker_queued_prefill_tokens") == 0
        info = {"worker_id": metered.server.worker_id, "model": "kvswitch-tiny", "role": "both"}
        assert value("kvswitch_worker_info", **info) == 1
        for name in [
            "failed_steps",
            "preemptions",
            "dropped_event_batches",
            "index_errors",  # no index here: no publisher, nothing to count
            "index_resyncs",
            "index_registers",
        ]:
            assert value(f"kvswitch_worker_{name}_total") == 0
        metered.server.engine.counters = CoreCounters(num_failed_steps=2)  # read at the scrape
        assert _scrape(address)[("kvswitch_worker_failed_steps_total", frozenset())] == 2

        # A rejected request counts, but its prompt does not; a cancelled one counts as abort.
        with pytest.raises(grpc.RpcError):
            metered.generate([], request_id="empty")
        call = metered.stub.Generate(
            worker_pb2.WorkerGenerateRequest(
                request_id="cancelled",
                prompt_token_ids=PROMPT,
                sampling=common_pb2.SamplingParams(max_tokens=900),
            )
        )
        next(call)
        call.cancel()
        metered.wait_until_idle()
        samples = _scrape(address)
        assert value(requests, finish_reason="rejected") == 1
        assert value(requests, finish_reason="abort") == 1
        # The cancelled request reached its first token, with the prompt's two blocks cached.
        assert value("kvswitch_worker_ttft_seconds_count") == 2
        assert value("kvswitch_worker_prompt_tokens_total") == 2 * len(PROMPT)
        assert value("kvswitch_worker_cached_prompt_tokens_total") == 2 * BLOCK_SIZE
    finally:
        metered.close()
    with pytest.raises(urllib.error.URLError):
        _scrape(address)


def test_a_taken_metrics_port_fails_to_start(worker: BackgroundWorker) -> None:
    port = int(worker.server.address.rsplit(":", 1)[1])  # taken by the worker's gRPC server
    config = dataclasses.replace(CONFIG, metrics_port=port)
    with pytest.raises(WorkerStartError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
        asyncio.run(start_worker(config))
    with pytest.raises(ValueError, match="metrics_port must be -1"):
        dataclasses.replace(CONFIG, metrics_port=-2)
