"""The OpenAI API's shapes, as the HTTP front (``router/openai_http.py``) takes and gives them.

Requests are pydantic models that refuse what kvswitch cannot do rather than ignore it: an
unknown field, several prompts or choices, penalties, tools. Each refusal is
an ``OpenAIError`` naming the parameter (HTTP 400). Responses are built as plain dicts. The
error for a failed router call maps its gRPC status to an HTTP one (``error_from_status``).
No I/O here.
"""

from __future__ import annotations

import base64
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import grpc
import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvswitch.serving import retry_after_ms

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's top_logprobs)
POOLINGS = ("last", "mean")
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request
# The roles a chat message may have; OpenAI's "tool" and "function" answer tool calls, which
# kvswitch never makes.
CHAT_ROLES = ("system", "developer", "user", "assistant")
_UINT32_MAX = (1 << 32) - 1
_UINT64_MAX = (1 << 64) - 1


class OpenAIError(Exception):
    """A request answered with an HTTP error in OpenAI's shape:
    ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


# -- requests ------------------------------------------------------------------------------------


def _only(*allowed: object) -> AfterValidator:
    """A field kvswitch takes only at these values (OpenAI's defaults): others are refused,
    never ignored."""

    def check(value: object) -> object:
        if value not in allowed:
            shown = " or ".join("null" if a is None else repr(a) for a in allowed)
            raise ValueError(f"kvswitch takes this parameter only as {shown}")
        return value

    return AfterValidator(check)


def _null_is(default: object) -> BeforeValidator:
    """A field that OpenAI's API takes as null too, meaning its default."""
    return BeforeValidator(lambda value: default if value is None else value)


def _priority(value: Any) -> Any:
    if value is None or value in ("interactive", "batch"):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return "batch" if value > 0 else "interactive"  # vLLM's: lower starts earlier
    raise ValueError("must be 'interactive', 'batch' or an integer (above 0: batch)")


# A request's priority class ("interactive", the default, or "batch"); vLLM's integer priority is
# taken too, 0 or below as interactive.
Priority = Annotated[str | None, BeforeValidator(_priority)]


class _Strict(BaseModel):
    # NOTE: strict: "max_tokens": "5" is an error, as on OpenAI, not 5.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class LoadLoraAdapterRequest(_Strict):
    """``POST /v1/load_lora_adapter``, as vLLM names its fields."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)  # a PEFT adapter's folder, on every worker's host


class UnloadLoraAdapterRequest(_Strict):
    """``POST /v1/unload_lora_adapter``."""

    lora_name: str = Field(min_length=1)


class StreamOptions(_Strict):
    include_usage: bool | None = None  # a last chunk with the usage, and no choices


class RoutingOptions(_Strict):
    """kvswitch's own: ``RoutingOverrides`` of the gRPC request."""

    policy: str = ""
    weights: dict[str, float] = Field(default_factory=dict)


class _GenerateRequest(_Strict):
    """What completions and chat requests share."""

    model: str
    stream: Annotated[bool, _null_is(False)] = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=_UINT32_MAX)
    temperature: Annotated[float, _null_is(1.0), Field(ge=0)] = 1.0  # OpenAI's; 0 = greedy
    top_p: Annotated[float, _null_is(1.0), Field(gt=0, le=1)] = 1.0
    seed: int | None = Field(default=None, ge=0, le=_UINT64_MAX)
    stop: str | list[str] | None = None
    user: str | None = None  # OpenAI's end-user id for abuse monitoring; kvswitch has no use
    n: Annotated[int, _null_is(1), _only(1)] = 1
    presence_penalty: Annotated[float, _null_is(0.0), _only(0)] = 0.0
    frequency_penalty: Annotated[float, _null_is(0.0), _only(0)] = 0.0
    logit_bias: Annotated[dict[str, float] | None, _only(None, {})] = None
    # kvswitch's own, as in the gRPC GenerateRequest.
    lora: str | None = None
    cache_salt: str | None = None
    priority: Priority = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_UINT32_MAX)]] | None = None
    routing: RoutingOptions | None = None
    # vLLM's: each choice (each chunk's, streaming) carries the output's token ids too.
    return_token_ids: Annotated[bool, _null_is(False)] = False

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, stop: Any) -> str | list[str] | None:
        # NOTE: checked here, not by the union's members: their errors name a member
        # ("stop.str"), not the parameter.
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else None
        if stop is not None and (stops is None or not all(isinstance(s, str) for s in stops)):
            raise ValueError("must be a string or a list of strings")
        stops = stops or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are taken")
        if any(not s for s in stops):
            raise ValueError("holds an empty string, which would stop before any output")
        return stop

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        # NOTE: as OpenAI: options of a stream on a request that streams nothing are an error.
        if options is not None and not info.data.get("stream"):
            raise ValueError("taken only when stream is true")
        return options

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerateRequest):
    """``POST /v1/completions``."""

    # A string, or token ids; a list of one of either is taken as that one.
    prompt: str | list[int]
    # The answer's text and logprobs start with the prompt's (scoring: max_tokens 0).
    echo: Annotated[bool, _null_is(False)] = False
    best_of: Annotated[int | None, _only(None, 1)] = None
    suffix: Annotated[str | None, _only(None)] = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # 0: no output, only the echoed prompt (with echo only).
    max_tokens: int | None = Field(default=None, ge=0, le=_UINT32_MAX)

    @model_validator(mode="after")
    def _check_no_output(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is taken only with echo (to score the prompt)")
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("must not be empty")
            return prompt
        if isinstance(prompt, list) and all(_is_token_id(t) for t in prompt):
            if not prompt:
                raise ValueError("must not be empty")
            return prompt
        if isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt):
            raise ValueError("holds several prompts; kvswitch takes one prompt per request")
        raise ValueError("must be a string or a list of token ids in [0, 2**32)")


class ChatMessage(_Strict):
    role: Annotated[str, _only(*CHAT_ROLES)]
    content: str
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_of_parts(cls, content: Any) -> Any:
        """Text parts are joined, one per line; other parts (images, audio) are refused."""
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"holds a {kind!r} part; kvswitch takes text parts only")
            if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                raise ValueError('a text part must be {"type": "text", "text": "..."}')
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(_GenerateRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_UINT32_MAX)
    logprobs: Annotated[bool, _null_is(False)] = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[Any] | None, _only(None, [])] = None
    tool_choice: Annotated[str | None, _only(None, "none")] = None
    parallel_tool_calls: bool | None = None  # about tools, of which there are none
    response_format: Annotated[dict[str, Any] | None, _only(None, {"type": "text"})] = None

    @model_validator(mode="after")
    def _check_top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: taken only with logprobs true")
        return self

    def output_limit(self) -> int | None:
        """The most tokens to generate, if the request says (the newer field first)."""
        return self.max_completion_tokens or self.max_tokens


class EmbeddingRequest(_Strict):
    """``POST /v1/embeddings``: one input (text or token ids) or several."""

    model: str
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Annotated[str, _null_is("float"), _only("float", "base64")] = "float"
    dimensions: Annotated[int | None, _only(None)] = None
    user: str | None = None
    # kvswitch's own: how the hidden states pool (None: the router's --embedding-pooling), and
    # as in the gRPC GenerateRequest.
    pooling: Annotated[str | None, _only(None, *POOLINGS)] = None
    lora: str | None = None
    cache_salt: str | None = None
    priority: Priority = None
    routing: RoutingOptions | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        if value == "" or value == []:
            raise ValueError("must not be empty")
        if isinstance(value, list) and any(v == "" or v == [] for v in value):
            raise ValueError("holds an empty input")
        if isinstance(value, list) and len(value) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"holds {len(value)} inputs; at most {MAX_EMBEDDING_INPUTS}")
        return value

    def inputs(self) -> list[str | list[int]]:
        """Each input alone: a text or a list of token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]  # type: ignore[list-item]
        return list(value)  # type: ignore[arg-type]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _UINT32_MAX


def error_from_validation(error: ValidationError) -> OpenAIError:
    """HTTP 400 naming the first bad parameter as OpenAI spells it (``messages[0].content``)."""
    first = error.errors(include_url=False)[0]
    param = ""
    for part in first["loc"]:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
    kind = first["type"]
    if kind == "json_invalid":
        return OpenAIError(400, f"the request body is not valid JSON: {first['msg']}")
    if kind == "model_attributes_type":
        return OpenAIError(400, "the request body must be a JSON object")
    if kind == "extra_forbidden":
        return OpenAIError(
            400,
            f"{param}: this parameter is not supported by kvswitch",
            param=param,
            code="unsupported_parameter",
        )
    message = first["msg"].removeprefix("Value error, ")
    blamed, _, rest = message.partition(": ")
    if not param and rest and blamed.isidentifier():
        # A check of several fields: its message starts with the one it blames.
        param, message = blamed, rest
    return OpenAIError(400, f"{param}: {message}", param=param or None, code="invalid_value")


# -- errors of the router ------------------------------------------------------------------------

_STATUS_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    # NOTE: a router shutting down cancels the calls still running after its grace.
    grpc.StatusCode.CANCELLED: 503,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# Fields of the gRPC request an INVALID_ARGUMENT's details may start with, and their parameter.
_FIELD_TO_PARAM = {
    "sampling.max_tokens": "max_tokens",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.stop_token_ids": "stop_token_ids",
    "lora": "lora",
    "cache_salt": "cache_salt",
    "routing": "routing",
}
_PROMPT_FIELDS = ("text", "token_ids", "the prompt", "the request has no prompt")


def error_from_status(
    code: grpc.StatusCode, details: str, trailing_metadata: Any, prompt_param: str
) -> OpenAIError:
    """The HTTP error for a router call that ended with ``code``; ``prompt_param``: the
    parameter the prompt came in (``prompt``, ``messages``)."""
    status = _STATUS_OF_CODE.get(code, 500)
    headers = {}
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        wait_ms = retry_after_ms(trailing_metadata)
        if wait_ms:
            # NOTE: both: Retry-After takes whole seconds; OpenAI's clients read the other first.
            headers = {
                "retry-after-ms": str(wait_ms),
                "retry-after": str(math.ceil(wait_ms / 1000)),
            }
    param, name = None, code.name.lower()
    if code is grpc.StatusCode.NOT_FOUND and details.startswith("lora:"):
        param, name = "model", "model_not_found"  # an adapter the fleet does not serve
    if status == 400:
        param = next((p for f, p in _FIELD_TO_PARAM.items() if details.startswith(f)), None)
        if param is None and details.startswith(_PROMPT_FIELDS):
            param = prompt_param
    return OpenAIError(status, details or code.name, param=param, code=name, headers=headers)


# -- responses -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int | None  # None: not known (a worker that does not say)

    def body(self) -> dict[str, Any]:
        details = None
        if self.num_cached_tokens is not None:
            details = {"cached_tokens": self.num_cached_tokens}
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
            "prompt_tokens_details": details,
        }


@dataclass(frozen=True)
class Reply:
    """What every response and chunk of one request repeats."""

    id: str
    created: int  # Unix seconds
    model: str
    chat: bool
    token_ids: bool = False  # each choice says its tokens (``return_token_ids``)

    @classmethod
    def of(cls, request_id: str, body: _GenerateRequest, *, chat: bool) -> Reply:
        return cls(request_id, int(time.time()), body.model, chat, body.return_token_ids)

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        if chunk and self.chat:
            kind += ".chunk"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(
        self,
        text: str,
        finish_reason: str | None,
        token_ids: list[int],
        *,
        delta: bool,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if not self.chat:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        else:
            key = "delta" if delta else "message"
            message = {"content": text} if delta else {"role": "assistant", "content": text}
            if delta and not text and finish_reason is not None:
                message = {}
            choice = {
                "index": 0,
                key: message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        if self.token_ids:
            choice["token_ids"] = token_ids
        return choice

    def whole(
        self,
        text: str,
        finish_reason: str,
        usage: Usage,
        token_ids: list[int] | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A response without streaming."""
        choice = self._choice(text, finish_reason, token_ids or [], delta=False, logprobs=logprobs)
        return {**self._envelope(chunk=False), "choices": [choice], "usage": usage.body()}

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        *,
        usage: bool,
        token_ids: list[int] | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk; ``usage``: the stream ends with a usage chunk (then every chunk
        carries ``"usage": null``, as on OpenAI)."""
        choice = self._choice(text, finish_reason, token_ids or [], delta=True, logprobs=logprobs)
        body = {**self._envelope(chunk=True), "choices": [choice]}
        if usage:
            body["usage"] = None
        return body

    def first_chat_chunk(self, *, usage: bool) -> dict[str, Any]:
        """A chat stream's first chunk: the role of the message that follows."""
        body = self.chunk("", usage=usage)
        body["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope(chunk=True), "choices": [], "usage": usage.body()}


def encode_embedding(vector: list[float], body: EmbeddingRequest) -> list[float] | str:
    """An embedding as the request's ``encoding_format`` asks: floats, or base64 of their
    little-endian float32 bytes (what OpenAI's client decodes)."""
    if body.encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
    return vector
