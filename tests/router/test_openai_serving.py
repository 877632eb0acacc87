"""The router's HTTP API as a server: each HTTP client's own stream limit, requests cancelled
with their clients and at stop strings, streams the router cuts off, mutual TLS, the port, and
``kvswitch router --http-port`` as a process."""

from __future__ import annotations

import dataclasses
import signal
import socket
import ssl
import time
from collections.abc import Iterator

import grpc
import httpx2
import openai
import pytest

from kvswitch.client import Client, KvswitchError
from kvswitch.router.server import RouterConfig, RouterStartError, start_router
from kvswitch.serving import start_server_process
from tests.certs import TestCA
from tests.router.harness import BackgroundCluster
from tests.router.test_openai_http import MESSAGES, PROMPT, ROUTER, TOKEN, WORKER, openai_client
from tests.router.test_security import client_credentials, fleet

# -- the open-stream limit, per HTTP client ------------------------------------------------------


@pytest.fixture(scope="module")
def limited() -> Iterator[BackgroundCluster]:
    router = dataclasses.replace(ROUTER, max_streams_per_client=1)
    with BackgroundCluster(1, router, WORKER) as cluster:
        yield cluster


def test_each_http_client_has_its_own_stream_limit(limited: BackgroundCluster) -> None:
    other_address = openai.DefaultHttpxClient(
        transport=httpx2.HTTPTransport(local_address="127.0.0.2")
    )
    with openai_client(limited) as here, openai_client(limited, http_client=other_address) as there:
        (card,) = here.models.list().data
        held = here.completions.create(
            model=card.id, prompt=PROMPT, max_tokens=2000, temperature=0, stream=True
        )
        next(iter(held))  # routed and streaming: 127.0.0.1's one stream
        with pytest.raises(openai.RateLimitError) as limited_here:
            here.completions.create(model=card.id, prompt=PROMPT, max_tokens=2)
        headers = limited_here.value.response.headers
        assert (headers["retry-after-ms"], headers["retry-after"]) == ("100", "1")
        # A gRPC client at the same address shares its limit...
        with (
            Client(limited.address, max_retries=0) as grpc_client,
            pytest.raises(KvswitchError) as refused,
        ):
            grpc_client.generate(PROMPT, max_tokens=2)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # ...and an HTTP client at another address has its own.
        other = there.completions.create(model=card.id, prompt=PROMPT, max_tokens=2)
        assert other.choices[0].finish_reason == "length"
        held.close()  # the request is cancelled on the router, and its place freed
        served_once_a_place_frees(here, card.id, "the closed stream still holds its place")


def served_once_a_place_frees(client: openai.OpenAI, model: str, why_not: str) -> None:
    """A request of ``client``, retried while its streams are at the limit (5 s at most)."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
            return
        except openai.RateLimitError:
            assert time.monotonic() < deadline, why_not
            time.sleep(0.05)


def test_a_client_that_leaves_cancels_its_request(limited: BackgroundCluster) -> None:
    with openai_client(limited) as client:
        (card,) = client.models.list().data
        with pytest.raises(openai.APITimeoutError):  # gone before its 2000 tokens
            client.completions.create(model=card.id, prompt=PROMPT, max_tokens=2000, timeout=0.5)
        # The one stream this client may hold is free again well before 2000 tokens could be.
        served_once_a_place_frees(client, card.id, "the request of the client that left runs on")


def test_a_stream_the_router_cuts_off_ends_with_an_error_event(
    limited: BackgroundCluster,
) -> None:
    # A router of its own (on the same workers), stopped while it streams.
    config = dataclasses.replace(ROUTER, index=f"grpc://{limited.address}")
    router = limited.run(start_router(config))
    deadline = time.monotonic() + 5.0
    while not router.router.directory.routable():
        assert time.monotonic() < deadline, "the second router never saw the worker"
        time.sleep(0.02)
    front = router.http_front
    assert front is not None
    with openai.OpenAI(base_url=front.url, api_key="x", max_retries=0) as client:
        stream = client.chat.completions.create(
            model="kvswitch-tiny", messages=MESSAGES, max_tokens=2000, stream=True
        )
        chunks = iter(stream)
        assert next(chunks).choices[0].delta.role == "assistant"
        limited.run(router.stop(0))  # no grace: the running call is cancelled
        with pytest.raises(openai.APIError) as failed:
            for _ in chunks:
                pass
    # The error came as an event of the stream, in OpenAI's shape, not as a broken connection.
    assert not isinstance(failed.value, openai.APIConnectionError)
    assert isinstance(failed.value.body, dict) and failed.value.body["type"] == "server_error"


def test_a_stop_string_ends_the_request_on_the_router(limited: BackgroundCluster) -> None:
    with openai_client(limited) as client:
        (card,) = client.models.list().data
        text = (
            client.completions.create(model=card.id, prompt=PROMPT, max_tokens=20, temperature=0)
            .choices[0]
            .text
        )
        cut = client.completions.create(
            model=card.id, prompt=PROMPT, max_tokens=2000, temperature=0, stop=text[-3:]
        )
        assert cut.choices[0].finish_reason == "stop"
        # The one stream this client may hold is free again well before 2000 tokens could be.
        deadline = time.monotonic() + 5.0
        while True:
            try:
                client.completions.create(model=card.id, prompt=PROMPT, max_tokens=1)
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "the stopped request still runs"
                time.sleep(0.05)


# -- TLS ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def secured(ca: TestCA) -> Iterator[BackgroundCluster]:
    """Mutual TLS on every hop: the HTTP API too, and the front's own call to the router."""
    router = dataclasses.replace(ROUTER, token=TOKEN, **fleet(ca, "router", mutual=True))
    worker = dataclasses.replace(WORKER, **fleet(ca, "worker", mutual=True))
    with BackgroundCluster(1, router, worker) as cluster:
        yield cluster


def test_the_http_api_speaks_mutual_tls(secured: BackgroundCluster, ca: TestCA) -> None:
    assert secured.router.http_front is not None
    assert secured.router.http_front.url.startswith("https://")
    context = ssl.create_default_context(cafile=ca.cert)
    identity = ca.issue("http-client")
    context.load_cert_chain(identity.cert, identity.key)
    with openai_client(secured, http_client=openai.DefaultHttpxClient(verify=context)) as client:
        (card,) = client.models.list().data
        completion = client.completions.create(
            model=card.id, prompt=PROMPT, max_tokens=6, temperature=0
        )
    with Client(secured.address, tls=client_credentials(ca, True), token=TOKEN) as grpc_client:
        expected = grpc_client.generate(PROMPT, max_tokens=6, temperature=0.0)
    assert completion.choices[0].text == expected.text
    no_certificate = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca.cert))
    with (
        openai_client(secured, http_client=no_certificate) as stranger,
        pytest.raises(openai.APIConnectionError),
    ):
        stranger.models.list()


def test_the_http_port_is_checked_and_a_taken_one_fails_the_start(
    limited: BackgroundCluster,
) -> None:
    with pytest.raises(ValueError, match="http_port"):
        RouterConfig(http_port=-2)
    assert limited.router.http_address is not None
    taken = int(limited.router.http_address.rsplit(":", 1)[1])
    config = dataclasses.replace(ROUTER, http_port=taken)
    with pytest.raises(RouterStartError, match="cannot serve HTTP"):
        limited.run(start_router(config))


def test_kvswitch_router_serves_http_and_stops_on_sigterm() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process, _ = start_server_process(["router", "--port", "0", "--http-port", str(port)])
    try:
        response = httpx2.get(f"http://127.0.0.1:{port}/v1/models")
        assert response.json() == {"object": "list", "data": []}  # no worker has joined
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()
