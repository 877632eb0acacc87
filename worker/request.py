"""A request: its token stream, the hashes of its full blocks, and where it is in its life; what
it asks for (``SamplingParams``), what it produces (``StepOutputs``, ``RequestOutput``), and the
checks that admit it. Nothing here imports torch: the serving process admits requests without
loading it.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvswitch.cache_index.hashing import BlockHasher

if TYPE_CHECKING:
    import torch

MAX_SEED = 2**64 - 1  # torch generators take an unsigned 64-bit seed, as the protocol does
MAX_HOLD_S = 600.0  # the longest a finished request's blocks may be held for a peer
MAX_LOGPROBS = 20  # the most alternatives a token's logprobs may list (OpenAI's top_logprobs)
POOLINGS = ("last", "mean")  # how a prompt's hidden states pool into its embedding


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature`` 0 means greedy (argmax); ``top_p`` keeps the smallest set of most likely
    tokens whose probability reaches it; ``seed`` makes a sampled request reproducible.
    ``logprobs``: give each output token's log-probability under the model (before temperature
    and top-p) and this many most likely alternatives; ``prompt_logprobs`` the same for every
    prompt token but the first. None: not asked.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        # NOTE: written so that NaN fails too.
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64 - 1], got {self.seed}")
        # A list passed by a caller would make the params unhashable; store a tuple.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bad = [t for t in self.stop_token_ids if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {bad}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


# Priority classes (kvswitch.v1.Priority): who starts first among waiting requests.
INTERACTIVE = 0
BATCH = 1
PRIORITIES = (INTERACTIVE, BATCH)


class RequestStatus(enum.Enum):
    WAITING_FOR_REMOTE_KV = "waiting for remote kv"  # holds its blocks; a transfer fills them
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token (or EOS) was produced
    LENGTH = "length"  # max_tokens, or the model's context length
    ABORT = "abort"  # cancelled


class Request:
    """Prompt plus generated tokens, with the chain of hashes of every full block.

    The tokens live in one int64 array that grows by doubling (``token_ids`` is a view of the
    filled part), so admitting a long prompt copies one buffer instead of building a list of
    Python ints. ``block_hashes`` may come precomputed (hashed where the request was admitted);
    otherwise the prompt is hashed here.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache (or will be, once the step
    that was scheduled for them has run). The KV cache manager needs only the token stream; the
    scheduler and engine use the rest.
    """

    __slots__ = (
        "_tokens",
        "arrival_s",
        "block_hashes",
        "finish_reason",
        "first_token_s",
        "generator",
        "hasher",
        "hold_s",
        "last_token_id",
        "max_num_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_hidden_rows",
        "num_preemptions",
        "num_prompt_tokens",
        "num_resumed_tokens",
        "num_tokens",
        "params",
        "pooling",
        "priority",
        "prompt_hidden",
        "request_id",
        "status",
        "stop_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        hasher: BlockHasher,
        params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
        *,
        block_hashes: list[bytes] | None = None,
    ) -> None:
        num_prompt_tokens = len(prompt_token_ids)
        if not num_prompt_tokens:
            raise ValueError(f"request {request_id!r}: the prompt must hold at least one token")
        self.request_id = request_id
        self.hasher = hasher
        # Room for a short answer up front; longer ones grow the buffer.
        self._tokens = np.empty(num_prompt_tokens + 64, np.int64)
        self._tokens[:num_prompt_tokens] = prompt_token_ids
        self.num_tokens = self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = 0
        if block_hashes is None:
            block_hashes = hasher.hash_blocks(self.token_ids)
        elif len(block_hashes) != num_prompt_tokens // hasher.block_size:
            raise ValueError(
                f"request {request_id!r}: {len(block_hashes)} block hashes for a prompt of "
                f"{num_prompt_tokens // hasher.block_size} full blocks"
            )
        self.block_hashes: list[bytes] = block_hashes
        self.last_token_id = int(self._tokens[num_prompt_tokens - 1])
        self.params = params
        self.generator = generator
        # When the request ends: at this many tokens (LENGTH), or on one of these (STOP). The
        # engine narrows both to its context length and adds the model's EOS tokens.
        self.max_num_tokens = num_prompt_tokens + (params.max_tokens if params else 1 << 62)
        self.stop_token_ids = frozenset(params.stop_token_ids if params else ())
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # Prompt tokens found in the prefix cache when the request was first admitted.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Trailing prompt tokens that are output produced elsewhere (a resumed stream).
        self.num_resumed_tokens = 0
        # Once finished, hold the cached blocks this long for a peer to copy (0: do not).
        self.hold_s = 0.0
        self.arrival_s = time.monotonic()
        self.first_token_s: float | None = None
        # Pool the prompt's final hidden states into an embedding this way (POOLINGS); None: no.
        self.pooling: str | None = None
        # INTERACTIVE (0) or BATCH (1): a batch request waits behind every interactive one.
        self.priority = INTERACTIVE
        # The prompt's final hidden states, gathered step by step (and from the hidden-state
        # cache) while prompt logprobs or an embedding wait for them; rows [0, num_hidden_rows)
        # are filled. None: the request needs none.
        self.prompt_hidden: torch.Tensor | None = None
        self.num_hidden_rows = 0

    @property
    def needs_prompt_hidden(self) -> bool:
        """Whether the request wants its prompt's hidden states: prompt logprobs or an embedding
        (its cached prefix counts only where the hidden-state cache holds that prefix's rows)."""
        return self.pooling is not None or (
            self.params is not None and self.params.prompt_logprobs is not None
        )

    @property
    def token_ids(self) -> np.ndarray:
        """Every token so far, prompt first: a view, not to be written."""
        return self._tokens[: self.num_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self._tokens[self.num_prompt_tokens : self.num_tokens].tolist()

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    def append_token(self, token_id: int) -> None:
        """``append_token_ids((token_id,))``, the decode step's fast path."""
        num_tokens = self.num_tokens
        if num_tokens == len(self._tokens):
            self.append_token_ids((token_id,))
            return
        self._tokens[num_tokens] = self.last_token_id = token_id
        self.num_tokens = num_tokens = num_tokens + 1
        if num_tokens % self.hasher.block_size == 0:
            self.block_hashes += self.hasher.hash_blocks(self.token_ids, self.block_hashes)

    def append_token_ids(self, token_ids: Sequence[int]) -> None:
        """Add generated tokens, hashing each block the moment it becomes full."""
        end = self.num_tokens + len(token_ids)
        if end > len(self._tokens):
            grown = np.empty(max(2 * len(self._tokens), end), np.int64)
            grown[: self.num_tokens] = self._tokens[: self.num_tokens]
            self._tokens = grown
        self._tokens[self.num_tokens : end] = token_ids
        self.num_tokens = end
        self.last_token_id = int(self._tokens[end - 1])
        if end // self.hasher.block_size > len(self.block_hashes):
            self.block_hashes += self.hasher.hash_blocks(self.token_ids, self.block_hashes)


def check_hold(hold_s: float) -> None:
    """ValueError unless ``hold_s`` is a lease length a request may ask for."""
    if not 0 <= hold_s <= MAX_HOLD_S:
        raise ValueError(f"a lease lasts 0 to {MAX_HOLD_S:g} s, not {hold_s:g}")


def check_prompt(
    prompt_token_ids: np.ndarray, vocab_size: int, max_model_len: int, num_resumed_tokens: int = 0
) -> None:
    """ValueError, saying what is wrong, unless the prompt can run on a model with this vocabulary
    and context length. Array work only: a 128K-token prompt takes tens of microseconds."""
    num_tokens = len(prompt_token_ids)
    if not num_tokens:
        raise ValueError("the prompt is empty")
    if prompt_token_ids.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {prompt_token_ids.dtype} values")
    low, high = int(prompt_token_ids.min()), int(prompt_token_ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if not 0 <= num_resumed_tokens < num_tokens:
        raise ValueError(
            f"num_resumed_tokens must be in [0, {num_tokens}) for a prompt of {num_tokens} "
            f"tokens, got {num_resumed_tokens}"
        )
    if num_tokens >= max_model_len:
        raise ValueError(
            f"the prompt has {num_tokens} tokens; this worker's context length is {max_model_len}"
        )


@dataclass(frozen=True, slots=True)
class PullSlots:
    """The blocks an engine holds for a request whose prompt's KV a transfer brings from a peer.

    The chain's first ``num_cached_blocks`` blocks are cached here already (held for the
    request); ``block_ids[i]`` awaits the KV of the chain's block ``num_cached_blocks + i``.
    ``refused`` says why no block was held: the request then computes its prompt here.
    """

    num_cached_blocks: int
    block_ids: list[int]
    refused: str = ""


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One token's log-probability under the model, and the most likely tokens at its position
    with theirs (most likely first; as many as the request asked)."""

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class Logprobs:
    """The log-probabilities of a run of tokens, in columns: token ``i`` has ``logprobs[i]``,
    and its position's most likely tokens are ``top_token_ids[i]`` with ``top_logprobs[i]``.
    Arrays, not an object per token: a prompt scored whole has thousands."""

    logprobs: np.ndarray  # float32 [n]
    top_token_ids: np.ndarray  # int64 [n, num_top]
    top_logprobs: np.ndarray  # float32 [n, num_top]

    def __len__(self) -> int:
        return len(self.logprobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Logprobs) and all(
            np.array_equal(a, b)
            for a, b in (
                (self.logprobs, other.logprobs),
                (self.top_token_ids, other.top_token_ids),
                (self.top_logprobs, other.top_logprobs),
            )
        )

    @property
    def num_top(self) -> int:
        return self.top_token_ids.shape[1]

    def tokens(self) -> list[TokenLogprobs]:
        """One ``TokenLogprobs`` per token."""
        return [
            TokenLogprobs(logprob, tuple(ids), tuple(values))
            for logprob, ids, values in zip(
                self.logprobs.tolist(),
                self.top_token_ids.tolist(),
                self.top_logprobs.tolist(),
                strict=True,
            )
        ]

    @classmethod
    def join(cls, runs: Sequence[Logprobs]) -> Logprobs:
        """The runs one after the other (each with as many alternatives)."""
        if len(runs) == 1:
            return runs[0]
        return cls(
            np.concatenate([r.logprobs for r in runs]),
            np.concatenate([r.top_token_ids for r in runs]),
            np.concatenate([r.top_logprobs for r in runs]),
        )


@dataclass(slots=True)
class RequestOutput:
    """What one request produced in one step. ``ttft_s``, ``num_prompt_tokens`` and
    ``num_cached_tokens`` are set on the output that carries its first token only, and so are
    ``prompt_logprobs`` (one per prompt token but the first) and ``embedding`` when asked."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    ttft_s: float | None = None  # set on the step that produced the first token
    logprobs: Logprobs | None = None  # of the new tokens, when asked
    prompt_logprobs: Logprobs | None = None
    embedding: list[float] | None = None


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A request's figures as of its first token."""

    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache on admission
    ttft_s: float


@dataclass(slots=True)
class StepOutputs:
    """What one step produced, in columns: ``request_ids[i]`` produced ``token_ids[i]``, each
    request once.

    The few requests that produced their first token (``first``) or finished (``finished``) are
    listed apart, so a step of decodes builds no object per request; so are the token logprobs,
    prompt logprobs and embeddings of the requests that asked for them. Iterating gives one
    ``RequestOutput`` per request, in order.
    """

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    first: dict[str, FirstToken] = field(default_factory=dict)
    finished: dict[str, FinishReason] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)
    embeddings: dict[str, list[float]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.request_ids)

    def __iter__(self) -> Iterator[RequestOutput]:
        first, finished, logprobs = self.first, self.finished, self.logprobs
        for request_id, token_id in zip(self.request_ids, self.token_ids, strict=True):
            reason = finished.get(request_id)
            output = RequestOutput(request_id, [token_id], reason is not None, reason)
            figures = first.get(request_id)
            if figures is not None:
                output.num_prompt_tokens = figures.num_prompt_tokens
                output.num_cached_tokens = figures.num_cached_tokens
                output.ttft_s = figures.ttft_s
                output.prompt_logprobs = self.prompt_logprobs.get(request_id)
                output.embedding = self.embeddings.get(request_id)
            if logprobs:
                output.logprobs = logprobs.get(request_id)
            yield output


class StepFailed(RuntimeError):
    """A step raised. The requests it names were aborted; every other request is intact, and
    no block keeps a hash for KV the step did not write. The cause is ``__cause__``."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"the step failed ({type(cause).__name__}: {cause})")
        self.request_ids = request_ids
