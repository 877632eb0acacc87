"""The block pool: every KV block of a worker, the free queue, and the hash -> block map.

All blocks exist from the start. A block with ref count 0 sits in the free queue, ordered by
eviction priority: the head is taken first. Freed blocks join at the tail, so the queue runs from
least to most recently used. A free block may still hold a cached hash: it can be revived by a
prefix hit ("touch") until it reaches the head and is taken, which evicts it.

The pool does no I/O. Every change to the set of cached hashes appends a cache event that
``take_events()`` hands on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from kvswitch.cache_index.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent


class KVBlock:
    """One physical KV block. Its links make the free queue without another container."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set when the block is full and cached; cleared when it is evicted.
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        name = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={name})"


class FreeBlockQueue:
    """An intrusive doubly linked list of blocks: O(1) pop from the head, append at the tail and
    removal from the middle, with no object created per operation.

    Two sentinel blocks bound the list so that no operation needs a special case for the ends.
    """

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft_n(self, num_blocks: int) -> list[KVBlock]:
        """Unlink the first ``num_blocks`` blocks in one pass and return them in queue order."""
        if num_blocks > self.num_free_blocks:
            raise IndexError(f"cannot pop {num_blocks} blocks: {self.num_free_blocks} are free")
        blocks = []
        append = blocks.append
        block = self._head.next_free
        for _ in range(num_blocks):
            append(block)
            next_block = block.next_free
            block.prev_free = block.next_free = None
            block = next_block
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= num_blocks
        return blocks

    def append_n(self, blocks: Sequence[KVBlock]) -> None:
        """Append ``blocks`` at the tail, in order."""
        last = self._tail.prev_free
        for block in blocks:
            if block.prev_free is not None:
                raise ValueError(f"block {block.block_id} is already in the free queue")
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        """Free block ids from head (evicted first) to tail."""
        return [block.block_id for block in self]


class BlockPool:
    """Owns the blocks, their ref counts and the cache of full blocks by hash.

    Invariants (``check_integrity`` verifies them):
    - the free queue holds exactly the blocks with ref count 0, each once;
    - every cached block is in the hash map under its hash, and nothing else is;
    - replaying the events taken so far gives the set of hashes in the map.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # One block per cached hash; identical full blocks beyond the first wait in _duplicates.
        self._hash_to_block: dict[bytes, KVBlock] = {}
        self._duplicates: dict[bytes, list[KVBlock]] = {}
        self._events: list[CacheEvent] = []
        # Set by a host-memory tier (worker/offload.py), which the pool tells, as they happen:
        # of blocks taken for reuse that held a hash ([block id, hash, whether the hash left the
        # cache]), before anything can write them; of cached blocks freed (candidates to copy
        # out); and of hashes newly cached here (a hash is in one tier at a time), before the
        # event that says so.
        self.on_evict: Callable[[list[tuple[int, bytes, bool]]], None] | None = None
        self.on_free: Callable[[list[KVBlock]], None] | None = None
        self.on_cache: Callable[[list[bytes]], None] | None = None

    # -- queries --------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by running requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        """The cached block named ``block_hash``, if any. Does not modify the pool."""
        return self._hash_to_block.get(block_hash)

    def cached_prefix(self, block_hashes: Sequence[bytes]) -> list[KVBlock]:
        """The cached blocks of the chain's leading cached run. Does not modify the pool."""
        blocks = []
        get = self._hash_to_block.get
        for block_hash in block_hashes:
            block = get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cached_block_hashes(self) -> list[bytes]:
        """Every hash cached in the pool, each once."""
        return list(self._hash_to_block)

    # -- actions --------------------------------------------------------------------------------

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving any waiting in the free queue."""
        free_queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, evicting cached ones."""
        if not 0 <= num_blocks <= self.free_queue.num_free_blocks:
            raise ValueError(
                f"cannot take {num_blocks} blocks: only {self.free_queue.num_free_blocks} are free"
            )
        blocks = self.free_queue.popleft_n(num_blocks)
        on_evict = self.on_evict
        held = [(b.block_id, b.block_hash) for b in blocks if b.block_hash is not None]
        self.uncache_blocks(blocks)
        if on_evict is not None and held:
            cached = self._hash_to_block
            on_evict([(block_id, h, h not in cached) for block_id, h in held])
        for block in blocks:
            block.ref_cnt = 1
        return blocks

    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[bytes],
        tokens: Sequence[int] | None = None,
        parent: bytes | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Cache consecutive full blocks of one chain, ``blocks[i]`` named ``block_hashes[i]``.
        A hash that is already cached in another block is recorded as a duplicate and emits no
        event; each run of new hashes is one ``BlockStored``. With ``tokens`` (the blocks'
        tokens, concatenated), ``parent`` (the hash before ``block_hashes[0]``), ``lora`` and
        ``cache_salt``, each event says them too (``BlockStored.token_ids``)."""
        if not self.enable_caching:
            return
        runs: list[list[int]] = []  # [start, end) of each run of newly cached hashes
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            if block.block_hash is not None:
                raise ValueError(f"block {block.block_id} is already cached")
            block.block_hash = block_hash
            if block_hash in self._hash_to_block:
                # NOTE: block tables are append-only, so an identical block computed by another
                # request stays until freed; the index already knows this hash.
                self._duplicates.setdefault(block_hash, []).append(block)
                continue
            self._hash_to_block[block_hash] = block
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
        if runs and self.on_cache is not None:
            self.on_cache([h for start, end in runs for h in block_hashes[start:end]])
        if tokens is None:
            for start, end in runs:
                self._events.append(BlockStored(tuple(block_hashes[start:end])))
            return
        size = len(tokens) // len(blocks)
        for start, end in runs:
            self._events.append(
                BlockStored(
                    tuple(block_hashes[start:end]),
                    tuple(int(t) for t in tokens[start * size : end * size]),
                    block_hashes[start - 1] if start else parent,
                    lora,
                    cache_salt,
                )
            )

    def uncache_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Forget the hashes of ``blocks`` (their KV is not what the hash names), keeping the
        blocks where they are. A hash another block also holds stays cached there."""
        removed: list[bytes] = []
        hash_to_block, duplicates = self._hash_to_block, self._duplicates
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                continue
            if block_hash in duplicates:
                self._evict_copy(block)
            else:
                del hash_to_block[block_hash]
                removed.append(block_hash)
                block.block_hash = None
        if removed:
            self._events.append(BlockRemoved(tuple(removed)))

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks that reach 0 join the tail in this order."""
        released = []
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} is already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        self.free_queue.append_n(released)
        if self.on_free is not None and released:
            cached = [block for block in released if block.block_hash is not None]
            if cached:
                self.on_free(cached)

    def take_cached_blocks(
        self,
        block_hashes: Sequence[bytes],
        write: Callable[[list[int], list[KVBlock]], None] | None = None,
    ) -> int:
        """Cache blocks computed elsewhere as a request that computed and then freed them would
        have left them (evictable, the end of the chain first): hashes cached here already are
        skipped, the new ones take free blocks (evicting), the leading ones first while free
        blocks last. ``write(positions in block_hashes, blocks)`` puts their KV in before they
        are cached; if it raises, nothing is cached. Returns how many blocks were new."""
        held = [b for b in map(self.get_cached_block, block_hashes) if b is not None]
        new = [i for i, h in enumerate(block_hashes) if self.get_cached_block(h) is None]
        # NOTE: held while new blocks are taken, so that taking them cannot evict these.
        self.touch(held)
        try:
            new = new[: self.num_free_blocks]
            blocks = self.get_new_blocks(len(new))
            if write is not None:
                try:
                    write(new, blocks)
                except BaseException:
                    self.free_blocks(blocks)  # uncached: nothing names their half-written KV
                    raise
            self.cache_full_blocks(blocks, [block_hashes[i] for i in new])
            self.free_blocks(reversed(blocks))
        finally:
            self.free_blocks(reversed(held))
        return len(new)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        if not self.enable_caching:
            return True
        for block in self.blocks:
            block.block_hash = None
        self._hash_to_block.clear()
        self._duplicates.clear()
        self._events.append(AllBlocksCleared())
        return True

    def record_event(self, event: CacheEvent) -> None:
        """Queue an event of another tier of this worker's cache in order with the pool's own."""
        self._events.append(event)

    def take_events(self) -> list[CacheEvent]:
        """Hand over the events queued since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # -- internals ------------------------------------------------------------------------------

    def _evict_copy(self, block: KVBlock) -> None:
        """Evict one of several blocks holding the same hash: the hash stays cached."""
        block_hash = block.block_hash
        block.block_hash = None
        duplicates = self._duplicates[block_hash]
        if self._hash_to_block[block_hash] is block:
            self._hash_to_block[block_hash] = duplicates.pop()
        else:
            duplicates.remove(block)
        if not duplicates:
            del self._duplicates[block_hash]

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the pool is broken."""
        free_ids = [block.block_id for block in self.free_queue]
        assert len(free_ids) == len(set(free_ids)), f"a block is free-listed twice: {free_ids}"
        assert len(free_ids) == self.free_queue.num_free_blocks, "free count out of sync"
        zero_ref = {block.block_id for block in self.blocks if block.ref_cnt == 0}
        assert set(free_ids) == zero_ref, (
            f"free queue {sorted(free_ids)} != blocks with ref 0 {sorted(zero_ref)}"
        )
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref {block.ref_cnt}"
        mapped: dict[int, bytes] = {}
        for block_hash, block in self._hash_to_block.items():
            mapped[block.block_id] = block_hash
            for duplicate in self._duplicates.get(block_hash, ()):
                assert duplicate.block_id not in mapped, f"block {duplicate.block_id} mapped twice"
                mapped[duplicate.block_id] = block_hash
        assert set(self._duplicates) <= set(self._hash_to_block), "duplicate of an uncached hash"
        for block in self.blocks:
            in_map = mapped.get(block.block_id)
            assert in_map == block.block_hash, (
                f"block {block.block_id}: hash {block.block_hash!r} vs map {in_map!r}"
            )
