"""A load test's requests over a router's OpenAI-compatible HTTP API (``--target
http://HOST:PORT``), as a fleet of OpenAI-API engines is reached (docs/ENGINES.md).

``OpenAITarget`` offers what the runner takes of the gRPC client (``stream``, ``target``,
``wait_until_connected``): each request a streamed ``/v1/completions`` of token ids with vLLM's
``return_token_ids`` (a session's next turn holds the answer's tokens), the phase's cache salt and
routing policy, and ``stream_options.include_usage`` for the cached tokens; the engine that served
it from the ``x-kvswitch-worker`` header.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx2

from kvswitch.security import TOKEN_ENV


class TargetError(Exception):
    """A request the HTTP API refused or cut off; ``reason`` is the record's error."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class Chunk:
    token_ids: list[int]


@dataclass
class _Stats:
    num_cached_tokens: int = 0
    worker_id: str = ""


@dataclass
class _Result:
    stats: _Stats = field(default_factory=_Stats)


class _Stream:
    def __init__(self, response: httpx2.Response) -> None:
        self._response = response
        self.result = _Result(_Stats(worker_id=response.headers.get("x-kvswitch-worker", "")))

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        async for line in self._response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                return
            body = json.loads(data)
            if "error" in body:
                raise TargetError("STREAM_ERROR", str(body["error"].get("message", "")))
            usage = body.get("usage")
            if usage:
                details = usage.get("prompt_tokens_details") or {}
                self.result.stats.num_cached_tokens = details.get("cached_tokens") or 0
            for choice in body.get("choices") or ():
                if choice.get("token_ids"):
                    yield Chunk(list(choice["token_ids"]))
        raise TargetError("STREAM_CUT", "the stream ended without [DONE]")


class OpenAITarget:
    """A router's HTTP API at ``url`` (``http://HOST:PORT``), serving ``model`` (empty: the
    first one its ``/v1/models`` lists)."""

    def __init__(self, url: str, model: str = "") -> None:
        self.target = url.rstrip("/").removesuffix("/v1")
        self.model = model
        headers = {}
        if token := os.environ.get(TOKEN_ENV):
            headers["authorization"] = f"Bearer {token}"
        self._client = httpx2.AsyncClient(
            base_url=self.target,
            headers=headers,
            timeout=httpx2.Timeout(None, connect=10.0),
            limits=httpx2.Limits(max_connections=None),
        )

    async def __aenter__(self) -> OpenAITarget:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def wait_until_connected(self, timeout_s: float) -> None:
        """Until ``/v1/models`` answers (learning the model where none was given);
        ConnectionError after ``timeout_s``."""
        deadline_s = time.monotonic() + timeout_s
        while True:
            try:
                response = await self._client.get("/v1/models", timeout=timeout_s)
                if response.status_code == 200:
                    models = [m["id"] for m in response.json().get("data", [])]
                    if not self.model and models:
                        self.model = models[0]
                    if self.model:
                        return
            except httpx2.HTTPError:
                pass
            if time.monotonic() > deadline_s:
                raise ConnectionError(f"{self.target}/v1/models did not answer with a model")
            await asyncio.sleep(0.1)

    @asynccontextmanager
    async def stream(
        self,
        *,
        prompt_token_ids: list[int],
        max_tokens: int,
        cache_salt: str,
        policy: str | None,
        timeout_s: float,
        prompt_logprobs: int | None = None,
    ) -> AsyncIterator[_Stream]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_token_ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "cache_salt": cache_salt,
        }
        if policy:
            body["routing"] = {"policy": policy}
        if prompt_logprobs is not None:  # the prompt scored: its logprobs, echoed
            body |= {"echo": True, "logprobs": prompt_logprobs}
        try:
            async with asyncio.timeout(timeout_s):
                async with self._client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        detail = (await response.aread()).decode(errors="replace")[:200]
                        raise TargetError(f"HTTP_{response.status_code}", detail)
                    yield _Stream(response)
        except TimeoutError:
            raise TargetError("DEADLINE_EXCEEDED") from None
        except httpx2.HTTPError as e:
            raise TargetError("UNAVAILABLE", str(e)) from None
