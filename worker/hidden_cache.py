"""The prompt's final hidden states cached per block, beside its KV: a hit on a prefix's KV is a
hit on its hidden states too, so prompt logprobs and embeddings skip what is cached.

The rows live in one host tensor laid out like the KV cache, ``[num_blocks, block_size,
hidden_size]``, addressed by the same block ids and slot mapping: the model runner writes every
computed token's row at its KV slot. A block's rows count only once it is full and committed,
and only for the content it held then: ``record`` notes the block's hash, and a block whose KV
now holds another hash (reused, or filled by a transfer that brought no rows) has none.
Partial blocks are never cached. With a size cap under the KV cache's, block ids past the cap
have no rows (their prompts recompute).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvswitch.worker.block_pool import KVBlock


class HiddenStateCache:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        *,
        max_bytes: int | None = None,
    ) -> None:
        """Rows for the first ``num_blocks`` block ids, fewer if ``max_bytes`` holds fewer."""
        self.block_size = block_size
        self.bytes_per_block = block_size * hidden_size * dtype.itemsize
        if max_bytes is not None:
            num_blocks = min(num_blocks, max_bytes // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(
                f"a hidden-state cache of {max_bytes:,} bytes holds no block of "
                f"{self.bytes_per_block:,} bytes"
            )
        self.num_blocks = num_blocks
        self.rows = torch.zeros(num_blocks * block_size, hidden_size, dtype=dtype)
        # The hash each block's rows belong to; None: no rows.
        self._hash_of: list[bytes | None] = [None] * num_blocks

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def write(self, slots: np.ndarray, hidden: torch.Tensor) -> None:
        """Store the rows ``hidden`` [len(slots), hidden_size] of a step's tokens at their KV
        slots (those past the cap are dropped). The blocks written have no rows until
        ``record`` names them again: what they held before is gone."""
        limit = self.num_blocks * self.block_size
        keep = slots < limit
        if not keep.all():
            slots, hidden = slots[keep], hidden[torch.from_numpy(keep).to(hidden.device)]
        hash_of = self._hash_of
        for block_id in np.unique(slots // self.block_size).tolist():
            hash_of[block_id] = None
        index = torch.from_numpy(np.ascontiguousarray(slots, np.int64))
        self.rows.index_copy_(0, index, hidden.to("cpu", self.rows.dtype))

    def record(self, block_ids: Sequence[int], block_hashes: Sequence[bytes]) -> None:
        """These blocks are full, committed, and every row of theirs was written."""
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            if block_id < self.num_blocks:
                self._hash_of[block_id] = block_hash

    def num_cached_blocks(self, blocks: Sequence[KVBlock]) -> int:
        """How many leading blocks of a KV prefix hit have their rows here."""
        hash_of = self._hash_of
        for i, block in enumerate(blocks):
            block_id = block.block_id
            if block_id >= self.num_blocks or hash_of[block_id] != block.block_hash:
                return i
        return len(blocks)

    def read(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The rows of these blocks, back to back [len(block_ids) * block_size, hidden_size]."""
        size = self.block_size
        view = self.rows.view(self.num_blocks, size, -1)
        return view[torch.tensor(list(block_ids), dtype=torch.int64)].reshape(
            len(block_ids) * size, -1
        )
