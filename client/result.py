"""What a request gives back: streamed ``Chunk``s, then one ``GenerateResult``.

``ResultBuilder`` turns the router's ``GenerateResponse`` messages into these types and checks
that the stream keeps the protocol (chunks, then exactly one final message, then nothing).
"""

from __future__ import annotations

import dataclasses
import enum

import grpc

from kvswitch.client.errors import KvswitchError
from kvswitch.v1 import common_pb2, router_pb2


class FinishReason(enum.StrEnum):
    """Why generation ended."""

    STOP = "stop"  # an EOS or stop token was produced
    LENGTH = "length"  # max_tokens or the context length was reached
    ABORT = "abort"  # cancelled or aborted by the server
    ERROR = "error"  # failed on the server


_FINISH_REASON_FROM_PROTO = {
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
    common_pb2.FINISH_REASON_ERROR: FinishReason.ERROR,
}


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A token's log-probability under the model, and the most likely tokens at its position
    with theirs, most likely first."""

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """Newly generated tokens and their text (empty while a multi-byte character is incomplete).
    With ``logprobs`` asked, one entry per token; the first chunk carries the prompt's logprobs
    and embedding when they were asked."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    embedding: list[float] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Stats:
    """Accounting from the worker that served the request."""

    worker_id: str
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    ttft_s: float  # time to first token, measured on the worker
    num_output_tokens: int
    route_reason: str = ""  # why the router chose the worker (also ``GenerateResult.route``)
    # Disaggregated prefill: the worker that computed the prompt and the one that decoded the
    # rest, and how many KV blocks moved between them. Both ids are ``worker_id`` when one
    # worker served the whole request.
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    num_transferred_blocks: int = 0

    # The short names the client API documents, for the counts above.
    @property
    def prompt_tokens(self) -> int:
        return self.num_prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.num_cached_tokens

    @property
    def output_tokens(self) -> int:
        return self.num_output_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class RouteInfo:
    """Where the router sent the request, and why."""

    worker_id: str
    policy: str
    reason: str  # a short explanation, e.g. "longest prefix match"
    num_matched_blocks: int  # leading prompt blocks the index believed the worker held
    score: float  # the worker's score under the policy (unitless)


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateResult:
    """A finished request: all its output tokens and text, and how it was served."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: Stats
    route: RouteInfo
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # one per prompt token but the first
    embedding: list[float] | None = None


class ResultBuilder:
    """Collects one stream's messages into chunks and, at its final message, a result."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.num_messages = 0
        self.result: GenerateResult | None = None
        self._token_ids: list[int] = []
        self._texts: list[str] = []
        self._logprobs: list[TokenLogprobs] = []
        self._prompt_logprobs: list[TokenLogprobs] | None = None
        self._embedding: list[float] | None = None

    def add(self, response: router_pb2.GenerateResponse) -> Chunk | None:
        """The chunk a message carries, or None for the final message (which sets ``result``)."""
        self.num_messages += 1
        if self.result is not None:
            raise self._protocol_error("the router sent a message after the final one")
        kind = response.WhichOneof("kind")
        if kind == "chunk":
            message = response.chunk
            chunk = Chunk(token_ids=list(message.token_ids), text=message.text)
            if message.HasField("logprobs"):
                chunk = dataclasses.replace(chunk, logprobs=_logprobs(message.logprobs))
                self._logprobs += chunk.logprobs
            if message.HasField("prompt_logprobs"):
                self._prompt_logprobs = _logprobs(message.prompt_logprobs)
                chunk = dataclasses.replace(chunk, prompt_logprobs=self._prompt_logprobs)
            if message.embedding:
                self._embedding = list(message.embedding)
                chunk = dataclasses.replace(chunk, embedding=self._embedding)
            self._token_ids.extend(chunk.token_ids)
            self._texts.append(chunk.text)
            return chunk
        if kind == "final":
            self.result = self._result(response.final)
            return None
        raise self._protocol_error("the router sent a message with neither chunk nor final")

    def finish(self) -> GenerateResult:
        """The result, once the stream has ended; an error if it ended without a final message."""
        if self.result is None:
            raise self._protocol_error("the stream ended without a final message")
        return self.result

    def _result(self, final: router_pb2.GenerateFinal) -> GenerateResult:
        finish_reason = _FINISH_REASON_FROM_PROTO.get(final.finish_reason)
        if finish_reason is None:
            raise self._protocol_error(
                f"the router sent finish reason {final.finish_reason}, "
                "which is none of stop, length, abort and error"
            )
        stats, route = final.stats, final.route
        return GenerateResult(
            request_id=self.request_id,
            token_ids=list(self._token_ids),
            text="".join(self._texts),
            finish_reason=finish_reason,
            stats=Stats(
                worker_id=stats.worker_id,
                num_prompt_tokens=stats.num_prompt_tokens,
                num_cached_tokens=stats.num_cached_tokens,
                ttft_s=stats.ttft_s,
                num_output_tokens=stats.num_output_tokens,
                prefill_worker_id=stats.prefill_worker_id or stats.worker_id,
                decode_worker_id=stats.decode_worker_id or stats.worker_id,
                num_transferred_blocks=stats.num_transferred_blocks,
                route_reason=route.reason,
            ),
            route=RouteInfo(
                worker_id=route.worker_id,
                policy=route.policy,
                reason=route.reason,
                num_matched_blocks=route.num_matched_blocks,
                score=route.score,
            ),
            logprobs=self._logprobs or None,
            prompt_logprobs=self._prompt_logprobs,
            embedding=self._embedding,
        )

    def _protocol_error(self, details: str) -> KvswitchError:
        # NOTE: a broken stream is the server's fault, like gRPC's own INTERNAL errors.
        return KvswitchError(grpc.StatusCode.INTERNAL, details, self.request_id)


def _logprobs(run: common_pb2.TokenLogprobs) -> list[TokenLogprobs]:
    """One entry per token of a run's columns."""
    num_top = run.num_top
    ids, values = run.top_token_ids, run.top_logprobs
    return [
        TokenLogprobs(
            logprob,
            tuple(ids[i * num_top : (i + 1) * num_top]),
            tuple(values[i * num_top : (i + 1) * num_top]),
        )
        for i, logprob in enumerate(run.logprobs)
    ]
