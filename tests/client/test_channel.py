"""Transport options: TLS credentials, the bearer token, timeouts."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvswitch.client.channel import call_metadata, channel_credentials, check_timeout_s


def test_tls_options(tmp_path: Path) -> None:
    assert channel_credentials(None) is None
    assert channel_credentials(False) is None
    assert isinstance(channel_credentials(True), grpc.ChannelCredentials)
    given = grpc.ssl_channel_credentials()
    assert channel_credentials(given) is given
    with pytest.raises(FileNotFoundError):
        channel_credentials(tmp_path / "missing.pem")
    with pytest.raises(TypeError, match="tls must be None, a bool, a path"):
        channel_credentials(443)  # type: ignore[arg-type]


def test_token_metadata() -> None:
    assert call_metadata(None) == ()
    assert call_metadata("abc") == (("authorization", "Bearer abc"),)
    with pytest.raises(ValueError, match="token is empty"):
        call_metadata("")


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("inf"), float("nan")])
def test_bad_timeouts(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        check_timeout_s(timeout_s)
