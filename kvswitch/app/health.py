"""``kvswitch health``: ask a router or worker whether it serves, through the standard gRPC health
service (``grpc.health.v1.Health/Check``): exit 0 when it answers SERVING, 1 otherwise (not
serving, unreachable, or no answer within ``--timeout-s``). What container healthchecks and
scripts run; it prints the status on one line.
"""

from __future__ import annotations

import dataclasses
import sys

import grpc

SERVICES = ("", "kvswitch.v1.Router", "kvswitch.v1.Worker")


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    target: str = "127.0.0.1:50051"
    service: str = ""  # empty: the server as a whole
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.service not in SERVICES:
            raise ValueError(
                f"service must be empty or one of {', '.join(SERVICES[1:])}, got {self.service!r}"
            )


def run(config: HealthConfig) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(config.target) as channel:
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
