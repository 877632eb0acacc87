"""The router's OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models`` (FastAPI on uvicorn, on the router's own event loop).

The front holds no routing of its own. Each HTTP request becomes one ``kvswitch.v1.Router``
``Generate`` call to this very router, over a loopback channel, so it passes the same guard,
limits, routing and failover as any gRPC client's::

    POST /v1/chat/completions --> API key?, body size, parse, check --> chat template
        --> token ids --> Router.Generate (loopback: the router's token, the client's address,
        the front key) --> chunks --> text (cut at stop strings) --> JSON, or server-sent events

- auth: every endpoint refuses a request without one of the API keys (``--api-key``; the
  router's client token when none is given) with 401 before reading its body. The front then
  calls the router with the router's own token: the client's key is checked here, and need not
  open the gRPC API.
- body size: a body over ``--max-body-bytes`` is 413, refused unread where its length is
  declared and as soon as it passes the limit where it is not.
- open streams per client: the call names the HTTP client's address next to a key only this
  process knows (``router/forwarded.py``), and the servicer counts the stream against that
  address, so HTTP and gRPC streams from one address share its limit.
- TLS: the loopback call is made as the router calls its workers (``FleetSecurity``), and the
  HTTP API itself is served over TLS (and asks for client certificates) when the router is.
- errors: a call that fails before its first token is an HTTP error with the status its gRPC
  code maps to (``openai_protocol.error_from_status``); a stream that fails later ends with an
  ``{"error": ...}`` event, then ``[DONE]``. Nothing is retried here: failover happens in the
  router, and a 429 carries ``Retry-After`` for the client to wait and retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from kvswitch.cache_index.hashing import TokenIds, tokens_to_bytes
from kvswitch.checkpoint import embedding_pooling, is_random
from kvswitch.router.chat_template import ChatTemplateError, load_chat_template
from kvswitch.router.engine_request import EngineRequest
from kvswitch.router.forwarded import (
    FORWARDED_CLIENT_HEADER,
    FORWARDED_TENANT_HEADER,
    FRONT_KEY_HEADER,
    http_client,
)
from kvswitch.router.limits import MAX_UNKNOWN_OUTPUT_TOKENS, check_prompt_length, check_request
from kvswitch.router.local_call import LocalStub
from kvswitch.router.openai_logprobs import (
    CompletionLogprobs,
    TokenTexts,
    chat_logprobs,
    join_completion_logprobs,
)
from kvswitch.router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    LoadLoraAdapterRequest,
    OpenAIError,
    Reply,
    UnloadLoraAdapterRequest,
    Usage,
    encode_embedding,
    error_from_validation,
)
from kvswitch.router.openai_stream import RouterOutput, events, until_disconnected
from kvswitch.router.router import (
    FleetFullError,
    NoTokenizerError,
    NoWorkerError,
    Router,
    UnknownAdapterError,
)
from kvswitch.router.servicer import WORKER_ID_KEY
from kvswitch.router.stop_strings import StopStrings
from kvswitch.router.tenants import key_tenant
from kvswitch.security import FleetSecurity
from kvswitch.serving import check_name
from kvswitch.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvswitch.router.engine_forward import EngineForwarder
    from kvswitch.router.lora_updates import FleetAdapters, LoraUpdate
from kvswitch.v1 import common_pb2, router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

T = TypeVar("T")

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# A chat request without max_tokens to a model with random weights (the built-in one,
# ``random:NAME``) gets this many, and a header saying so.
RANDOM_WEIGHTS_MAX_TOKENS = 64
DEFAULT_MAX_TOKENS_HEADER = "x-kvswitch-default-max-tokens"
_UINT32_MAX = (1 << 32) - 1
_INLINE_RENDER_CHARS = 1024  # longer conversations are rendered and tokenized on a thread
# The tokens a chunk of a non-streamed answer waits for (GenerateRequest.stream_interval).
_WHOLE_ANSWER_STREAM_INTERVAL = 64
_EMBEDDING_CALLS = 16  # the inputs of one embeddings request routed at once


@dataclasses.dataclass(frozen=True)
class FrontConfig:
    """What the front takes from ``RouterConfig`` (fields of the same names)."""

    host: str
    http_port: int
    model: str  # whose chat template to use; empty = the built-in model's
    token: str  # the router's client token, which the front's calls to the router carry
    max_message_bytes: int
    max_body_bytes: int  # the largest request body taken (413 past it)
    max_output_tokens: int  # a chat request without max_tokens may have this many; 0 = no limit
    wait_for_worker_s: float  # a request finding no worker waits this long for one
    security: FleetSecurity
    keys: tuple[str, ...] = ()  # what a client must present as "Bearer KEY"; () = nothing
    lora_updates: bool = False  # serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    embedding_pooling: str = ""  # /v1/embeddings' pooling; "" = the checkpoint's, else "last"
    tenant_header: str = ""  # the header naming a request's tenant (router/tenants.py)
    reuse_port: bool = False  # the port is shared with the router's other processes

    @classmethod
    def of(cls, config: Any) -> FrontConfig:
        names = [f.name for f in dataclasses.fields(cls) if f.name not in ("security", "keys")]
        return cls(
            **{name: getattr(config, name) for name in names},
            security=config.security(),
            keys=config.http_keys(),
        )


class ServedModels(Protocol):
    """What a front serves: the model names a request may give, and their tokenizer."""

    tokenizer: Tokenizer | None

    def tokenize(self, text: str) -> TokenIds:
        """The token ids of ``text``; NoTokenizerError without a tokenizer."""
        ...

    def names(self) -> list[str]:
        """The models served now."""
        ...

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters served now, each with the model it adapts (not to be changed)."""
        ...

    async def wait_for_change(self, timeout_s: float) -> None:
        """Return when the models served may have changed, or after ``timeout_s``."""
        ...


class RouterModels:
    """A router's models: the one it was told, else what its live workers serve."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self.tokenizer = router.tokenizer
        # The fleet's adapters as of the directory's num_adapter_changes: read for every
        # request, walked out of every worker's load only after a change.
        self._adapters: dict[str, str] = {}
        self._adapters_as_of = -1

    def tokenize(self, text: str) -> TokenIds:
        return self._router.tokenize(text)

    def names(self) -> list[str]:
        if self._router.namespace:
            return [self._router.namespace]
        return sorted({h.info.namespace for h in self._router.directory.handles()})

    def adapters(self) -> dict[str, str]:
        directory = self._router.directory
        if self._adapters_as_of != directory.num_adapter_changes:
            namespace = self._router.namespace
            self._adapters = {
                lora: h.info.namespace
                for h in directory.handles()
                if not namespace or h.info.namespace == namespace
                for lora in h.loras
            }
            self._adapters_as_of = directory.num_adapter_changes
        return self._adapters

    async def wait_for_change(self, timeout_s: float) -> None:
        await self._router.directory.wait_for_change(timeout_s)


class OpenAIFront:
    """The ASGI app (``app``) and what its endpoints share: the stub its calls go to (a router's,
    on loopback, or a worker's seen as one), the template."""

    def __init__(
        self,
        config: FrontConfig,
        models: ServedModels,
        stub: router_pb2_grpc.RouterStub | LocalStub,
        front_key: str,
        engines: EngineForwarder | None = None,
        adapters: FleetAdapters | None = None,
    ) -> None:
        self._config = config
        self._adapters = adapters  # with config.lora_updates: loads and unloads them
        self._models = models
        self._engines = engines  # where the fleet has OpenAI-API engines
        self._stub = stub
        self._front_key = front_key
        self._max_body_bytes = config.max_body_bytes
        self._template, self._no_template_reason = load_chat_template(
            config.model, models.tokenizer
        )
        if self._template is None:
            logger.warning("chat requests will be refused: %s", self._no_template_reason)
        # The router's model is the workers' (``kvswitch up`` gives both the same --model).
        self._random_weights = is_random(config.model or None)
        self._said_default_limit = False
        self._started = int(time.time())
        self._token_texts = TokenTexts(models.tokenizer)
        self._pooling = (
            config.embedding_pooling or embedding_pooling(config.model or None) or "last"
        )
        self.app = FastAPI(title="kvswitch", docs_url=None, redoc_url=None, openapi_url=None)
        self.app.add_exception_handler(OpenAIError, _error_response)  # type: ignore[arg-type]
        self.app.add_exception_handler(HTTPException, _http_error_response)  # type: ignore[arg-type]
        self.app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        self.app.add_api_route("/v1/embeddings", self.embeddings, methods=["POST"])
        self.app.add_api_route("/v1/models", self.models, methods=["GET"])
        self.app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        self.app.add_api_route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"])
        self.app.add_api_route(
            "/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]
        )
        self._hot_paths = {
            "/v1/completions": self.completions,
            "/v1/chat/completions": self.chat_completions,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The front as an ASGI app: a completion straight to its endpoint (past FastAPI's
        routing and middleware, work of its own on every request), anything else through
        ``app``."""
        endpoint = None
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._hot_paths.get(scope["path"])
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except OpenAIError as e:
            response = await _error_response(request, e)
        except HTTPException as e:
            response = await _http_error_response(request, e)
        await response(scope, receive, send)

    # -- endpoints ---------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        self._check_key(request)
        raw = await self._read_body(request)
        if self._engines is not None and self._engines.has_engines():
            answer = await self._to_engine(request, raw, chat=False)
            if answer is not None:
                return answer
        body = _validate(raw, CompletionRequest)
        await self._check_model_soon(body.model)
        # NOTE: max_tokens 0 (echo only) still samples one token, which nobody is shown.
        max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        call = self._grpc_request(body, f"cmpl-{uuid.uuid4().hex}", max(max_tokens, 1))
        if body.logprobs is not None:
            call.sampling.logprobs = body.logprobs
            if body.echo:
                call.sampling.prompt_logprobs = body.logprobs
        prompt = body.prompt
        if isinstance(prompt, str):
            call.text = prompt
            count_prompt = functools.partial(self._tokenize, prompt, len)
        else:
            call.token_ids.ids_u32le = tokens_to_bytes(np.asarray(prompt, np.uint32))
            count_prompt = self._counter(lambda: len(prompt), 0)
        echo = None
        if body.echo:
            echo = await self._echo(prompt)
        reply = Reply.of(call.request_id, body, chat=False)
        return await self._answer(
            request,
            body,
            call,
            reply,
            "prompt",
            count_prompt,
            echo=echo,
            keep_output=max_tokens > 0,
        )

    async def chat_completions(self, request: Request) -> Response:
        self._check_key(request)
        raw = await self._read_body(request)
        if self._engines is not None and self._engines.has_engines():
            answer = await self._to_engine(request, raw, chat=True)
            if answer is not None:
                return answer
        body = _validate(raw, ChatCompletionRequest)
        await self._check_model_soon(body.model)
        template = self._template
        if template is None:
            raise OpenAIError(
                400, f"chat is not available: {self._no_template_reason}", param="messages"
            )
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            token_ids = await self._off_loop_if_long(
                lambda: template.encode(template.render(messages)),
                sum(len(m["content"]) for m in messages),
            )
        except ChatTemplateError as e:
            raise OpenAIError(400, str(e), param="messages") from None
        max_tokens, headers = self._chat_output_limit(body)
        call = self._grpc_request(body, f"chatcmpl-{uuid.uuid4().hex}", max_tokens)
        if body.logprobs:
            call.sampling.logprobs = body.top_logprobs or 0
        call.token_ids.ids_u32le = tokens_to_bytes(np.asarray(token_ids, np.uint32))
        reply = Reply.of(call.request_id, body, chat=True)
        count_prompt = self._counter(lambda: len(token_ids), 0)
        return await self._answer(request, body, call, reply, "messages", count_prompt, headers)

    async def embeddings(self, request: Request) -> Response:
        """Each input's embedding: its prompt's final hidden states, pooled, computed by a
        worker as any prompt (routed where its prefix is cached, whose cached rows it reuses)."""
        self._check_key(request)
        body = _validate(await self._read_body(request), EmbeddingRequest)
        await self._check_model_soon(body.model)
        pooling = body.pooling or self._pooling
        request_id = f"embd-{uuid.uuid4().hex}"
        limit = asyncio.Semaphore(_EMBEDDING_CALLS)

        async def embed(index: int, item: str | list[int]) -> tuple[list[float], Usage]:
            call = self._call(
                body, f"{request_id}-{index}", common_pb2.SamplingParams(max_tokens=1)
            )
            call.pooling = pooling
            if isinstance(item, str):
                call.text = item
            else:
                call.token_ids.ids_u32le = tokens_to_bytes(np.asarray(item, np.uint32))
            async with limit:
                rpc = self._stub.Generate(call, metadata=self._metadata(request))
                output = RouterOutput(
                    rpc, None, "input", self._counter(lambda: 0, 0), keep_output=False
                )
                try:
                    await output.read_all()
                    _, usage = await output.ending()
                finally:
                    rpc.cancel()
            if not output.embedding:
                raise OpenAIError(500, "the worker sent no embedding", code="server_error")
            return output.embedding, usage

        results = await until_disconnected(
            request, asyncio.gather(*(embed(i, x) for i, x in enumerate(body.inputs())))
        )
        data = [
            {"object": "embedding", "index": i, "embedding": encode_embedding(vector, body)}
            for i, (vector, _) in enumerate(results)
        ]
        num_prompt_tokens = sum(usage.num_prompt_tokens for _, usage in results)
        num_cached_tokens = sum(usage.num_cached_tokens or 0 for _, usage in results)
        usage_body = {
            "prompt_tokens": num_prompt_tokens,
            "total_tokens": num_prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
        }
        return JSONResponse(
            {"object": "list", "data": data, "model": body.model, "usage": usage_body}
        )

    async def models(self, request: Request) -> Response:
        self._check_key(request)
        data = [self._model_card(name) for name in self._served_models()]
        adapters = self._models.adapters()
        data += [self._model_card(name, adapters[name]) for name in sorted(adapters)]
        return JSONResponse({"object": "list", "data": data})

    async def load_lora_adapter(self, request: Request) -> Response:
        """Load an adapter on the workers (``router/lora_updates.py``): 200 once one worker
        or more serve it, naming them (and any that refused); 400 when none would."""
        adapters = self._lora_updates(request)
        body = _validate(await self._read_body(request), LoadLoraAdapterRequest)
        name = body.lora_name
        try:
            check_name("lora_name", name)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="lora_name") from None
        if name in self._served_models():
            raise OpenAIError(
                400, f"lora_name: {name!r} is the model's own name", param="lora_name"
            )
        update = await adapters.load(name, body.lora_path)
        if not update.done:
            raise OpenAIError(
                503 if not update.refused else 400,
                f"no worker loaded the adapter {name!r}: "
                + (update.describe_refusals() or "no worker is live"),
                param="lora_path" if update.refused else None,
            )
        return JSONResponse(_update_body(update))

    async def unload_lora_adapter(self, request: Request) -> Response:
        """Unload an adapter from the workers serving it: 200 naming them; 404 when none
        does; 409 when some still run requests of it (those keep it)."""
        adapters = self._lora_updates(request)
        body = _validate(await self._read_body(request), UnloadLoraAdapterRequest)
        name = body.lora_name
        if name not in self._models.adapters():
            raise OpenAIError(
                404,
                f"no worker serves the adapter {name!r}",
                param="lora_name",
                code="model_not_found",
            )
        update = await adapters.unload(name)
        if update.refused:
            raise OpenAIError(
                409,
                f"the adapter {name!r} was unloaded from "
                f"{', '.join(update.done) or 'no worker'}; refused by "
                f"{update.describe_refusals()}",
                param="lora_name",
                code="adapter_in_use",
            )
        return JSONResponse(_update_body(update))

    def _lora_updates(self, request: Request) -> FleetAdapters:
        self._check_key(request)
        if self._adapters is None:
            raise OpenAIError(
                403,
                "loading LoRA adapters at run time is off: a router started with "
                "--lora-updates serves it",
                code="lora_updates_off",
            )
        return self._adapters

    async def model(self, request: Request, model_id: str) -> Response:
        self._check_key(request)
        self._check_model(model_id)
        return JSONResponse(self._model_card(model_id, self._models.adapters().get(model_id)))

    # -- one request ---------------------------------------------------------------------------

    async def _answer(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        call: router_pb2.GenerateRequest,
        reply: Reply,
        prompt_param: str,
        count_prompt: Callable[[], Awaitable[int]],
        headers: dict[str, str] | None = None,
        *,
        echo: tuple[str, list[int]] | None = None,
        keep_output: bool = True,
    ) -> Response:
        """Send ``call`` to the router and answer with its output, with ``headers``: whole, or
        streamed once the router has sent the first token (so that a refusal is still an HTTP
        status). ``echo``: the prompt's text and token ids, which the answer starts with;
        ``keep_output`` False: the answer is the echo alone (``max_tokens`` 0)."""
        headers = dict(headers or {})
        if call.ByteSize() > self._config.max_message_bytes:
            raise OpenAIError(
                413,
                f"the request is {call.ByteSize()} bytes as the router takes it; this router "
                f"takes at most {self._config.max_message_bytes}",
                code="request_too_large",
            )
        stops = StopStrings(body.stop_strings()) if body.stop else None
        if not body.stream and stops is None:
            # NOTE: the answer is read whole: few chunks, each a message at every hop. With stop
            # strings, a token a chunk, so that the count of tokens up to a stop stays exact.
            call.stream_interval = _WHOLE_ANSWER_STREAM_INTERVAL
        rpc = self._stub.Generate(call, metadata=self._metadata(request))
        output = RouterOutput(rpc, stops, prompt_param, count_prompt, keep_output=keep_output)
        shown = self._logprobs_shown(call, output, reply.chat, echo)
        prefix = echo[0] if echo is not None else ""
        try:
            if not body.stream:
                text = prefix + await until_disconnected(request, output.read_all())
                headers.update(_route_headers(output.final))
                finish_reason, usage = await output.ending()
                body_out = reply.whole(
                    text,
                    finish_reason,
                    usage,
                    output.token_ids,
                    shown(slice(0, len(output.token_ids))),
                )
                return JSONResponse(body_out, headers=headers)
            first = prefix + await until_disconnected(request, output.first())
            # NOTE: the router names the worker before its first token, in the call's headers.
            worker_id = dict(await rpc.initial_metadata() or ()).get(WORKER_ID_KEY, "")
        except BaseException:
            rpc.cancel()
            raise
        if worker_id:
            headers["x-kvswitch-worker"] = _header_value(worker_id)
        headers["cache-control"] = "no-cache"

        async def cancel() -> None:  # a stream whose client left before it began
            rpc.cancel()

        return StreamingResponse(
            events(reply, output, first, body.include_usage(), shown),
            media_type="text/event-stream",
            headers=headers,
            background=BackgroundTask(cancel),
        )

    async def _to_engine(self, request: Request, raw: bytes, *, chat: bool) -> Response | None:
        """The answer of the engine the router sends the request to (``router/engine_forward.py``),
        read as an engine reads it (``EngineRequest``); None where it goes to a worker."""
        engines = self._engines
        assert engines is not None
        view = _validate(raw, EngineRequest)
        await self._check_model_soon(view.model)
        param = "messages" if chat else "prompt"
        lora = self._lora_of(view.model, view.lora)
        try:
            token_ids = await self._engine_prompt(view, chat)
            max_tokens = view.output_limit()
            if max_tokens is None:
                max_tokens = self._config.max_output_tokens or _UINT32_MAX
                if not chat:
                    max_tokens = COMPLETION_MAX_TOKENS
            # NOTE: the limits the router's servicer holds a worker's request to, of what the
            # router reads; the engine checks the rest.
            check = router_pb2.GenerateRequest(
                sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
                lora=lora or "",
                cache_salt=view.cache_salt or "",
            )
            policy, weights = "", None
            if view.routing is not None:
                policy, weights = view.routing.policy, dict(view.routing.weights)
                check.routing.policy = policy
                check.routing.weights.update(weights)
            check_request(check, engines.limits)
            check_prompt_length(len(token_ids), param, engines.limits)
            return await engines.forward(
                request,
                token_ids,
                raw,
                lora=lora,
                cache_salt=view.cache_salt,
                num_output_tokens=min(max_tokens, MAX_UNKNOWN_OUTPUT_TOKENS),
                stream=bool(view.stream),
                policy=policy,
                weights=weights,
            )
        except FleetFullError as e:
            raise OpenAIError(
                429, str(e), code="overloaded", headers={"retry-after": "1"}
            ) from None
        except UnknownAdapterError as e:
            raise OpenAIError(404, str(e), param="model", code="model_not_found") from None
        except NoWorkerError as e:
            raise OpenAIError(503, str(e), code="unavailable") from None
        except ValueError as e:  # a bad prompt, or routing
            raise OpenAIError(400, str(e), param=param) from None

    async def _engine_prompt(self, view: EngineRequest, chat: bool) -> TokenIds:
        """The token ids the router routes ``view`` by: its prompt's, or its conversation as
        the chat template renders it (its text alone where the template cannot)."""
        if not chat:
            prompt = view.routed_prompt()
            if not isinstance(prompt, str):
                return list(prompt)
            return await self._tokenize(prompt, _same)
        messages = view.chat_messages()
        template = self._template
        num_chars = sum(len(m["content"]) for m in messages)

        def encode() -> TokenIds:
            if template is not None:
                with contextlib.suppress(ChatTemplateError):
                    return template.encode(template.render(messages))
            # NOTE: roles or parts the template does not take: the engine's own template may;
            # the text is what the router can route by.
            return self._models.tokenize("\n".join(m["content"] for m in messages))

        return await self._off_loop_if_long(encode, num_chars)

    def _chat_output_limit(self, body: ChatCompletionRequest) -> tuple[int, dict[str, str]]:
        """The most tokens a chat request may generate, and the headers that say so when the
        router chose it."""
        limit = body.output_limit()
        if limit is not None:
            return limit, {}
        if not self._random_weights:
            # NOTE: without max_tokens a chat answer runs to its end, as on OpenAI: as long as
            # the router allows (and the worker's context, which the router and worker cut it to).
            return self._config.max_output_tokens or _UINT32_MAX, {}
        # NOTE: random weights seldom sample the end token: the answer would fill the context.
        limit = min(RANDOM_WEIGHTS_MAX_TOKENS, self._config.max_output_tokens or _UINT32_MAX)
        if not self._said_default_limit:
            self._said_default_limit = True
            logger.info(
                "the model has random weights and seldom ends an answer: chat requests without "
                "max_tokens get %d tokens (header %s)",
                limit,
                DEFAULT_MAX_TOKENS_HEADER,
            )
        return limit, {DEFAULT_MAX_TOKENS_HEADER: str(limit)}

    async def _echo(self, prompt: str | list[int]) -> tuple[str, list[int]]:
        """The prompt's text and token ids, for an answer that echoes it."""
        if isinstance(prompt, str):
            return prompt, await self._tokenize(prompt, _as_list)
        tokenizer = self._models.tokenizer
        text = tokenizer.decode(prompt) if tokenizer is not None else ""
        return text, list(prompt)

    def _logprobs_shown(
        self,
        call: router_pb2.GenerateRequest,
        output: RouterOutput,
        chat: bool,
        echo: tuple[str, list[int]] | None,
    ) -> Callable[[slice], dict[str, Any] | None]:
        """What a response (or a chunk) shows as its ``logprobs``, given the span of output
        tokens it carries: None unless asked; the echoed prompt's first."""
        if not call.sampling.HasField("logprobs"):
            return lambda span: None
        texts = self._token_texts
        if chat:
            return lambda span: chat_logprobs(texts, output.token_ids[span], output.logprobs[span])
        columns = CompletionLogprobs(texts)
        prompt_ids = echo[1] if echo is not None else None

        def shown(span: slice) -> dict[str, Any]:
            nonlocal prompt_ids
            parts = []
            if prompt_ids is not None:
                if len(output.prompt_logprobs) != len(prompt_ids) - 1:
                    raise OpenAIError(
                        500,
                        f"the worker scored {len(output.prompt_logprobs)} prompt tokens of "
                        f"{len(prompt_ids) - 1}",
                        code="server_error",
                    )
                parts.append(columns.prompt(prompt_ids, output.prompt_logprobs))
                prompt_ids = None
            parts.append(columns.output(output.token_ids[span], output.logprobs[span]))
            return join_completion_logprobs(parts)

        return shown

    def _grpc_request(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        request_id: str,
        max_tokens: int,
    ) -> router_pb2.GenerateRequest:
        """The gRPC request for ``body``, its prompt still to set."""
        sampling = common_pb2.SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stop_token_ids=body.stop_token_ids or (),
        )
        if body.seed is not None:
            sampling.seed = body.seed
        return self._call(body, request_id, sampling)

    def _call(
        self,
        body: CompletionRequest | ChatCompletionRequest | EmbeddingRequest,
        request_id: str,
        sampling: common_pb2.SamplingParams,
    ) -> router_pb2.GenerateRequest:
        """The gRPC request of ``body`` with ``sampling``: its adapter, salt and routing."""
        call = router_pb2.GenerateRequest(
            request_id=request_id,
            sampling=sampling,
            lora=self._lora_of(body.model, body.lora) or "",
            cache_salt=body.cache_salt or "",
            priority=(
                common_pb2.PRIORITY_BATCH
                if body.priority == "batch"
                else common_pb2.PRIORITY_INTERACTIVE
            ),
        )
        if body.routing is not None:
            call.routing.policy = body.routing.policy
            call.routing.weights.update(body.routing.weights)
        return call

    def _metadata(self, request: Request) -> tuple[tuple[str, str], ...]:
        client = http_client(request.client.host) if request.client else "unknown"
        metadata = [
            (FRONT_KEY_HEADER, self._front_key),
            (FORWARDED_CLIENT_HEADER, client),
            (FORWARDED_TENANT_HEADER, self._tenant(request, client)),
        ]
        # NOTE: the router's own token, not the client's key: the key was checked here.
        if self._config.token:
            metadata.append(("authorization", f"Bearer {self._config.token}"))
        return tuple(metadata)

    def _tenant(self, request: Request, client: str) -> str:
        """Who the request counts against (router/tenants.py): the tenant header's value, else
        the API key it presented (checked already), else its client."""
        header = self._config.tenant_header
        if header and (value := request.headers.get(header)):
            return value
        sent = request.headers.get("authorization", "")
        if self._config.keys and sent.startswith("Bearer "):
            return key_tenant(sent.removeprefix("Bearer "))
        return client

    # -- checks --------------------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        """The body, up to ``max_body_bytes``; 415 unless it is JSON, 413 past the limit."""
        _check_json_content_type(request)
        length = request.headers.get("content-length", "")
        too_large = OpenAIError(
            413,
            f"the request body is larger than the {self._max_body_bytes} bytes this router takes "
            "(--max-body-bytes)",
            code="request_too_large",
        )
        if length.isdigit() and int(length) > self._max_body_bytes:
            raise too_large
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self._max_body_bytes:
                raise too_large
        return bytes(body)

    def _served_models(self) -> list[str]:
        return self._models.names()

    def _check_model(self, name: str, served: list[str] | None = None) -> None:
        """404 unless ``name`` is a model, or a LoRA adapter, served here (``served``: the
        models, where the caller has them)."""
        if served is None:
            served = self._served_models()
        if name not in served and name not in self._models.adapters():
            raise OpenAIError(
                404,
                f"the model {name!r} is not served here; "
                + (f"served here: {', '.join(map(repr, served))}" if served else "none is"),
                param="model",
                code="model_not_found",
            )

    async def _check_model_soon(self, name: str) -> None:
        """``_check_model`` for a request: with no worker live yet, first wait for one as the
        router would (``wait_for_worker_s``), so that the request is not served by whatever
        model comes first; 503 if none comes."""
        served = self._served_models()
        deadline_s = time.monotonic() + self._config.wait_for_worker_s
        while not served and (left_s := deadline_s - time.monotonic()) > 0:
            await self._models.wait_for_change(left_s)
            served = self._served_models()
        if not served:
            raise OpenAIError(
                503,
                f"no worker is live: none has registered in {self._config.wait_for_worker_s:g} s",
                code="unavailable",
            )
        self._check_model(name, served)

    def _lora_of(self, model: str, lora: str | None) -> str | None:
        """The adapter a request runs under: the one ``model`` names, else ``lora``'s (400
        when both name one and differ)."""
        if model not in self._models.adapters():
            return lora
        if lora is not None and lora != model:
            raise OpenAIError(
                400,
                f"lora: {lora!r} differs from the adapter the model names ({model!r}); give one",
                param="lora",
            )
        return model

    def _check_key(self, request: Request) -> None:
        """401 unless the request carries one of the keys, before anything is read or rendered
        for it."""
        keys = self._config.keys
        if not keys:
            return
        sent = request.headers.get("authorization", "").encode()
        # NOTE: every key compared, each in constant time: the time a guess takes says
        # nothing of the keys, nor of which one it came close to.
        if not any([hmac.compare_digest(sent, f"Bearer {key}".encode()) for key in keys]):
            raise _unauthenticated()

    def _model_card(self, name: str, parent: str | None = None) -> dict[str, Any]:
        """The card of a model, or of a LoRA adapter of the model ``parent``."""
        card = {"id": name, "object": "model", "created": self._started, "owned_by": "kvswitch"}
        if parent is not None:
            card["parent"] = parent
        return card

    # -- helpers -------------------------------------------------------------------------------

    def _counter(self, count: Callable[[], int], num_chars: int) -> Callable[[], Awaitable[int]]:
        return lambda: self._off_loop_if_long(count, num_chars)

    async def _tokenize(self, text: str, then: Callable[[list[int]], T]) -> T:
        """``then`` of ``text``'s token ids; on a thread past the tokenizer's ``inline_chars``."""
        tokenizer = self._models.tokenizer
        inline_chars = tokenizer.inline_chars if tokenizer is not None else len(text)
        return await self._off_loop_if_long(
            lambda: then(self._models.tokenize(text)), len(text), inline_chars
        )

    async def _off_loop_if_long(
        self, work: Callable[[], T], num_chars: int, inline_chars: int = _INLINE_RENDER_CHARS
    ) -> T:
        # NOTE: as the servicer tokenizes: a long prompt on a thread, not stalling the streams.
        try:
            if num_chars <= inline_chars:
                return work()
            return await asyncio.to_thread(work)
        except NoTokenizerError as e:
            raise OpenAIError(400, str(e), param="prompt") from None


def _same(token_ids: TokenIds) -> TokenIds:
    return token_ids


def _as_list(token_ids: TokenIds) -> list[int]:
    return token_ids.tolist() if isinstance(token_ids, np.ndarray) else list(token_ids)


def _route_headers(final: router_pb2.GenerateFinal | None) -> dict[str, str]:
    """Where the request ran: its (decode) worker and why; where another worker prefilled its
    prompt, that worker; where KV blocks moved to it, how many."""
    if final is None or not final.route.worker_id:
        return {}
    headers = {
        "x-kvswitch-worker": _header_value(final.route.worker_id),
        "x-kvswitch-route-reason": _header_value(final.route.reason),
    }
    stats = final.stats
    disaggregated = stats.prefill_worker_id not in ("", stats.worker_id)
    if disaggregated:
        headers["x-kvswitch-prefill-worker"] = _header_value(stats.prefill_worker_id)
    if disaggregated or stats.num_transferred_blocks:
        headers["x-kvswitch-kv-blocks-moved"] = str(stats.num_transferred_blocks)
    return headers


def _update_body(update: LoraUpdate) -> dict[str, Any]:
    body: dict[str, Any] = {"lora_name": update.lora_name, "workers": update.done}
    if update.refused:
        body["refused"] = {worker_id: why for worker_id, (_, why) in update.refused.items()}
    return body


def _validate(raw: bytes, model: type[T]) -> T:
    """``raw`` as ``model``; 400 naming the first bad parameter."""
    try:
        return model.model_validate_json(raw)  # type: ignore[attr-defined]
    except ValidationError as e:
        raise error_from_validation(e) from None


def _check_json_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (``application/json``, ``application/*+json``);
    a body that declares nothing is read as JSON."""
    content_type = request.headers.get("content-type")
    if content_type is None:
        return
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    ):
        return
    raise OpenAIError(
        415,
        f"the request body must be JSON (Content-Type: application/json), not {content_type!r}",
        code="unsupported_media_type",
    )


def _header_value(value: str) -> str:
    return value.encode("ascii", "replace").decode()


def _unauthenticated() -> OpenAIError:
    return OpenAIError(
        401,
        "missing or wrong API key: send 'Authorization: Bearer KEY' with a key of this router",
        code="invalid_api_key",
        headers={"www-authenticate": "Bearer"},
    )


async def _error_response(request: Request, error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _http_error_response(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path, a wrong method) in OpenAI's shape, with their
    headers (a 405's ``Allow``)."""
    return await _error_response(
        request, OpenAIError(error.status_code, str(error.detail), headers=error.headers)
    )
