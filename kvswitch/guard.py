"""What every kvswitch server checks before a call reaches its servicer.

``ServerGuard`` is a ``grpc.aio`` server interceptor, in front of the router's and the worker's
services alike::

    call -> bearer token of its service? -- no --> UNAUTHENTICATED
                 | yes
                 v
            within the service's size? --- no --> INVALID_ARGUMENT, the size, the limit and
                 | yes                            the largest field
                 v
            request parses? -------------- no --> INVALID_ARGUMENT, naming the bad field
                 | yes
                 v
            the servicer

gRPC itself would parse the request before any code of ours runs, and answer a malformed one
with UNKNOWN ("Unexpected DecodeError"), which a client cannot tell from a server bug. So the
guard takes the request as bytes and parses it itself. The standard health service is never
guarded: load balancers and orchestrators probe it without credentials.
"""

from __future__ import annotations

import dataclasses
import hmac
import inspect
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

GUARDED_PACKAGE = "kvswitch.v1."  # the services the guard parses requests for


@dataclasses.dataclass(frozen=True)
class ServerGuard(grpc.aio.ServerInterceptor):
    """Refuses calls to a service in ``service_to_token`` without ``authorization: Bearer
    <token>`` (a service not in it takes any caller), and parses every kvswitch request itself
    so that a malformed one ends with INVALID_ARGUMENT and a message naming the bad field."""

    service_to_token: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # The largest request a service takes, in bytes, and the option that sets it (for the
    # message); a service not in it takes what gRPC lets through.
    service_to_max_bytes: Mapping[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    # Each method's parsing handler, built on its first call (a servicer's handlers never change).
    _method_to_handler: dict[str, grpc.RpcMethodHandler] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method  # "/kvswitch.v1.Router/Generate"
        service = method.split("/")[1] if method.count("/") == 2 else ""
        token = self.service_to_token.get(service)
        if token and not _has_token(handler_call_details.invocation_metadata, token):
            return _refusal(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        parsing = self._method_to_handler.get(method)
        if parsing is not None:
            return parsing
        handler = await continuation(handler_call_details)
        if handler is None or not service.startswith(GUARDED_PACKAGE):
            return handler
        max_bytes, option = self.service_to_max_bytes.get(service, (0, ""))
        parsing = self._method_to_handler[method] = _parsing_handler(handler, max_bytes, option)
        return parsing


def _has_token(metadata: Any, token: str) -> bool:
    sent = dict(metadata or ()).get("authorization", "")
    # NOTE: compared in constant time: how long a wrong guess takes says nothing of the token.
    return isinstance(sent, str) and hmac.compare_digest(sent.encode(), f"Bearer {token}".encode())


def _refusal(code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    # NOTE: whatever the method's kind, a unary-stream handler that aborts answers it; the
    # request is never parsed (no deserializer).
    return grpc.unary_stream_rpc_method_handler(refuse)


# -- parsing ---------------------------------------------------------------------------------


def _parsing_handler(
    handler: grpc.RpcMethodHandler, max_bytes: int = 0, option: str = ""
) -> grpc.RpcMethodHandler:
    """``handler`` taking its request as bytes, parsed here with its own deserializer, and
    refused when longer than ``max_bytes`` (0 = any length)."""
    deserialize = handler.request_deserializer
    if deserialize is None:
        return handler
    parse = _parser(deserialize, max_bytes, option)
    if handler.request_streaming:
        behavior = handler.stream_stream or handler.stream_unary
        wrapped = _with_parsed_stream(behavior, parse)
        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
    else:
        behavior = handler.unary_stream or handler.unary_unary
        wrapped = _with_parsed_request(behavior, parse)
        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
    return make(wrapped, response_serializer=handler.response_serializer)


Parse = Callable[[bytes, grpc.aio.ServicerContext], Any]


def _parser(deserialize: Callable[[bytes], Message], max_bytes: int, option: str) -> Parse:
    descriptor: Descriptor | None = getattr(
        getattr(deserialize, "__self__", None), "DESCRIPTOR", None
    )

    async def parse(data: bytes, context: grpc.aio.ServicerContext) -> Message:
        if max_bytes and len(data) > max_bytes:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, _too_large(descriptor, data, max_bytes, option)
            )
        try:
            return deserialize(data)
        except DecodeError as e:
            name = descriptor.full_name if descriptor is not None else "request"
            why = malformed_field(descriptor, data) if descriptor is not None else None
            # NOTE: abort raises: no request comes back from here.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {name}: {why or e}")
            raise AssertionError("context.abort returned") from e

    return parse


def _with_parsed_request(behavior: Callable, parse: Parse) -> Callable:
    if inspect.isasyncgenfunction(behavior):

        async def generate(data: bytes, context: grpc.aio.ServicerContext):
            request = await parse(data, context)
            async for response in behavior(request, context):
                yield response

        return generate

    async def call(data: bytes, context: grpc.aio.ServicerContext):
        return await behavior(await parse(data, context), context)

    return call


def _with_parsed_stream(behavior: Callable, parse: Parse) -> Callable:
    async def requests(raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
        async for data in raw:
            yield await parse(data, context)

    if inspect.isasyncgenfunction(behavior):

        async def generate(raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
            async for response in behavior(requests(raw, context), context):
                yield response

        return generate

    async def call(raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
        return await behavior(requests(raw, context), context)

    return call


def _too_large(descriptor: Descriptor | None, data: bytes, max_bytes: int, option: str) -> str:
    name = descriptor.full_name if descriptor is not None else "the request"
    why = f"{name} is {len(data)} bytes; this server takes at most {max_bytes}"
    if option:
        why += f" ({option})"
    largest = largest_field(descriptor, data) if descriptor is not None else None
    if largest is not None:
        why += f"; its field {largest[0]} is {largest[1]} bytes of it"
    return why


def largest_field(descriptor: Descriptor, data: bytes) -> tuple[str, int] | None:
    """The name and length of the longest top-level length-delimited field of ``data`` (the
    prompt, in a request too large), or None if it has none (or is malformed)."""
    pos, largest = 0, None
    while pos < len(data):
        try:
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == _VARINT:
                _, pos = _varint(data, pos)
            elif wire_type in (_FIXED64, _FIXED32):
                pos += 8 if wire_type == _FIXED64 else 4
            elif wire_type == _LENGTH_DELIMITED:
                length, pos = _varint(data, pos)
                pos += length
                if largest is None or length > largest[1]:
                    field = descriptor.fields_by_number.get(number)
                    largest = (field.name if field is not None else f"<{number}>", length)
            else:
                return largest
        except _Truncated:
            return largest
    return largest


# -- which field is malformed ----------------------------------------------------------------

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


class _Truncated(Exception):
    pass


def malformed_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """Why ``data`` is not a ``descriptor`` message, naming the first bad field (``sampling.
    stop_token_ids``, say); None if the wire format looks sound and protobuf refused it for a
    reason this scan does not see."""
    pos = 0
    while pos < len(data):
        try:
            key, pos = _varint(data, pos)
        except _Truncated:
            return f"{prefix or 'the message'} ends inside a field tag"
        number, wire_type = key >> 3, key & 7
        field = descriptor.fields_by_number.get(number)
        name = prefix + (field.name if field is not None else f"<field {number}>")
        if number == 0:
            return f"{prefix or 'the message'} has a field numbered 0"
        try:
            if wire_type == _VARINT:
                _, pos = _varint(data, pos)
            elif wire_type in (_FIXED64, _FIXED32):
                pos += 8 if wire_type == _FIXED64 else 4
                if pos > len(data):
                    raise _Truncated
            elif wire_type == _LENGTH_DELIMITED:
                length, pos = _varint(data, pos)
                if pos + length > len(data):
                    raise _Truncated
                payload, pos = data[pos : pos + length], pos + length
                why = _malformed_payload(field, payload, name) if field is not None else None
                if why is not None:
                    return why
            else:
                return f"{name} has wire type {wire_type}, which proto3 does not use"
        except _Truncated:
            return f"{name} is cut short: the message ends inside it"
    return None


def _malformed_payload(field: FieldDescriptor, payload: bytes, name: str) -> str | None:
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            payload.decode("utf-8")
        except UnicodeDecodeError:
            return f"{name} is not valid UTF-8"
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        return malformed_field(field.message_type, payload, f"{name}.")
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(data) and shift < 70:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise _Truncated
