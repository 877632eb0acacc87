"""The port helpers the local servers and the benchmarks start on."""

from __future__ import annotations

import socket

from kvswitch.cache_index.local_redis import free_ports


def test_free_ports_are_as_many_distinct_ports_nobody_listens_on() -> None:
    # NOTE: 300 asked one after another: some port comes twice far more often than not.
    ports = free_ports(300)
    assert len(set(ports)) == 300
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
