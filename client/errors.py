"""The errors the client raises: a failed request keeps its gRPC status code and details."""

from __future__ import annotations

import grpc


class KvswitchError(Exception):
    """A request failed. ``code`` is the gRPC status code, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str, request_id: str) -> None:
        # A worker's message may start with the request id too; once is enough.
        message = details.removeprefix(f"request {request_id}: ")
        super().__init__(f"request {request_id} failed with {code.name}: {message}")
        self.code = code
        self.details = details
        self.request_id = request_id


class KvswitchTimeoutError(KvswitchError):
    """A request ran past its deadline; ``code`` is always ``DEADLINE_EXCEEDED``."""

    def __init__(self, details: str, request_id: str) -> None:
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED, details, request_id)


def error_from_rpc(error: grpc.RpcError, request_id: str) -> KvswitchError:
    """The client error for a failed call (``grpc.RpcError`` or ``grpc.aio.AioRpcError``)."""
    # Both the sync call objects and AioRpcError carry code() and details().
    code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
    details: str = error.details() or ""  # type: ignore[attr-defined]
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return KvswitchTimeoutError(details, request_id)
    return KvswitchError(code, details, request_id)
