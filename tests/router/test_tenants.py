"""Per-tenant limits: a tenant past its open streams or its request rate is refused with
RESOURCE_EXHAUSTED (HTTP 429) and how long to wait, while another tenant on the same client
address goes on; over gRPC (the tenant header in the metadata) and the OpenAI API (the header,
or the API key)."""

from __future__ import annotations

import collections
import dataclasses
import threading

import grpc
import httpx2
import pytest

from kvswitch.router.tenants import TenantLimits, key_tenant
from kvswitch.serving import retry_after_ms
from kvswitch.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.router.harness import ROUTER_CONFIG, WORKER_CONFIG, BackgroundCluster, wait_until

PROMPT = router_pb2.TokenIds(ids=[256, *b"a tenant's question"])


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_a_tenants_open_streams_are_counted_apart() -> None:
    limits = TenantLimits(max_streams=2)
    assert limits.admit("a") is None and limits.admit("a") is None
    assert limits.admit("a") == ("streams", 0.1)
    assert limits.admit("b") is None  # another tenant: its own count
    limits.close("a")
    assert limits.admit("a") is None and limits.num_open("a") == 2


def test_a_tenants_rate_is_a_bucket_that_says_how_long_to_wait() -> None:
    clock = Clock()
    limits = TenantLimits(requests_per_s=2.0, burst=3, clock=clock)
    for _ in range(3):
        assert limits.admit("a") is None
        limits.close("a")
    refused = limits.admit("a")
    assert refused is not None and refused[0] == "rate"
    assert refused[1] == pytest.approx(0.5)  # one request comes back every half second
    assert limits.admit("b") is None
    clock.now_s += 0.5
    assert limits.admit("a") is None
    assert TenantLimits(requests_per_s=2.5).burst == 3
    with pytest.raises(ValueError, match="must be >= 0"):
        TenantLimits(max_streams=-1)
    assert key_tenant("secret") == key_tenant("secret") != key_tenant("other")
    assert "secret" not in key_tenant("secret")


def _call(channel: grpc.Channel, tenant: str, max_tokens: int) -> grpc.Future:
    request = router_pb2.GenerateRequest(
        token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)
    )
    return router_pb2_grpc.RouterStub(channel).Generate(
        request, metadata=(("x-tenant", tenant),), timeout=60
    )


def test_a_tenant_at_its_stream_limit_is_refused_and_another_goes_on() -> None:
    router = dataclasses.replace(
        ROUTER_CONFIG, http_port=0, tenant_header="x-tenant", max_streams_per_tenant=1
    )
    worker = dataclasses.replace(WORKER_CONFIG, engine_in_process=True)
    with (
        BackgroundCluster(1, router, worker) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        held = _call(channel, "a", 2000)
        next(held)  # tenant a's one stream, open
        with pytest.raises(grpc.RpcError) as refused:
            list(_call(channel, "a", 2))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant" in refused.value.details()
        assert retry_after_ms(refused.value.trailing_metadata()) == 100
        assert list(_call(channel, "b", 2))[-1].final.finish_reason  # tenant b goes on
        # The OpenAI API: the same header names the tenant.
        front = cluster.router.http_front
        assert front is not None
        body = {"model": "kvswitch-tiny", "prompt": "Hello", "max_tokens": 2}
        url = f"{front.url}/completions"
        response = httpx2.post(url, json=body, headers={"x-tenant": "a"}, timeout=30)
        assert response.status_code == 429, response.text
        assert response.headers["retry-after-ms"] == "100"
        response = httpx2.post(url, json=body, headers={"x-tenant": "b"}, timeout=30)
        assert response.status_code == 200, response.text
        held.cancel()


def test_a_tenant_past_its_rate_waits_and_an_api_key_names_a_tenant() -> None:
    router = dataclasses.replace(
        ROUTER_CONFIG,
        http_port=0,
        api_key="key-a,key-b",
        max_requests_per_tenant_per_s=0.01,
        tenant_burst=1,
    )
    worker = dataclasses.replace(WORKER_CONFIG, engine_in_process=True)
    with BackgroundCluster(1, router, worker) as cluster:
        front = cluster.router.http_front
        assert front is not None
        body = {"model": "kvswitch-tiny", "prompt": "Hello", "max_tokens": 2}
        url = f"{front.url}/completions"

        def post(key: str) -> httpx2.Response:
            return httpx2.post(url, json=body, headers={"authorization": f"Bearer {key}"})

        assert post("key-a").status_code == 200
        refused = post("key-a")  # its one request a hundred seconds is spent
        assert refused.status_code == 429, refused.text
        # NOTE: 100 s less the time the first request took, however slow the machine.
        assert 50_000 < int(refused.headers["retry-after-ms"]) <= 100_000
        assert post("key-b").status_code == 200  # the other key is another tenant


def test_a_flooding_tenant_is_held_to_its_streams_and_another_is_never_refused() -> None:
    """Tenant a floods (eight threads, each sending again as soon as one ends) past its two
    streams; tenant b's requests meanwhile are all served, and the worker never holds more
    than a's two streams and b's one."""
    router = dataclasses.replace(ROUTER_CONFIG, tenant_header="x-tenant", max_streams_per_tenant=2)
    worker_config = dataclasses.replace(WORKER_CONFIG, engine_in_process=True)
    with (
        BackgroundCluster(1, router, worker_config) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        worker = cluster.workers[0]
        stop = threading.Event()
        outcomes: collections.Counter = collections.Counter()
        most_at_worker = 0

        def flood() -> None:
            while not stop.is_set():
                try:
                    list(_call(channel, "a", 8))
                    outcomes["served"] += 1
                except grpc.RpcError as e:
                    outcomes[e.code()] += 1

        threads = [threading.Thread(target=flood) for _ in range(8)]
        for thread in threads:
            thread.start()
        try:
            wait_until(
                lambda: (
                    outcomes[grpc.StatusCode.RESOURCE_EXHAUSTED] >= 20 and outcomes["served"] >= 2
                ),
                "tenant a served and refused",
            )
            for _ in range(10):
                call = _call(channel, "b", 8)
                most_at_worker = max(most_at_worker, worker.engine.num_requests)
                assert list(call)[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
        assert set(outcomes) == {"served", grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert most_at_worker <= 3
