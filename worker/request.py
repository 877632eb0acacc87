"""A request: its token stream, the hashes of its full blocks, and where it is in its life."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvswitch.cache_index.hashing import BlockHasher

if TYPE_CHECKING:
    import torch

    from kvswitch.worker.sampler import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token (or EOS) was produced
    LENGTH = "length"  # max_tokens, or the model's context length
    ABORT = "abort"  # cancelled


class Request:
    """Prompt plus generated tokens, with the chain of hashes of every full block.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache (or will be, once the step
    that was scheduled for them has run). The KV cache manager needs only the token stream; the
    scheduler and engine use the rest.
    """

    __slots__ = (
        "arrival_s",
        "block_hashes",
        "finish_reason",
        "first_token_s",
        "generator",
        "hasher",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_resumed_tokens",
        "params",
        "request_id",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        hasher: BlockHasher,
        params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must hold at least one token")
        self.request_id = request_id
        self.hasher = hasher
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = hasher.hash_blocks(self.token_ids)
        self.params = params
        self.generator = generator
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # Prompt tokens found in the prefix cache when the request was first admitted.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Trailing prompt tokens that are output produced elsewhere (a resumed stream).
        self.num_resumed_tokens = 0
        self.arrival_s = time.monotonic()
        self.first_token_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    def append_token_ids(self, token_ids: Sequence[int]) -> None:
        """Add generated tokens, hashing each block the moment it becomes full."""
        self.token_ids.extend(token_ids)
        if len(self.token_ids) // self.hasher.block_size > len(self.block_hashes):
            self.block_hashes += self.hasher.hash_blocks(self.token_ids, self.block_hashes)


class StepFailed(RuntimeError):
    """A step raised. The requests it names were aborted; every other request is intact, and
    no block keeps a hash for KV the step did not write. The cause is ``__cause__``."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"the step failed ({type(cause).__name__}: {cause})")
        self.request_ids = request_ids
