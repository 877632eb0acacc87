"""How the clients reach the router: transport security, the bearer token and deadlines."""

from __future__ import annotations

import math
import os
from pathlib import Path

import grpc

# None or False = plaintext; True = TLS with the system's root certificates; a path = TLS
# trusting the CA certificates in that PEM file; or credentials built with grpc directly.
TlsOption = bool | str | os.PathLike[str] | grpc.ChannelCredentials | None


def channel_credentials(tls: TlsOption) -> grpc.ChannelCredentials | None:
    """The credentials for a secure channel, or None for plaintext."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    if isinstance(tls, str | os.PathLike):
        return grpc.ssl_channel_credentials(root_certificates=Path(tls).read_bytes())
    raise TypeError(
        "tls must be None, a bool, a path to a PEM CA bundle or grpc.ChannelCredentials, "
        f"got {type(tls).__name__}"
    )


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata sent with every call: the token as ``authorization: Bearer <token>``."""
    if token is None:
        return ()
    if not token:
        raise ValueError("token is empty; pass None to send none")
    return (("authorization", f"Bearer {token}"),)


def check_timeout_s(timeout_s: float | None) -> float | None:
    """``timeout_s`` itself, once it is known to be None or a positive number of seconds."""
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
    return timeout_s
