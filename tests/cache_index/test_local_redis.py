"""The port helpers the local servers and the benchmarks start on."""

from __future__ import annotations

from kvswitch.cache_index.local_redis import free_ports


def test_free_ports_are_as_many_distinct_ports() -> None:
    # NOTE: 300 asked one after another: some port comes twice far more often than not.
    # (Whether each is still free when used is a race no test can pin.)
    ports = free_ports(300)
    assert len(set(ports)) == 300
    assert all(1024 <= port < 65536 for port in ports)
