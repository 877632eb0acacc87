"""``Client`` against a scripted router over real gRPC on 127.0.0.1."""

from __future__ import annotations

import shutil
import socket
import struct
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from kvswitch.client import Chunk, Client, KvswitchError, KvswitchTimeoutError
from kvswitch.client.request import WHOLE_ANSWER_STREAM_INTERVAL
from kvswitch.v1 import common_pb2, router_pb2
from tests.client.scripted_router import (
    EXPECTED,
    EXPECTED_CHUNKS,
    BackgroundRouter,
    ScriptedRouter,
    free_address,
)


def test_generate_assembles_the_result(router: ScriptedRouter) -> None:
    with Client(router.address) as client:
        result = client.generate("Hello?", request_id="req-1")
    assert result == EXPECTED
    assert result.finish_reason == "length"
    [call] = router.calls
    assert call.request == router_pb2.GenerateRequest(
        request_id="req-1",
        text="Hello?",
        sampling=common_pb2.SamplingParams(max_tokens=16, top_p=1.0),
        routing=router_pb2.RoutingOverrides(),
        stream_interval=WHOLE_ANSWER_STREAM_INTERVAL,  # generate reads the whole answer
    )


def test_every_argument_reaches_the_router(router: ScriptedRouter) -> None:
    with Client(router.address) as client:
        client.generate(
            prompt_token_ids=[256, 81, 58],
            max_tokens=4,
            temperature=0.5,
            top_p=0.75,
            seed=7,
            stop_token_ids=[10],
            lora="sql",
            cache_salt="tenant-a",
            policy="least_loaded",
            weights={"cache": 2.0, "load": 0.5},
            request_id="req-2",
        )
    [call] = router.calls
    assert call.request == router_pb2.GenerateRequest(
        request_id="req-2",
        token_ids=router_pb2.TokenIds(ids_u32le=struct.pack("<3I", 256, 81, 58)),
        sampling=common_pb2.SamplingParams(
            max_tokens=4, temperature=0.5, top_p=0.75, seed=7, stop_token_ids=[10]
        ),
        lora="sql",
        cache_salt="tenant-a",
        routing=router_pb2.RoutingOverrides(
            policy="least_loaded", weights={"cache": 2.0, "load": 0.5}
        ),
        stream_interval=WHOLE_ANSWER_STREAM_INTERVAL,
    )


def test_stream_yields_chunks_in_order_then_the_result(router: ScriptedRouter) -> None:
    with Client(router.address) as client:
        stream = client.stream("Hello?", request_id="req-1")
        with pytest.raises(RuntimeError, match="stream req-1 has not ended"):
            _ = stream.result
        assert list(stream) == EXPECTED_CHUNKS
        assert stream.result == EXPECTED


def test_token_goes_out_as_bearer_metadata(router: ScriptedRouter) -> None:
    with Client(router.address, token="s3cret") as client:
        client.generate("a")
    with Client(router.address) as client:
        client.generate("b")
    assert router.calls[0].metadata["authorization"] == "Bearer s3cret"
    assert "authorization" not in router.calls[1].metadata


def test_deadline_reaches_the_router(router: ScriptedRouter) -> None:
    with Client(router.address, timeout_s=5.0) as client:
        client.generate("a")
        client.generate("b", timeout_s=2.0)
    with Client(router.address) as client:
        client.generate("c")
    first, second, third = (call.time_remaining_s for call in router.calls)
    # gRPC sends the timeout rounded up a little.
    assert first is not None and 4.0 < first < 5.1
    assert second is not None and 1.0 < second < 2.1
    assert third is None


def test_unavailable_before_the_first_chunk_is_retried_with_the_same_id(
    router: ScriptedRouter,
) -> None:
    router.script.num_failures = 2
    with Client(router.address, initial_backoff_s=0.01) as client:
        result = client.generate("a")
    assert result.token_ids == EXPECTED.token_ids
    assert len(router.calls) == 3
    request_ids = {call.request.request_id for call in router.calls}
    assert request_ids == {result.request_id}
    assert len(result.request_id) == 32 and int(result.request_id, 16) >= 0


def test_resource_exhausted_with_a_wait_is_retried(router: ScriptedRouter) -> None:
    router.script.num_failures = 1
    router.script.failure_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    router.script.failure_retry_after_ms = 10
    with Client(router.address, initial_backoff_s=0.01) as client:
        assert client.generate("a").text == "Hello"
    assert len(router.calls) == 2


def test_a_message_over_the_routers_size_limit_is_not_retried(router: ScriptedRouter) -> None:
    # gRPC's own refusal (RESOURCE_EXHAUSTED, no wait asked): the same upload would fail again.
    router.script.num_failures = 1
    router.script.failure_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    with Client(router.address, initial_backoff_s=0.01) as client, pytest.raises(KvswitchError):
        client.generate("a")
    assert len(router.calls) == 1


def test_no_retry_once_a_chunk_has_arrived(router: ScriptedRouter) -> None:
    router.script.fail_after_chunks = 1
    received: list[Chunk] = []
    with (
        Client(router.address, initial_backoff_s=0.01) as client,
        pytest.raises(KvswitchError) as error,
    ):
        for chunk in client.stream("a", request_id="req-3"):
            received.append(chunk)
    assert received == EXPECTED_CHUNKS[:1]
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert str(error.value) == "request req-3 failed with UNAVAILABLE: failed after 1 chunks"
    assert len(router.calls) == 1


def test_retries_run_out(router: ScriptedRouter) -> None:
    router.script.num_failures = 100
    with (
        Client(router.address, max_retries=2, initial_backoff_s=0.01) as client,
        pytest.raises(KvswitchError) as error,
    ):
        client.generate("a", request_id="req-4")
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert error.value.details == "scripted failure 3"
    assert error.value.request_id == "req-4"
    assert len(router.calls) == 3


def test_invalid_argument_is_not_retried(router: ScriptedRouter) -> None:
    router.script.num_failures = 1
    router.script.failure_code = grpc.StatusCode.INVALID_ARGUMENT
    with (
        Client(router.address, initial_backoff_s=0.01) as client,
        pytest.raises(KvswitchError) as error,
    ):
        client.generate("a", request_id="req-5")
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(error.value) == "request req-5 failed with INVALID_ARGUMENT: scripted failure 1"
    assert len(router.calls) == 1


def test_a_passed_deadline_is_a_timeout_error(router: ScriptedRouter) -> None:
    router.script.hang_after_chunks = 1
    received: list[Chunk] = []
    with Client(router.address, timeout_s=0.3) as client:
        start_s = time.monotonic()
        with pytest.raises(KvswitchTimeoutError) as error:
            for chunk in client.stream("a"):
                received.append(chunk)
    assert 0.25 < time.monotonic() - start_s < 2.0
    assert received == EXPECTED_CHUNKS[:1]
    assert isinstance(error.value, KvswitchError)
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert router.calls[0].cancelled.wait(timeout=60)  # a bound for a hang


def test_the_deadline_bounds_all_attempts(router: ScriptedRouter) -> None:
    router.script.num_failures = 1000
    with Client(router.address, max_retries=1000, initial_backoff_s=0.02) as client:
        start_s = time.monotonic()
        with pytest.raises(KvswitchError) as error:
            client.generate("a", timeout_s=0.5)
    assert time.monotonic() - start_s < 1.0
    # The last attempt's error: UNAVAILABLE, or DEADLINE_EXCEEDED if the deadline cut it short.
    assert error.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert 2 < len(router.calls) < 1000


def test_an_unreachable_router_is_unavailable() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    with (
        Client(address, max_retries=1, initial_backoff_s=0.01) as client,
        pytest.raises(KvswitchError) as error,
    ):
        client.generate("a")
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


def _break_after_one_chunk(client: Client) -> None:
    for _ in client.stream("a"):
        break


def _close_after_one_chunk(client: Client) -> None:
    stream = client.stream("a")
    next(stream)
    stream.close()
    assert list(stream) == []


def _leave_with_after_one_chunk(client: Client) -> None:
    with client.stream("a") as stream:
        next(stream)


@pytest.mark.parametrize(
    "stop", [_break_after_one_chunk, _close_after_one_chunk, _leave_with_after_one_chunk]
)
def test_stopping_a_stream_cancels_the_call(router: ScriptedRouter, stop) -> None:
    router.script.hang_after_chunks = 1
    with Client(router.address) as client:
        stop(client)
        assert router.calls[0].cancelled.wait(timeout=60)  # a bound for a hang
        # The connection still serves the next request.
        router.script.hang_after_chunks = None
        assert client.generate("b").text == "Hello"


def test_a_stream_without_a_final_message_is_an_error(router: ScriptedRouter) -> None:
    router.script.final = None
    with Client(router.address) as client, pytest.raises(KvswitchError) as error:
        client.generate("a", request_id="req-6")
    assert error.value.code == grpc.StatusCode.INTERNAL
    assert error.value.details == "the stream ended without a final message"


def test_bad_arguments_fail_before_anything_is_sent(router: ScriptedRouter) -> None:
    with Client(router.address) as client:
        with pytest.raises(ValueError, match="top_p must be in"):
            client.stream("a", top_p=0.0)
        with pytest.raises(ValueError, match="timeout_s must be a positive number"):
            client.generate("a", timeout_s=0)
    assert router.calls == []


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_with_a_ca_bundle(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    background = BackgroundRouter(credentials)
    try:
        address = background.servicer.address
        with Client(address, tls=cert, token="t") as client:
            assert client.generate("a").text == "Hello"
        with Client(address, tls=str(cert)) as client:
            assert client.generate("a").text == "Hello"
        # Plaintext to a TLS port fails (and is retried as UNAVAILABLE).
        with Client(address, max_retries=0) as client, pytest.raises(KvswitchError) as error:
            client.generate("a")
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
        assert background.servicer.calls[0].metadata["authorization"] == "Bearer t"
    finally:
        background.close()


def test_wait_until_connected_returns_once_a_router_answers_and_says_when_none_does(
    router: ScriptedRouter,
) -> None:
    with Client(router.address) as client:
        client.wait_until_connected(5.0)
    with (
        Client(free_address()) as client,
        pytest.raises(ConnectionError, match=r"no router answered at 127\.0\.0\.1:"),
    ):
        client.wait_until_connected(0.3)
