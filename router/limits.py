"""What the router takes from a client: one request's size and values, and how many streams one
client may hold open.

``check_request`` refuses a request before it is tokenized, hashed or routed, with a
``ValueError`` that names the field (``sampling.top_p must be ...``); the servicer answers it
with INVALID_ARGUMENT. The prompt's length is checked once it is tokens (``check_prompt_length``).
``ClientStreams`` counts open streams per client. No I/O here.
"""

from __future__ import annotations

import dataclasses
import math

from kvswitch.router.policy import POLICIES
from kvswitch.serving import check_name
from kvswitch.v1 import router_pb2

# What a request holds besides its prompt, at most: names, sampling, stop ids, routing weights.
MESSAGE_OVERHEAD_BYTES = 16 << 10
# The HTTP API's largest request body by default (--max-body-bytes). A prompt of the default
# max_prompt_tokens (131072) spelled as JSON takes about 8 bytes a token at worst: a token id of
# six digits and its comma, or a character outside ASCII escaped as \uXXXX. That is 1 MiB; twice
# that leaves room for a chat's framing and for the odd longer token.
DEFAULT_MAX_BODY_BYTES = 2 << 20


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """The most one client request may ask for; 0 = no limit (the message size excepted)."""

    max_prompt_tokens: int = 131072
    max_output_tokens: int = 32768  # the most sampling.max_tokens may be
    max_stop_token_ids: int = 256
    max_streams_per_client: int = 1024  # open Generate streams per client address
    max_message_bytes: int = 4 << 20  # a larger request is refused, with its size
    request_overrides: bool = True  # whether a request may set routing.policy / routing.weights

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 0:
                raise ValueError(f"{field.name} must be >= 0, got {getattr(self, field.name)}")
        if self.max_message_bytes < 1024:
            raise ValueError(
                f"max_message_bytes must be at least 1024, got {self.max_message_bytes}"
            )
        # NOTE: a prompt of max_prompt_tokens must fit, as token ids (4 bytes each) at least.
        needed = 4 * self.max_prompt_tokens + MESSAGE_OVERHEAD_BYTES
        if self.max_prompt_tokens and self.max_message_bytes < needed:
            raise ValueError(
                f"max_message_bytes {self.max_message_bytes} cannot hold a prompt of "
                f"max_prompt_tokens {self.max_prompt_tokens} token ids; it needs at least {needed}"
            )


def check_request(request: router_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """ValueError naming the first field of ``request`` that is out of bounds or ill-formed."""
    for name in ("request_id", "lora", "cache_salt"):
        check_name(name, getattr(request, name))
    sampling = request.sampling
    if limits.max_output_tokens and sampling.max_tokens > limits.max_output_tokens:
        raise ValueError(
            f"sampling.max_tokens must be at most {limits.max_output_tokens} on this router, "
            f"got {sampling.max_tokens}"
        )
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        raise ValueError(
            f"sampling.temperature must be a finite number >= 0 (0 = greedy), "
            f"got {sampling.temperature}"
        )
    # NOTE: written so that NaN fails too; 0 means the default (1).
    if not 0 <= sampling.top_p <= 1:
        raise ValueError(
            f"sampling.top_p must be in (0, 1] (0 = the default), got {sampling.top_p}"
        )
    num_stops = len(sampling.stop_token_ids)
    if limits.max_stop_token_ids and num_stops > limits.max_stop_token_ids:
        raise ValueError(
            f"sampling.stop_token_ids may hold at most {limits.max_stop_token_ids} ids on this "
            f"router, got {num_stops}"
        )
    routing = request.routing
    if not limits.request_overrides and (routing.policy or routing.weights):
        field = "routing.policy" if routing.policy else "routing.weights"
        raise ValueError(
            f"{field}: this router takes no per-request routing overrides "
            "(--no-request-overrides); leave routing empty"
        )
    if routing.policy and routing.policy not in POLICIES:
        raise ValueError(
            f"routing.policy: unknown routing policy {routing.policy!r}; choose from "
            f"{', '.join(POLICIES)} (or leave it empty)"
        )
    for name, value in routing.weights.items():
        if not math.isfinite(value):
            raise ValueError(f"routing.weights[{name!r}] must be a finite number, got {value}")


def check_prompt_length(num_tokens: int, field: str, limits: RequestLimits) -> None:
    """ValueError if a prompt of ``num_tokens`` (given as ``field``) is longer than allowed."""
    if limits.max_prompt_tokens and num_tokens > limits.max_prompt_tokens:
        raise ValueError(
            f"{field}: the prompt has {num_tokens} tokens; this router takes at most "
            f"{limits.max_prompt_tokens}"
        )


# The most output tokens a request weighs on a worker that does not say its context (an older
# worker: ``WorkerInfo.max_model_len`` 0). The weight only steers routing (the worker stops at
# its own context); a client's max_tokens, up to 2^32 - 1 on a router without a limit, would
# make that worker look busy for ever.
MAX_UNKNOWN_OUTPUT_TOKENS = 32768


def output_budget(max_tokens: int, num_prompt_tokens: int, max_model_len: int) -> int:
    """The most output tokens a request can get: its ``max_tokens``, cut to what the model's
    context leaves after the prompt (``max_model_len`` 0 = unknown, no cut)."""
    if not max_model_len:
        return max_tokens
    return max(min(max_tokens, max_model_len - num_prompt_tokens), 1)


def output_charge(max_tokens: int, num_prompt_tokens: int, max_model_len: int) -> int:
    """The output tokens a request weighs on its worker's outstanding work, from the router's
    view: ``output_budget``, and at most ``MAX_UNKNOWN_OUTPUT_TOKENS`` where the worker's
    context is unknown (``max_model_len`` 0). Never what a client asked for past that."""
    num_tokens = output_budget(max_tokens, num_prompt_tokens, max_model_len)
    return num_tokens if max_model_len else min(num_tokens, MAX_UNKNOWN_OUTPUT_TOKENS)


class ClientStreams:
    """Open streams per client; ``open`` refuses one past ``max_per_client`` (0 = no limit)."""

    def __init__(self, max_per_client: int) -> None:
        self.max_per_client = max_per_client
        self._client_to_open: dict[str, int] = {}

    def open(self, client: str) -> bool:
        """Count a new stream of ``client``; False (and nothing counted) if it has too many."""
        num_open = self._client_to_open.get(client, 0)
        if self.max_per_client and num_open >= self.max_per_client:
            return False
        self._client_to_open[client] = num_open + 1
        return True

    def close(self, client: str) -> None:
        num_open = self._client_to_open.pop(client) - 1
        if num_open:
            self._client_to_open[client] = num_open

    def num_open(self, client: str) -> int:
        return self._client_to_open.get(client, 0)


def client_of(peer: str) -> str:
    """The client a stream belongs to: its address without the port (``ipv4:10.0.0.7:51234``
    -> ``ipv4:10.0.0.7``); a Unix socket peer as it is."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rsplit(':', 1)[0]}"
    return peer
