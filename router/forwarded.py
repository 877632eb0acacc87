"""Which client a call from the router's own HTTP front stands for.

The OpenAI-compatible front (``router/openai_http.py``) turns each HTTP request into a call to
this router's ``kvswitch.v1.Router`` service over a loopback channel, so every call of it comes
from one peer address. To count open streams per HTTP client, as for gRPC clients, the front
names the client in the call's metadata, along with a key made fresh for each router process::

    HTTP client 10.0.0.7 --POST--> front --Generate + (front key, "ipv4:10.0.0.7")--> servicer

The servicer believes the name only next to the right key: a client that sends these headers
itself is counted by its own address. No I/O here.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from typing import Any

FRONT_KEY_HEADER = "kvswitch-front-key"
FORWARDED_CLIENT_HEADER = "kvswitch-forwarded-client"
FORWARDED_TENANT_HEADER = "kvswitch-forwarded-tenant"  # the tenant (router/tenants.py)


def new_front_key() -> str:
    """A key for one router process's front; it never leaves the process."""
    return secrets.token_urlsafe(32)


def forwarded_client(
    metadata: Any, front_key: str, header: str = FORWARDED_CLIENT_HEADER
) -> str | None:
    """The client (or with ``header`` FORWARDED_TENANT_HEADER, the tenant) named by a call from
    the front that holds ``front_key``; None for any other call (no key, a wrong one, or no
    front at all: ``front_key`` empty)."""
    if not front_key:
        return None
    values = dict(metadata or ())
    sent = values.get(FRONT_KEY_HEADER)
    # NOTE: compared in constant time, as tokens are: timing says nothing of the key.
    if not isinstance(sent, str) or not hmac.compare_digest(sent.encode(), front_key.encode()):
        return None
    client = values.get(header)
    return client if isinstance(client, str) and client else None


def http_client(host: str) -> str:
    """The name of an HTTP client at ``host``, spelled as ``limits.client_of`` names a gRPC peer
    at the same address (``ipv4:10.0.0.7``, ``ipv6:[::1]``), so that both count as one client."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host  # a Unix socket's path, or whatever the server reported
    if address.version == 6:
        return f"ipv6:[{address.compressed}]"
    return f"ipv4:{address.compressed}"
