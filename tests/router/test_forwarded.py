"""Who a call from the router's HTTP front stands for: believed only next to the front's key,
and named as the servicer names a gRPC peer at the same address."""

from __future__ import annotations

from kvswitch.router.forwarded import (
    FORWARDED_CLIENT_HEADER,
    FRONT_KEY_HEADER,
    forwarded_client,
    http_client,
    new_front_key,
)
from kvswitch.router.limits import client_of


def test_the_named_client_is_believed_only_next_to_the_key() -> None:
    key = new_front_key()
    named = (FORWARDED_CLIENT_HEADER, "ipv4:10.0.0.7")
    assert forwarded_client([(FRONT_KEY_HEADER, key), named], key) == "ipv4:10.0.0.7"
    assert forwarded_client([(FRONT_KEY_HEADER, key[:-1] + "x"), named], key) is None
    assert forwarded_client([named], key) is None
    assert forwarded_client([(FRONT_KEY_HEADER, ""), named], "") is None  # no front at all
    assert forwarded_client(None, key) is None
    assert new_front_key() != key


def test_an_http_client_is_named_as_a_grpc_peer_at_its_address() -> None:
    assert http_client("10.0.0.7") == client_of("ipv4:10.0.0.7:51234") == "ipv4:10.0.0.7"
    assert http_client("::1") == client_of("ipv6:[::1]:51234") == "ipv6:[::1]"
    assert http_client("/run/front.sock") == "/run/front.sock"
