"""``kvswitch health``: ask a router or worker whether it serves, through the standard gRPC health
service (``grpc.health.v1.Health/Check``): exit 0 when it answers SERVING, 1 otherwise (not
serving, unreachable, or no answer within ``--timeout-s``). What container healthchecks and
scripts run; it prints the status on one line.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import grpc

SERVICES = ("", "kvswitch.v1.Router", "kvswitch.v1.Worker")


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    target: str = "127.0.0.1:50051"
    service: str = ""  # empty: the server as a whole
    timeout_s: float = 2.0
    # A server that listens with TLS: the CA that verifies it, and (mutual TLS) the certificate
    # this probe presents.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.service not in SERVICES:
            raise ValueError(
                f"service must be empty or one of {', '.join(SERVICES[1:])}, got {self.service!r}"
            )


def run(config: HealthConfig) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _channel(config) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=config.service), timeout=config.timeout_s
            )
        except grpc.RpcError as e:
            print(f"{config.target}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{config.target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _channel(config: HealthConfig) -> grpc.Channel:
    if not (config.tls_ca or config.tls_cert):
        return grpc.insecure_channel(config.target)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(config.tls_ca).read_bytes() if config.tls_ca else None,
        private_key=Path(config.tls_key).read_bytes() if config.tls_key else None,
        certificate_chain=Path(config.tls_cert).read_bytes() if config.tls_cert else None,
    )
    return grpc.secure_channel(config.target, credentials)
