"""The multi-host tests' hosts (``kvswitch.deploy.netns``), or the test skipped where network
namespaces cannot be made."""

from __future__ import annotations

import pytest

from kvswitch.deploy.netns import NetnsHosts, NetnsUnavailable

__all__ = ["NetnsHosts", "hosts_or_skip"]


def hosts_or_skip() -> NetnsHosts:
    """New hosts, or the test skipped, saying why, where namespaces cannot be made."""
    try:
        return NetnsHosts()
    except NetnsUnavailable as e:
        pytest.skip(f"{e}: the multi-host test needs network namespaces (root)")
