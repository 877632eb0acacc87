"""One scripted router for the client tests, served over real gRPC on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.client.scripted_router import BackgroundRouter, ScriptedRouter


@pytest.fixture(scope="session")
def _background_router() -> Iterator[BackgroundRouter]:
    background = BackgroundRouter()
    yield background
    background.close()


@pytest.fixture
def router(_background_router: BackgroundRouter) -> ScriptedRouter:
    """The router with the default script (three chunks, then the final) and no calls yet."""
    return _background_router.reset()
