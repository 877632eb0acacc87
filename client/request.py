"""What a caller asks for, checked on the client before anything is sent.

``GenerateParams`` holds the arguments of ``generate`` / ``stream`` (one place for their defaults
and checks); ``to_request()`` turns it into the ``GenerateRequest`` the router receives.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import uuid
from collections.abc import Mapping, Sequence
from typing import TypedDict

from kvswitch.serving import check_name
from kvswitch.v1 import common_pb2, router_pb2

_UINT32_END = 1 << 32
_UINT64_END = 1 << 64
_MAX_LOGPROBS = 20
# ``generate`` reads only the whole answer: the worker sends it in chunks of this many tokens
# (the first token alone), each a message at every hop, not one a token.
WHOLE_ANSWER_STREAM_INTERVAL = 64


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of ``generate`` / ``stream`` besides ``prompt`` and ``timeout_s``
    (see ``GenerateParams`` for their meaning and defaults)."""

    prompt_token_ids: Sequence[int] | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop_token_ids: Sequence[int]
    lora: str | None
    cache_salt: str | None
    policy: str | None
    weights: Mapping[str, float] | None
    request_id: str | None
    logprobs: int | None
    prompt_logprobs: int | None
    pooling: str | None
    priority: str


# A request's priority class by name (kvswitch.v1.Priority).
PRIORITIES = {
    "interactive": common_pb2.PRIORITY_INTERACTIVE,
    "batch": common_pb2.PRIORITY_BATCH,
}


@dataclasses.dataclass(frozen=True)
class GenerateParams:
    """One generation request. Exactly one of ``prompt`` / ``prompt_token_ids`` is given."""

    prompt: str | None = None  # text, tokenized by the router
    prompt_token_ids: Sequence[int] | None = None  # or a pre-tokenized prompt
    max_tokens: int = 16  # 0 = the router's default
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    seed: int | None = None  # None = the server picks one (not reproducible)
    stop_token_ids: Sequence[int] = ()  # stop after any of these (included in the output)
    lora: str | None = None  # LoRA adapter name; None = the base model
    cache_salt: str | None = None  # prefix-cache isolation, e.g. one salt per tenant
    policy: str | None = None  # routing policy name; None = the router's default
    weights: Mapping[str, float] | None = None  # the policy's scoring weights by term name
    request_id: str | None = None  # None = a fresh uuid4 hex per request
    # Each output token's logprob and this many alternatives (0-20); None = none.
    logprobs: int | None = None
    # The same for every prompt token but the first, in the first chunk; None = none.
    prompt_logprobs: int | None = None
    # "last" or "mean": the prompt's embedding in the first chunk; None = none.
    pooling: str | None = None
    # "interactive" or "batch": on a busy worker, interactive requests start first.
    priority: str = "interactive"

    @classmethod
    def from_options(cls, prompt: str | None, options: Mapping[str, object]) -> GenerateParams:
        """``GenerateParams(prompt, **options)``, but an unknown option is a TypeError that lists
        the known ones."""
        known = {field.name for field in dataclasses.fields(cls)} - {"prompt"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown option {unknown[0]!r}; the options are {', '.join(sorted(known))}"
            )
        return cls(prompt, **options)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError(
                "pass exactly one of prompt (text) and prompt_token_ids"
                + (", not both" if self.prompt is not None else "")
            )
        if self.prompt is not None:
            if not isinstance(self.prompt, str):
                raise ValueError(f"prompt must be a str, got {type(self.prompt).__name__}")
            if not self.prompt:
                raise ValueError("prompt is empty")
            _check_utf8("prompt", self.prompt)
        if self.prompt_token_ids is not None:
            if len(self.prompt_token_ids) == 0:
                raise ValueError("prompt_token_ids is empty")
            _check_token_ids("prompt_token_ids", self.prompt_token_ids)
        _check_token_ids("stop_token_ids", self.stop_token_ids)
        if not _is_int(self.max_tokens) or not 0 <= self.max_tokens < _UINT32_END:
            raise ValueError(
                f"max_tokens must be an int >= 0 (0 means the router's default), "
                f"got {self.max_tokens!r}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _UINT64_END):
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        for term, weight in (self.weights or {}).items():
            if not math.isfinite(weight):
                raise ValueError(f"weights[{term!r}] must be a finite number, got {weight}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= _MAX_LOGPROBS):
                raise ValueError(f"{name} must be an int in [0, {_MAX_LOGPROBS}], got {value!r}")
        if self.pooling not in (None, "last", "mean"):
            raise ValueError(f"pooling must be 'last', 'mean' or None, got {self.pooling!r}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be 'interactive' or 'batch', got {self.priority!r}")
        if self.request_id is not None and not self.request_id:
            raise ValueError("request_id is empty; pass None to have one generated")
        for name in ("request_id", "lora", "cache_salt"):
            _check_name(name, getattr(self, name))

    def to_request(self) -> router_pb2.GenerateRequest:
        """The request to send; a ``request_id`` of None becomes a fresh uuid4 hex."""
        request = router_pb2.GenerateRequest(
            request_id=self.request_id if self.request_id is not None else uuid.uuid4().hex,
            sampling=common_pb2.SamplingParams(
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                seed=self.seed,
                stop_token_ids=self.stop_token_ids,
                logprobs=self.logprobs,
                prompt_logprobs=self.prompt_logprobs,
            ),
            pooling=self.pooling or "",
            priority=PRIORITIES[self.priority],
            lora=self.lora or "",
            cache_salt=self.cache_salt or "",
            routing=router_pb2.RoutingOverrides(
                policy=self.policy or "", weights=dict(self.weights or {})
            ),
        )
        if self.prompt is not None:
            request.text = self.prompt
        else:
            # NOTE: the ids as bytes, not varints: cheaper to encode here and to decode on the
            # router, which hands them on to the worker as they are.
            ids = self.prompt_token_ids or ()
            request.token_ids.ids_u32le = struct.pack(f"<{len(ids)}I", *ids)
        return request


def _check_utf8(name: str, text: str) -> None:
    """A str with a lone surrogate (from a bad decode, say) has no UTF-8 form to send."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
            f"{e.start}"
        ) from None


def _check_name(name: str, value: str | None) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {type(value).__name__}")
    check_name(name, value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(name: str, token_ids: Sequence[int]) -> None:
    for token_id in token_ids:
        if not _is_int(token_id) or not 0 <= token_id < _UINT32_END:
            raise ValueError(f"{name} must hold ints in [0, 2**32), got {token_id!r}")
