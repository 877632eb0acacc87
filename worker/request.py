"""A request's token stream and the hashes of its full blocks, as the KV cache manager sees it."""

from __future__ import annotations

from collections.abc import Sequence

from cache_index.hashing import BlockHasher


class Request:
    """Prompt plus generated tokens, with the chain of hashes of every full block.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache (or will be, once the step
    that was scheduled for them has run).
    """

    __slots__ = (
        "block_hashes",
        "hasher",
        "num_computed_tokens",
        "num_prompt_tokens",
        "request_id",
        "token_ids",
    )

    def __init__(
        self, request_id: str, prompt_token_ids: Sequence[int], hasher: BlockHasher
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must hold at least one token")
        self.request_id = request_id
        self.hasher = hasher
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = hasher.hash_blocks(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    def append_token_ids(self, token_ids: Sequence[int]) -> None:
        """Add generated tokens, hashing each block the moment it becomes full."""
        self.token_ids.extend(token_ids)
        if len(self.token_ids) // self.hasher.block_size > len(self.block_hashes):
            self.block_hashes += self.hasher.hash_blocks(self.token_ids, self.block_hashes)
