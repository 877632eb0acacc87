"""TLS, mutual TLS and bearer tokens on every gRPC hop: client -> router -> worker -> peer worker,
and worker -> the router's embedded index. A throwaway CA signs every certificate."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvswitch.app import generate, health
from kvswitch.cache_index.audit import audit
from kvswitch.cache_index.grpc_index import GrpcIndex
from kvswitch.cache_index.index import WorkerInfo
from kvswitch.client import Client, KvswitchError
from kvswitch.security import FleetSecurity
from kvswitch.v1 import worker_pb2
from tests.certs import TestCA
from tests.router.harness import ROUTER_CONFIG, WORKER_CONFIG, BackgroundCluster

CLIENT_TOKEN = "client-secret"
FLEET_TOKEN = "fleet-secret"
# Long enough that the decode worker takes its blocks from the prefill worker, over gRPC.
LONG_PROMPT = [256] + [65 + i % 26 for i in range(299)]


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("ca"))


def fleet(ca: TestCA, name: str, *, mutual: bool) -> dict:
    identity = ca.issue(name)
    return {
        "tls_cert": identity.cert,
        "tls_key": identity.key,
        "tls_ca": ca.cert,
        "tls_client_auth": mutual,
        "fleet_token": FLEET_TOKEN,
    }


@pytest.fixture(scope="module", params=[False, True], ids=["tls", "mutual-tls"])
def cluster(request: pytest.FixtureRequest, ca: TestCA) -> Iterator[BackgroundCluster]:
    """A prefill worker, a decode worker and a router, every hop over TLS with tokens."""
    mutual = request.param
    router = dataclasses.replace(
        ROUTER_CONFIG,
        token=CLIENT_TOKEN,
        kv_transport="grpc",
        min_remote_prefill_tokens=64,
        **fleet(ca, "router", mutual=mutual),
    )
    worker = dataclasses.replace(WORKER_CONFIG, **fleet(ca, "worker", mutual=mutual))
    with BackgroundCluster(0, router, worker) as cluster:
        cluster.add_worker("p0", role="prefill")
        cluster.add_worker("d0", role="decode")
        cluster.mutual = mutual  # type: ignore[attr-defined]
        yield cluster


def client_credentials(ca: TestCA, mutual: bool) -> grpc.ChannelCredentials:
    identity = ca.issue("client") if mutual else None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca.cert).read_bytes(),
        private_key=Path(identity.key).read_bytes() if identity else None,
        certificate_chain=Path(identity.cert).read_bytes() if identity else None,
    )


def test_a_request_crosses_every_hop_secured(cluster: BackgroundCluster, ca: TestCA) -> None:
    credentials = client_credentials(ca, cluster.mutual)  # type: ignore[attr-defined]
    with Client(cluster.address, tls=credentials, token=CLIENT_TOKEN) as client:
        result = client.generate(prompt_token_ids=LONG_PROMPT, max_tokens=4)
    assert len(result.token_ids) == 4
    stats = result.stats
    assert (stats.prefill_worker_id, stats.decode_worker_id) == ("p0", "d0")
    assert stats.num_transferred_blocks == len(LONG_PROMPT) // 16  # worker to worker, over TLS
    # The index heard from both workers over TLS; the audit reaches them the same way.
    auditor = FleetSecurity(**fleet(ca, "auditor", mutual=cluster.mutual))  # type: ignore[attr-defined]
    audits = cluster.run(audit(cluster.router.index, auditor))
    assert sorted(a.worker_id for a in audits) == ["d0", "p0"]
    assert all(not a.error and a.num_stale == a.num_missing == 0 for a in audits), audits


def test_the_router_refuses_a_client_without_its_token(
    cluster: BackgroundCluster, ca: TestCA
) -> None:
    credentials = client_credentials(ca, cluster.mutual)  # type: ignore[attr-defined]
    for token in (None, "guess"):
        client = Client(cluster.address, tls=credentials, token=token)
        with client, pytest.raises(KvswitchError) as error:
            client.generate(prompt_token_ids=[256, 65], max_tokens=1)
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_is_refused(cluster: BackgroundCluster) -> None:
    client = Client(cluster.address, token=CLIENT_TOKEN)
    with client, pytest.raises(KvswitchError) as error:
        client.generate(prompt_token_ids=[256, 65], max_tokens=1, timeout_s=5)
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_client_certificate_is_required_with_mutual_tls_only(
    cluster: BackgroundCluster, ca: TestCA
) -> None:
    with Client(cluster.address, tls=ca.cert, token=CLIENT_TOKEN) as client:
        if not cluster.mutual:  # type: ignore[attr-defined]
            assert len(client.generate(prompt_token_ids=[256, 65], max_tokens=1).token_ids) == 1
            return
        with pytest.raises(KvswitchError) as error:
            client.generate(prompt_token_ids=[256, 65], max_tokens=1, timeout_s=5)
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


async def get_load(security: FleetSecurity, address: str) -> grpc.StatusCode:
    async with security.channel(address) as channel:
        stub = channel.unary_unary(
            "/kvswitch.v1.Worker/GetLoad",
            request_serializer=worker_pb2.GetLoadRequest.SerializeToString,
            response_deserializer=worker_pb2.WorkerLoad.FromString,
        )
        try:
            await stub(worker_pb2.GetLoadRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK


async def register(security: FleetSecurity, address: str) -> grpc.StatusCode:
    index = GrpcIndex(address, security=security)
    try:
        await index.register(WorkerInfo("intruder", "127.0.0.1:1", "m", 16, "both", 8), 5.0)
    except grpc.aio.AioRpcError as e:
        return e.code()
    finally:
        await index.close()
    return grpc.StatusCode.OK


def test_workers_and_the_index_refuse_calls_without_the_fleet_token(
    cluster: BackgroundCluster, ca: TestCA
) -> None:
    identity = fleet(ca, "intruder", mutual=cluster.mutual)  # type: ignore[attr-defined]
    worker = cluster.worker("p0").address
    for token in ("", "guess"):
        security = FleetSecurity(**{**identity, "fleet_token": token})
        assert cluster.run(get_load(security, worker)) == grpc.StatusCode.UNAUTHENTICATED
        assert cluster.run(register(security, cluster.address)) == (grpc.StatusCode.UNAUTHENTICATED)
    # With the token, the same caller gets through.
    assert cluster.run(get_load(FleetSecurity(**identity), worker)) == grpc.StatusCode.OK


def test_the_health_probe_speaks_tls(cluster: BackgroundCluster, ca: TestCA) -> None:
    identity = ca.issue("probe") if cluster.mutual else None  # type: ignore[attr-defined]
    config = health.HealthConfig(
        target=cluster.address,
        tls_ca=ca.cert,
        tls_cert=identity.cert if identity else "",
        tls_key=identity.key if identity else "",
    )
    assert health.run(config) == 0
    assert health.run(health.HealthConfig(target=cluster.address, timeout_s=1)) == 1


def test_half_a_tls_setup_is_refused() -> None:
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        FleetSecurity(tls_cert="a.crt")
    with pytest.raises(ValueError, match="tls_client_auth needs"):
        FleetSecurity(tls_client_auth=True)
    with pytest.raises(ValueError, match="no such file"):
        FleetSecurity(tls_cert="/nonexistent.crt", tls_key="/nonexistent.key")


def test_kvswitch_generate_speaks_tls(cluster: BackgroundCluster, ca: TestCA) -> None:
    config = generate.GenerateConfig(
        target=cluster.address, prompt="Hi", max_tokens=2, token=CLIENT_TOKEN, tls_ca=ca.cert
    )
    # It presents no certificate: served over TLS, refused where the router asks for one.
    assert generate.run(config) == (1 if cluster.mutual else 0)  # type: ignore[attr-defined]
