"""Simulated requests' blocks on a real block pool, kept as the worker's KV cache manager keeps
them, so that the simulator's hits and evictions are the worker's own.

As in ``worker/kv_cache_manager.py``: a request's prefix hit is looked up on admission (never the
whole prompt: the last token is always computed); blocks are taken from the pool as tokens are
computed; a full prompt block is cached the moment it is allocated; a finished or preempted
request frees its blocks end of the chain first, so the end is evicted first. Blocks that fill
with output tokens are left uncached here: a trace names only prompt blocks, so no later request
could hit them, and a free uncached block sits in the free queue exactly where a cached one would.

With a host tier (``num_host_blocks``, the worker's ``--offload-gb``) a block the pool evicts
moves there, least recently used dropped for room, and a prompt's next blocks found there are
loaded back instead of computed, as ``worker/offload.py`` does; the events say so in the same
order (a hash in one tier at a time). The copy out is taken as done by the time of the eviction
(the worker starts it when the block is freed); the load back costs the worker time
(``SimWorker``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvswitch.cache_index.events import HOST, BlockRemoved, BlockStored
from kvswitch.worker.block_pool import BlockPool, KVBlock


class BlockTable:
    """One request's blocks, in chain order."""

    __slots__ = ("blocks", "num_cached")

    def __init__(self) -> None:
        self.blocks: list[KVBlock] = []
        self.num_cached = 0  # leading blocks whose hash is cached (or a known duplicate)


class KVBlocks:
    """The block tables of one worker's requests over its ``BlockPool``. No clock, no I/O."""

    def __init__(self, num_blocks: int, block_tokens: int, num_host_blocks: int = 0) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_tokens = block_tokens
        self.num_host_blocks = num_host_blocks
        self.host: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        if num_host_blocks:
            self.pool.on_evict, self.pool.on_cache = self._offload, self._drop_from_host

    def _offload(self, items: Sequence[tuple[int, bytes, bool]]) -> None:
        moved = [block_hash for _, block_hash, left in items if left]
        dropped = []
        for block_hash in moved:
            self.host[block_hash] = None
            if len(self.host) > self.num_host_blocks:
                dropped.append(self.host.popitem(last=False)[0])
        if moved:
            self.pool.record_event(BlockStored(tuple(moved), medium=HOST))
        if dropped:
            self.pool.record_event(BlockRemoved(tuple(dropped), medium=HOST))

    def _drop_from_host(self, block_hashes: Sequence[bytes]) -> None:
        gone = [h for h in block_hashes if self.host.pop(h, 0) is None]
        if gone:
            self.pool.record_event(BlockRemoved(tuple(gone), medium=HOST))

    def num_in_host(
        self, block_hashes: Sequence[bytes], num_on_device: int, num_tokens: int
    ) -> int:
        """How many blocks after a prompt's ``num_on_device`` device-cached ones the host tier
        holds, within its prefix hit's reach (never the last token)."""
        max_hit = (num_tokens - 1) // self.block_tokens
        host = self.host
        num = 0
        for block_hash in block_hashes[num_on_device:max_hit]:
            if block_hash not in host:
                break
            num += 1
        return num

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def lookup(self, block_hashes: Sequence[bytes], num_tokens: int) -> list[KVBlock]:
        """The cached blocks of the longest prefix hit of a prompt of ``num_tokens`` tokens.
        Will not modify the pool."""
        max_hit = (num_tokens - 1) // self.block_tokens
        get = self.pool.get_cached_block
        blocks = []
        for block_hash in block_hashes[:max_hit]:
            block = get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate(
        self,
        table: BlockTable,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        hit: Sequence[KVBlock] = (),
    ) -> bool:
        """Hold enough blocks for the first ``num_tokens`` tokens of the request (``hit``: its
        prefix hit, on admission only) and cache the full prompt blocks among them. False,
        changing nothing, when the pool has too few free blocks."""
        pool = self.pool
        num_needed = -(-num_tokens // self.block_tokens) - len(table.blocks) - len(hit)
        num_to_take = max(num_needed, 0)
        # Touching a free prefix-hit block takes it out of the free queue too.
        num_revived = sum(1 for block in hit if block.ref_cnt == 0)
        if num_to_take + num_revived > pool.num_free_blocks:
            return False
        blocks = table.blocks
        if hit:
            pool.touch(hit)
            blocks += hit
            table.num_cached = len(blocks)
        if num_to_take:
            blocks += pool.get_new_blocks(num_to_take)
        num_full = min(num_tokens // self.block_tokens, len(block_hashes))
        if num_full > table.num_cached:
            start = table.num_cached
            pool.cache_full_blocks(blocks[start:num_full], block_hashes[start:num_full])
            table.num_cached = num_full
        return True

    def num_held(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of the chain cached here."""
        return len(self.pool.cached_prefix(block_hashes))

    def take(self, block_hashes: Sequence[bytes]) -> int:
        """Blocks a peer computed, into the cache (``BlockPool.take_cached_blocks``, as
        ``LLMEngine.write_cached_blocks`` takes them); how many were new."""
        return self.pool.take_cached_blocks(block_hashes)

    def free(self, table: BlockTable) -> None:
        """Release every block of the request, end of the chain first."""
        self.pool.free_blocks(reversed(table.blocks))
        table.blocks = []
        table.num_cached = 0
