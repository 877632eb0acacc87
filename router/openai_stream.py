"""One router call as the HTTP front reads it: its text, cut at stop strings, and how it ended
(``RouterOutput``); the server-sent events of a stream (``events``); and a wait that ends when
the HTTP client goes away (``until_disconnected``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from fastapi import Request

from kvswitch.router.openai_logprobs import LogprobColumns
from kvswitch.router.openai_protocol import OpenAIError, Reply, Usage, error_from_status
from kvswitch.router.stop_strings import StopStrings
from kvswitch.v1 import common_pb2, router_pb2

T = TypeVar("T")

_FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


class RouterOutput:
    """One router call's output: its text, cut at the request's stop strings, and its end."""

    def __init__(
        self,
        rpc: grpc.aio.UnaryStreamCall,
        stops: StopStrings | None,
        prompt_param: str,
        count_prompt: Callable[[], Awaitable[int]],
        *,
        keep_output: bool = True,
    ) -> None:
        """``keep_output`` False: the output is not the client's (a prompt scored with
        ``max_tokens`` 0 still samples one token); only the prompt's logprobs are."""
        self._rpc = rpc
        self._stops = stops
        self._prompt_param = prompt_param
        self._count_prompt = count_prompt
        self._keep_output = keep_output
        self.num_output_tokens = 0
        self.token_ids: list[int] = []  # of the messages read so far
        self.logprobs = LogprobColumns()  # of token_ids, when asked
        self.prompt_logprobs = LogprobColumns()  # from the first chunk
        self.embedding: list[float] = []  # from the first chunk
        self.num_cached_tokens: int | None = None  # from the first chunk
        self.final: router_pb2.GenerateFinal | None = None
        self.done = False

    async def first(self) -> str:
        """The text of the first message; raises ``OpenAIError`` if the call failed."""
        return await self._next()

    async def rest(self) -> AsyncIterator[tuple[str, slice]]:
        """The text of the messages after the first, and the span of ``token_ids`` (and of
        ``logprobs``, when asked) it came with, until ``done``."""
        while not self.done:
            num_read = len(self.token_ids)
            text = await self._next()
            if text or len(self.token_ids) > num_read:
                yield text, slice(num_read, len(self.token_ids))

    async def read_all(self) -> str:
        pieces = [await self.first()]
        pieces += [text async for text, _ in self.rest()]
        return "".join(pieces)

    async def ending(self) -> tuple[str, Usage]:
        """Why the output ended, and the usage; once ``done``."""
        if self._stops is not None and self._stops.stopped:
            # NOTE: cancelled at the stop string, the call never sent its final message: the
            # prompt is counted here, and how much of it was cached came with the first chunk.
            num_prompt_tokens = await self._count_prompt()
            usage = Usage(num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)
            return "stop", usage
        final = self.final
        assert final is not None
        finish_reason = _FINISH_REASONS.get(final.finish_reason)
        if finish_reason is None:
            name = common_pb2.FinishReason.Name(final.finish_reason)
            raise OpenAIError(500, f"the request ended with {name}", code="server_error")
        stats = final.stats
        num_output_tokens = stats.num_output_tokens if self._keep_output else 0
        usage = Usage(stats.num_prompt_tokens, num_output_tokens, stats.num_cached_tokens)
        return finish_reason, usage

    def cancel(self) -> None:
        """Cancel the call, if it still runs."""
        self._rpc.cancel()

    async def _next(self) -> str:
        try:
            message = await self._rpc.read()
        except grpc.aio.AioRpcError as e:
            self.done = True
            raise error_from_status(
                e.code(), e.details() or "", e.trailing_metadata(), self._prompt_param
            ) from None
        if message is grpc.aio.EOF:
            self.done = True
            if self.final is None:
                raise OpenAIError(500, "the router's stream ended without its final message")
            return self._stops.flush() if self._stops is not None else ""
        if message.HasField("final"):
            self.final = message.final
            return ""
        chunk = message.chunk
        if chunk.HasField("num_cached_tokens"):
            self.num_cached_tokens = chunk.num_cached_tokens
            self.prompt_logprobs.extend(chunk.prompt_logprobs)
            self.embedding = list(chunk.embedding)
        if not self._keep_output:
            return ""
        self.num_output_tokens += len(chunk.token_ids)
        self.token_ids += chunk.token_ids
        self.logprobs.extend(chunk.logprobs)
        if self._stops is None:
            return chunk.text
        text = self._stops.push(chunk.text)
        if self._stops.stopped:
            self.done = True
            self._rpc.cancel()  # the worker stops generating what nobody will read
        return text


async def events(
    reply: Reply,
    output: RouterOutput,
    first: str,
    include_usage: bool,
    logprobs: Callable[[slice], dict[str, Any] | None] = lambda span: None,
) -> AsyncIterator[bytes]:
    """The server-sent events of a stream whose first message has come (its text ``first``);
    ``logprobs(span)``: a chunk's, of the output tokens ``output.token_ids[span]``."""
    try:
        if reply.chat:
            yield _event(reply.first_chat_chunk(usage=include_usage))
        # NOTE: a chunk of tokens without text (a character still incomplete) goes out only
        # where the client asked for the tokens, or their logprobs.
        span = slice(0, len(output.token_ids))
        shown = logprobs(span)
        if first or (reply.token_ids and output.token_ids) or shown is not None:
            yield _event(
                reply.chunk(
                    first,
                    usage=include_usage,
                    token_ids=output.token_ids,
                    logprobs=shown,
                )
            )
        async for text, span in output.rest():
            shown = logprobs(span)
            if text or reply.token_ids or shown is not None:
                yield _event(
                    reply.chunk(
                        text,
                        usage=include_usage,
                        token_ids=output.token_ids[span],
                        logprobs=shown,
                    )
                )
        finish_reason, usage = await output.ending()
        yield _event(reply.chunk("", finish_reason, usage=include_usage))
        if include_usage:
            yield _event(reply.usage_chunk(usage))
    except OpenAIError as e:
        # NOTE: the status line went out with the first event; the error goes as an event of its
        # own, which OpenAI's clients raise.
        yield _event(e.body())
    finally:
        output.cancel()
    yield b"data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> bytes:
    return (
        b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled if the HTTP client goes away first (its request cancelled on
    the router with it)."""
    current = asyncio.current_task()
    assert current is not None
    waiting = True
    gone = False

    def on_disconnect(watcher: asyncio.Task[None]) -> None:
        nonlocal gone
        # NOTE: run by the loop after the watcher ends, maybe after ``work`` ended too.
        if waiting and not watcher.cancelled():
            gone = True
            current.cancel()

    # NOTE: ``work`` runs in this task, one watcher beside it: no task of its own to wait on.
    watcher = asyncio.ensure_future(_disconnected(request))
    watcher.add_done_callback(on_disconnect)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        current.uncancel()
        # NOTE: an answer nobody will read; the server drops it.
        raise OpenAIError(499, "the client closed the connection", code="client_closed") from None
    finally:
        waiting = False
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    # NOTE: the body is read already: the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
