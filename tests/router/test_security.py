"""TLS, mutual TLS and bearer tokens on every gRPC hop: client -> router -> worker -> peer worker,
and worker -> the router's embedded index. A throwaway CA signs every certificate."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx2
import pytest

from kvswitch.app import cli, generate, health
from kvswitch.app.cli_args import config_from_args, tokens_from_env
from kvswitch.cache_index.audit import audit
from kvswitch.cache_index.grpc_index import GrpcIndex
from kvswitch.cache_index.index import WorkerInfo
from kvswitch.client import Client, KvswitchError
from kvswitch.deploy.local import ClusterConfig, running
from kvswitch.router.server import RouterConfig
from kvswitch.security import API_KEYS_ENV, FLEET_TOKEN_ENV, FleetSecurity, is_loopback
from kvswitch.serving import start_server_process
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


# -- secure by default: who may listen where, and on what terms -------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LocalHost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.5", False),
        ("router.internal", False),
        ("localhost.example.com", False),
    ],
)
def test_loopback_is_127_8_1_and_localhost_only(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def kvswitch_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvswitch.app.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("command", ["router", "worker"])
def test_a_server_beyond_loopback_without_credentials_refuses_to_start(command: str) -> None:
    env = {FLEET_TOKEN_ENV: ""}
    refused = kvswitch_cli(command, "--host", "0.0.0.0", "--port", "0", env=env)
    assert refused.returncode != 0
    message = " ".join(refused.stderr.split())
    assert f"the {command} would listen on 0.0.0.0:0" in message
    for way_out in ("--fleet-token", FLEET_TOKEN_ENV, "--tls-client-auth", "--insecure"):
        assert way_out in message
    assert "listening on" not in refused.stdout


def test_the_http_api_beyond_loopback_needs_api_keys() -> None:
    fleet_only = {"host": "0.0.0.0", "fleet_token": FLEET_TOKEN, "http_port": 0}
    with pytest.raises(ValueError, match=r"the router's HTTP API would listen on 0\.0\.0\.0:0"):
        RouterConfig(**fleet_only)
    # Keys, the client token in their place, or --insecure, and it may.
    RouterConfig(**fleet_only, api_key="k1")
    RouterConfig(**fleet_only, token=CLIENT_TOKEN)
    RouterConfig(**fleet_only, insecure=True)
    with pytest.raises(ValueError, match="api_key is for the HTTP API"):
        RouterConfig(api_key="k1")


def test_an_insecure_router_and_worker_start_beyond_loopback() -> None:
    router, address = start_server_process(
        ["router", "--host", "0.0.0.0", "--port", "0", "--insecure"]
    )
    try:
        worker, _ = start_server_process(
            [
                "worker", "--host", "0.0.0.0", "--port", "0", "--insecure",
                "--index", f"grpc://127.0.0.1:{address.rsplit(':', 1)[1]}",
            ]
        )  # fmt: skip
        try:
            target = f"127.0.0.1:{address.rsplit(':', 1)[1]}"
            with Client(target) as client:
                assert len(client.generate(prompt_token_ids=[256, 65], max_tokens=2).token_ids) == 2
        finally:
            worker.terminate()
            worker.wait(timeout=30)
    finally:
        router.terminate()
        router.wait(timeout=30)


def test_a_router_with_the_fleet_token_starts_beyond_loopback() -> None:
    config = dataclasses.replace(
        ROUTER_CONFIG, host="0.0.0.0", fleet_token=FLEET_TOKEN, http_port=0, api_key="k1"
    )
    with BackgroundCluster(0, config, WORKER_CONFIG) as cluster:
        assert cluster.address.startswith("0.0.0.0:")
        assert cluster.router.http_address is not None


def test_kvswitch_up_on_loopback_needs_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FLEET_TOKEN_ENV, raising=False)
    with (
        running(ClusterConfig(workers=1, port=0, grace_s=0.0)) as cluster,
        Client(cluster.address) as client,
    ):
        assert len(client.generate(prompt_token_ids=[256, 65], max_tokens=2).token_ids) == 2


# -- the HTTP API: API keys and the body limit ------------------------------------------------


@pytest.fixture(scope="module")
def keyed() -> Iterator[BackgroundCluster]:
    """A router whose HTTP API takes two keys, and whose gRPC API takes the client token."""
    router = dataclasses.replace(
        ROUTER_CONFIG,
        http_port=0,
        api_key="key-one, key-two",
        token=CLIENT_TOKEN,
        max_body_bytes=4096,
    )
    worker = dataclasses.replace(WORKER_CONFIG, engine_in_process=True)
    with BackgroundCluster(1, router, worker) as cluster:
        yield cluster


def http(cluster: BackgroundCluster, key: str | None) -> httpx2.Client:
    front = cluster.router.http_front
    assert front is not None
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    return httpx2.Client(base_url=front.url, headers=headers, timeout=30)


COMPLETION = {"model": "kvswitch-tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}


def test_the_http_api_takes_its_api_keys_and_nothing_else(keyed: BackgroundCluster) -> None:
    for key in (None, "wrong", CLIENT_TOKEN, "key-one,key-two"):
        with http(keyed, key) as client:
            for response in (client.get("/models"), client.post("/completions", json=COMPLETION)):
                assert response.status_code == 401, (key, response.text)
                error = response.json()["error"]
                assert error["code"] == "invalid_api_key"
                assert set(error) == {"message", "type", "param", "code"}
                assert response.headers["www-authenticate"] == "Bearer"
    for key in ("key-one", "key-two"):
        with http(keyed, key) as client:
            assert client.get("/models").json()["data"][0]["id"] == "kvswitch-tiny"
            completion = client.post("/completions", json=COMPLETION)
            assert completion.status_code == 200, completion.text
            assert completion.json()["usage"]["completion_tokens"] == 2
    # An API key does not open the gRPC API: that takes the client token.
    with Client(keyed.address, token="key-one") as client, pytest.raises(KvswitchError) as error:
        client.generate(prompt_token_ids=[256, 65], max_tokens=1)
    assert error.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_body_past_the_limit_is_413_declared_or_streamed(keyed: BackgroundCluster) -> None:
    prompt_of = {"fits": "x" * 3000, "too_large": "x" * 5000}
    with http(keyed, "key-one") as client:
        fits = client.post("/completions", json={**COMPLETION, "prompt": prompt_of["fits"]})
        assert fits.status_code == 200, fits.text
        too_large = json.dumps({**COMPLETION, "prompt": prompt_of["too_large"]}).encode()
        declared = client.post("/completions", content=too_large)

        def chunks() -> Iterator[bytes]:  # no content-length: read until past the limit
            yield from (too_large[i : i + 1024] for i in range(0, len(too_large), 1024))

        streamed = client.post("/completions", content=chunks())
    for response in (declared, streamed):
        assert response.status_code == 413
        assert "larger than the 4096 bytes this router takes" in response.json()["error"]["message"]


def test_api_keys_come_from_the_environment_for_a_router_serving_http(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(API_KEYS_ENV, "from-env-1,from-env-2")
    parser = cli.build_parser("router")

    def config(*args: str) -> RouterConfig:
        return config_from_args(RouterConfig, tokens_from_env(parser.parse_args(args)))

    assert config("router", "--http-port", "0").http_keys() == ("from-env-1", "from-env-2")
    assert config("router", "--http-port", "0", "--api-key", "k").http_keys() == ("k",)
    # A router without the HTTP API leaves them: an environment set for a fleet is no error.
    assert config("router").api_key == ""


# -- routing overrides, when the operator turns them off -------------------------------------


def test_routing_overrides_are_refused_when_turned_off() -> None:
    router = dataclasses.replace(ROUTER_CONFIG, request_overrides=False, http_port=0)
    worker = dataclasses.replace(WORKER_CONFIG, engine_in_process=True)
    with BackgroundCluster(1, router, worker) as cluster, Client(cluster.address) as client:
        assert len(client.generate(prompt_token_ids=[256, 65], max_tokens=1).token_ids) == 1
        for overrides in ({"policy": "round_robin"}, {"weights": {"prefill_weight": 0.0}}):
            with pytest.raises(KvswitchError) as error:
                client.generate(prompt_token_ids=[256, 65], max_tokens=1, **overrides)
            assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "takes no per-request routing overrides" in str(error.value)
        with http(cluster, None) as front:
            body = {**COMPLETION, "routing": {"policy": "random"}}
            refused = front.post("/completions", json=body)
        assert refused.status_code == 400
        assert "--no-request-overrides" in refused.json()["error"]["message"]
