"""The KV cache manager: block tables of running requests, on top of the block pool.

The scheduler talks to this class only; it never sees the pool. A new request is admitted as::

    blocks, num_cached = manager.get_computed_blocks(request)      # prefix hit, pool unchanged
    new_blocks = manager.allocate_slots(request, num_new, blocks)   # None: not enough free blocks

and every later step calls ``allocate_slots(request, num_new)`` for the tokens it will compute.
``free(request)`` returns its blocks, end of the chain first, so that the end is evicted first.

A finished request's cached blocks may be held under a lease (``hold``) until a peer worker has
copied them (disaggregated prefill): a leased block cannot be evicted. ``release`` lets them go,
and so does ``release_expired`` once the lease's time is up, so that a peer that never comes
cannot pin them for long.

A request whose prompt's KV comes from a peer (disaggregated prefill) holds its blocks before
the transfer writes into them::

    slots = manager.allocate_for_pull(request)   # the whole prompt's blocks, held; ids out
    manager.pull_targets(hashes) -> fill(blocks)  # the transfer's writes, by hash
    manager.commit_pull(request)                  # filled leading run cached; rest computed

A transfer that writes while steps go on (a NIXL read) brackets its writes with
``begin_landing(transfer, targets, hashes)`` and ``end_landing(transfer, written)``: the blocks
stay held by it until it ends, even if their request is aborted meanwhile.

Its blocks never sit in the free queue while it waits, so nothing evicts them; the ones the
transfer did not fill are never cached: the request computes them like any uncached block.

Blocks are cached when they are allocated, before the forward pass writes their KV, so that
requests in the same step can share them. The step then settles them: ``commit()`` once the
forward pass wrote them, or ``discard_uncommitted()`` when it failed, which takes their hashes
back (publishing BlockRemoved) so that no later request reuses KV that was never written.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvswitch.cache_index.events import CacheEvent
from kvswitch.worker.block_pool import BlockPool, KVBlock
from kvswitch.worker.block_table import BlockTables
from kvswitch.worker.request import PullSlots, Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Prompt tokens looked up in the cache and how many of them hit."""

    num_query_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


@dataclass(slots=True)
class _Lease:
    blocks: list[KVBlock]
    hold_s: float  # how long each extension keeps them
    until_s: float  # time.monotonic() at which they are let go


@dataclass(slots=True)
class _Pull:
    """The blocks of a request that await a transfer: its table's ``first`` block on."""

    first: int
    blocks: list[KVBlock]
    hashes: list[bytes]


class KVCacheManager:
    """Maps each running request to its blocks and caches every block the moment it is full."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Whether stored events carry their blocks' tokens (for vLLM-format events).
        self.record_tokens = False
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        # A host-memory tier under the pool (worker/offload.py), checked with it; None: none.
        self.tier: Any = None
        self.stats = PrefixCacheStats()
        self._req_to_blocks: dict[str, list[KVBlock]] = {}
        # The same tables as block ids, kept in one array for the model runner (block_table.py).
        self.block_tables = BlockTables()
        # How many leading blocks of each request are cached (or known duplicates).
        self._req_to_num_cached_blocks: dict[str, int] = {}
        # Blocks cached since the last commit, with the hash each got: their KV is not written yet.
        self._uncommitted: list[tuple[KVBlock, bytes]] = []
        # Blocks held for a peer, by lease id, with when the lease runs out (time.monotonic).
        self._leases: dict[str, _Lease] = {}
        # Requests whose blocks await a transfer; each awaited hash's blocks, in pull order; the
        # awaited blocks a transfer has written (their KV is there, not yet cached).
        self._pulls: dict[str, _Pull] = {}
        self._hash_to_awaiting: dict[bytes, list[KVBlock]] = {}
        self._filled: set[int] = set()
        # Awaited blocks a transfer is writing now, with their hashes, by transfer: each holds a
        # reference until the transfer ends, so that an aborted request cannot free them to be
        # reused under the write.
        self._landing: dict[Hashable, list[tuple[KVBlock, bytes]]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""
        return self.block_tables.block_ids(request_id)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a new request, and how many tokens it covers.

        Will not modify the pool. The hit never covers the whole prompt: the last token is always
        computed, because it produces the first logits.
        """
        if not self.enable_caching:
            return [], 0
        # NOTE: (n - 1) // B keeps at least one token to compute even when n is a multiple of B.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = self.pool.cached_prefix(request.block_hashes[:max_hit_blocks])
        return blocks, len(blocks) * self.block_size

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed."""
        return self._num_blocks_to_take(request, num_new_tokens, computed_blocks) is not None

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` and return the new blocks.

        ``computed_blocks`` is the prefix hit from ``get_computed_blocks`` (new requests only).
        Returns None, changing nothing, when the pool has too few free blocks. Blocks that will be
        full once this step has computed its tokens are cached now, so that requests in the same
        batch can already share them::

            | computed (cache or earlier steps) | num_new_tokens |  empty slots  |
            |<------------- cached: every full block ----------->|
        """
        req_blocks = self._req_to_blocks.get(request.request_id)
        if req_blocks is not None and not computed_blocks and num_new_tokens > 0:
            # NOTE: the common case, a decode: its token fits in a block it holds and fills no
            # block, so there is nothing to take and nothing to cache.
            num_after = request.num_computed_tokens + num_new_tokens
            in_held_blocks = num_after <= len(req_blocks) * self.block_size
            known = num_after <= request.num_tokens  # else the slow path says why not
            num_cached = self._req_to_num_cached_blocks[request.request_id]
            fills_none = not self.enable_caching or num_after // self.block_size <= num_cached
            if in_held_blocks and known and fills_none:
                return []
        num_to_take = self._num_blocks_to_take(request, num_new_tokens, computed_blocks)
        if num_to_take is None:
            return None
        request_id = request.request_id
        if req_blocks is None:
            # NOTE: counted on admission, not lookup, so a refused and retried request counts
            # once; a preempted one readmitted (often hitting its own blocks) is not counted again.
            if request.num_preemptions == 0:
                self.stats.num_query_tokens += request.num_tokens
                self.stats.num_hit_tokens += len(computed_blocks) * self.block_size
            req_blocks = self._req_to_blocks[request_id] = []
            self._req_to_num_cached_blocks[request_id] = 0
        if computed_blocks:
            self.pool.touch(computed_blocks)
            req_blocks.extend(computed_blocks)
            self._req_to_num_cached_blocks[request_id] = len(req_blocks)
        new_blocks = self.pool.get_new_blocks(num_to_take)
        req_blocks.extend(new_blocks)
        self.block_tables.append(
            request_id, [block.block_id for block in (*computed_blocks, *new_blocks)]
        )
        num_computed_after = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        self._cache_full_blocks(request, req_blocks, num_computed_after // self.block_size)
        return new_blocks

    def holds_blocks(self, request: Request) -> bool:
        return request.request_id in self._req_to_blocks

    def num_cached_blocks(self, request: Request) -> int:
        """How many leading blocks of the request's table are cached."""
        return self._req_to_num_cached_blocks.get(request.request_id, 0)

    def free(self, request: Request) -> None:
        """Release the request's blocks, end of the chain first. Unknown requests are ignored."""
        self._forget_pull(request.request_id)
        blocks = self._req_to_blocks.pop(request.request_id, None)
        self._req_to_num_cached_blocks.pop(request.request_id, None)
        self.block_tables.release(request.request_id)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    # -- pulls ---------------------------------------------------------------------------------

    def allocate_for_pull(self, request: Request) -> PullSlots:
        """Hold blocks for the whole prompt of a new request whose KV a transfer brings: the
        cached prefix found here, then new blocks. The new ones for the full blocks a prefix hit
        may cover (all but the last token's) await the transfer; the rest the request computes.
        Refused (``PullSlots.refused``, the pool unchanged) when the pool cannot hold the whole
        prompt without evicting a held block: a pull never takes another request's blocks, and
        a request holding part of its prompt could wait for ever for the rest::

            |  cached here  |  awaiting the transfer  | computed |
            |<-- num_cached_blocks -->|<-- block_ids -->|  tail  |
        """
        request_id = request.request_id
        if request_id in self._req_to_blocks:
            raise ValueError(f"request {request_id!r} holds blocks already")
        if not self.enable_caching:
            return PullSlots(0, [], "prefix caching is off on this worker")
        cached, _ = self.get_computed_blocks(request)
        num_required = -(-request.num_tokens // self.block_size)
        num_to_take = num_required - len(cached)
        num_revived = sum(1 for block in cached if block.ref_cnt == 0)
        if num_to_take + num_revived > self.pool.num_free_blocks:
            return PullSlots(
                0,
                [],
                f"no room: the prompt needs {num_to_take + num_revived} free blocks, "
                f"{self.pool.num_free_blocks} are",
            )
        self.pool.touch(cached)
        new_blocks = self.pool.get_new_blocks(num_to_take)
        blocks = self._req_to_blocks[request_id] = [*cached, *new_blocks]
        self._req_to_num_cached_blocks[request_id] = len(cached)
        self.block_tables.append(request_id, [block.block_id for block in blocks])
        end = (request.num_tokens - 1) // self.block_size  # the last token is always computed
        first = len(cached)
        pull = _Pull(first, new_blocks[: end - first], request.block_hashes[first:end])
        if pull.blocks:
            self._pulls[request_id] = pull
            for block, block_hash in zip(pull.blocks, pull.hashes, strict=True):
                self._hash_to_awaiting.setdefault(block_hash, []).append(block)
        return PullSlots(len(cached), [block.block_id for block in pull.blocks])

    def is_awaiting(self, request: Request) -> bool:
        return request.request_id in self._pulls

    def pull_targets(self, block_hashes: Sequence[bytes]) -> dict[int, KVBlock]:
        """For the hashes a pull awaits and no transfer has written yet: position in
        ``block_hashes`` -> a block awaiting it. Does not modify anything. Any block awaiting a
        hash may take its KV: the hash names the KV, whichever request's transfer brings it."""
        targets: dict[int, KVBlock] = {}
        filled = self._filled
        taken = {block.block_id for landed in self._landing.values() for block, _ in landed}
        for i, block_hash in enumerate(block_hashes):
            for block in self._hash_to_awaiting.get(block_hash, ()):
                if block.block_id not in filled and block.block_id not in taken:
                    targets[i] = block
                    taken.add(block.block_id)
                    break
        return targets

    def fill(self, blocks: Iterable[KVBlock]) -> None:
        """A transfer wrote the KV of these ``pull_targets`` blocks."""
        self._filled.update(block.block_id for block in blocks)

    def begin_landing(
        self, transfer: Hashable, targets: dict[int, KVBlock], block_hashes: Sequence[bytes]
    ) -> None:
        """A transfer writes ``pull_targets(block_hashes)`` from now until ``end_landing``:
        each block held by one more reference meanwhile, and a target of no other transfer."""
        if transfer in self._landing:
            raise ValueError(f"transfer {transfer!r} is landing already")
        self.pool.touch(targets.values())
        self._landing[transfer] = [(block, block_hashes[i]) for i, block in targets.items()]

    def end_landing(self, transfer: Hashable, written: bool) -> int:
        """The transfer is over, its blocks' KV ``written`` or not: those still awaited (their
        request not gone meanwhile) are ``fill``-ed if written, and each lets its reference go.
        Returns how many were filled."""
        landed = self._landing.pop(transfer)
        filled = [
            block
            for block, block_hash in landed
            if written and any(b is block for b in self._hash_to_awaiting.get(block_hash, ()))
        ]
        self.fill(filled)
        self.pool.free_blocks(reversed([block for block, _ in landed]))
        return len(filled)

    @property
    def num_landing(self) -> int:
        """Transfers writing into awaited blocks now."""
        return len(self._landing)

    def commit_pull(self, request: Request, num_written_blocks: int = 0) -> int:
        """The transfer for ``request`` is over: cache the leading run of its awaited blocks
        that hold their KV (written through ``fill``, or among the first ``num_written_blocks``,
        which a transport wrote by block id), as the blocks of a computed prefix. The others stay
        the request's, uncached: it computes them. Returns how many blocks were cached."""
        request_id = request.request_id
        if request_id not in self._req_to_blocks:
            raise ValueError(f"request {request_id!r} holds no blocks for a pull")
        pull = self._pulls.get(request_id)
        num_landed = 0
        if pull is not None:
            for i, block in enumerate(pull.blocks):
                if i >= num_written_blocks and block.block_id not in self._filled:
                    break
                num_landed += 1
            self._forget_pull(request_id)
            landed, hashes = pull.blocks[:num_landed], pull.hashes[:num_landed]
            if self.record_tokens and landed:
                size, first = self.block_size, pull.first
                tokens = request.token_ids[first * size : (first + num_landed) * size]
                parent = request.block_hashes[first - 1] if first else None
                hasher = request.hasher
                self.pool.cache_full_blocks(
                    landed, hashes, tokens, parent, hasher.lora, hasher.cache_salt
                )
            else:
                self.pool.cache_full_blocks(landed, hashes)
            self._req_to_num_cached_blocks[request_id] = pull.first + num_landed
        num_cached = self._req_to_num_cached_blocks[request_id]
        # NOTE: counted here, not on admission: the request holds its blocks already then.
        self.stats.num_query_tokens += request.num_tokens
        self.stats.num_hit_tokens += num_cached * self.block_size
        return num_landed

    # -- leases --------------------------------------------------------------------------------

    def hold(self, request: Request, lease_id: str, now_s: float, hold_s: float) -> int:
        """Keep the request's cached blocks from eviction for ``hold_s`` from ``now_s`` (or
        until ``release``), under ``lease_id``; call before ``free(request)``. Returns how many
        blocks are held. A lease id already held is released first."""
        blocks = self._req_to_blocks.get(request.request_id, [])
        held = blocks[: self._req_to_num_cached_blocks.get(request.request_id, 0)]
        self.hold_blocks(held, lease_id, now_s, hold_s)
        return len(held)

    def hold_blocks(
        self, blocks: list[KVBlock], lease_id: str, now_s: float, hold_s: float
    ) -> None:
        """``hold`` for cached blocks a peer copies: the lease holds exactly ``blocks`` from now
        on, for ``hold_s`` from ``now_s``; a lease of that id held already gives way to it, its
        end kept if later."""
        old = self._leases.pop(lease_id, None)
        # NOTE: taken before the old lease lets go, so that blocks both hold stay out of the
        # free queue and keep their place in the eviction order.
        self.pool.touch(blocks)
        until_s = now_s + hold_s
        if old is not None:
            self.pool.free_blocks(reversed(old.blocks))
            until_s = max(until_s, old.until_s)
            hold_s = max(hold_s, old.hold_s)
        self._leases[lease_id] = _Lease(list(blocks), hold_s, until_s)

    def extend(self, lease_id: str, now_s: float) -> bool:
        """Start a lease's time again from ``now_s`` (a peer still wants its blocks); False if
        no such lease is held."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        lease.until_s = max(lease.until_s, now_s + lease.hold_s)
        return True

    def release(self, lease_id: str) -> bool:
        """Let a lease's blocks go (still cached, evictable, end of the chain first); False if
        no such lease is held."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self.pool.free_blocks(reversed(lease.blocks))
        return True

    def release_expired(self, now_s: float) -> list[str]:
        """Release every lease whose end is not after ``now_s``; their ids."""
        expired = [lease_id for lease_id, lease in self._leases.items() if lease.until_s <= now_s]
        for lease_id in expired:
            self.release(lease_id)
        return expired

    @property
    def next_lease_end_s(self) -> float | None:
        """When the first lease runs out (``time.monotonic``); None when none is held."""
        return min((lease.until_s for lease in self._leases.values()), default=None)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def commit(self) -> None:
        """The forward pass wrote the KV of every block cached since the last commit."""
        self._uncommitted.clear()

    def discard_uncommitted(self) -> list[str]:
        """Uncache every block cached since the last commit: the step that was to write their KV
        failed. Returns the requests whose block tables hold such a block, which can no longer
        run (their KV is incomplete): the caller must free them."""
        blocks = [block for block, cached in self._uncommitted if block.block_hash == cached]
        self._uncommitted.clear()
        if not blocks:
            return []
        self.pool.uncache_blocks(blocks)
        ids = {block.block_id for block in blocks}
        return [
            request_id
            for request_id, table in self._req_to_blocks.items()
            if any(block.block_id in ids for block in table)
        ]

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.tier is not None:
            self.tier.clear()
        return True

    def take_events(self) -> list[CacheEvent]:
        return self.pool.take_events()

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool, its host tier or any block table is inconsistent."""
        self.pool.check_integrity()
        if self.tier is not None:
            self.tier.check_integrity(self.pool)
        refs = [0] * self.pool.num_blocks
        for request_id, blocks in self._req_to_blocks.items():
            num_cached = self._req_to_num_cached_blocks[request_id]
            for i, block in enumerate(blocks):
                refs[block.block_id] += 1
                cached = block.block_hash is not None
                assert cached == (i < num_cached), (
                    f"request {request_id!r} block #{i} (id {block.block_id}): cached={cached}, "
                    f"expected {i < num_cached}"
                )
        for lease_id, lease in self._leases.items():
            for block in lease.blocks:
                refs[block.block_id] += 1
                assert block.block_hash is not None, f"lease {lease_id!r} holds uncached {block}"
        for transfer, landed in self._landing.items():
            for block, _ in landed:
                refs[block.block_id] += 1
                assert block.block_hash is None, f"transfer {transfer!r} writes cached {block}"
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"block {block.block_id}: ref {block.ref_cnt} but in "
                f"{refs[block.block_id]} tables, leases and transfers"
            )
        awaiting: dict[bytes, list[int]] = {}
        for request_id, pull in self._pulls.items():
            table = self._req_to_blocks.get(request_id)
            assert table is not None, f"request {request_id!r} awaits a pull but holds no blocks"
            first, end = pull.first, pull.first + len(pull.blocks)
            assert table[first:end] == pull.blocks, f"request {request_id!r}: awaited blocks moved"
            assert self._req_to_num_cached_blocks[request_id] == first, (
                f"request {request_id!r}: a block awaiting its pull is cached"
            )
            for block, block_hash in zip(pull.blocks, pull.hashes, strict=True):
                awaiting.setdefault(block_hash, []).append(block.block_id)
        mapped = {h: [b.block_id for b in blocks] for h, blocks in self._hash_to_awaiting.items()}
        assert {h: sorted(ids) for h, ids in mapped.items()} == {
            h: sorted(ids) for h, ids in awaiting.items()
        }, "the awaited hashes disagree with the pulls"
        awaited_ids = {block_id for ids in awaiting.values() for block_id in ids}
        assert self._filled <= awaited_ids, f"filled blocks no pull awaits: {self._filled}"
        assert len(self.block_tables) == len(self._req_to_blocks), "a stale block-table row"
        for request_id, blocks in self._req_to_blocks.items():
            assert self.block_tables.block_ids(request_id) == [b.block_id for b in blocks], (
                f"request {request_id!r}: the block-table row disagrees with its blocks"
            )

    # -- internals ------------------------------------------------------------------------------

    def _forget_pull(self, request_id: str) -> None:
        pull = self._pulls.pop(request_id, None)
        if pull is None:
            return
        for block, block_hash in zip(pull.blocks, pull.hashes, strict=True):
            self._filled.discard(block.block_id)
            awaiting = self._hash_to_awaiting[block_hash]
            awaiting.remove(block)
            if not awaiting:
                del self._hash_to_awaiting[block_hash]

    def _num_blocks_to_take(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock]
    ) -> int | None:
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        if request.block_size != self.block_size:
            raise ValueError(
                f"request {request.request_id!r} hashes blocks of {request.block_size} tokens, "
                f"this cache holds blocks of {self.block_size}"
            )
        num_tokens = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        if num_tokens > request.num_tokens:
            raise ValueError(
                f"request {request.request_id!r}: {num_tokens} tokens to compute but only "
                f"{request.num_tokens} known"
            )
        num_required = -(-num_tokens // self.block_size)
        num_held = len(self._req_to_blocks.get(request.request_id, ())) + len(computed_blocks)
        num_to_take = max(num_required - num_held, 0)
        # Touching a free prefix-hit block takes it out of the free queue too.
        num_revived = [block.ref_cnt for block in computed_blocks].count(0)
        if num_to_take + num_revived > self.pool.num_free_blocks:
            return None
        return num_to_take

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_full: int) -> None:
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_cached = self._req_to_num_cached_blocks[request_id]
        if num_full <= num_cached:
            return
        new_full = blocks[num_cached:num_full]
        new_hashes = request.block_hashes[num_cached:num_full]
        if self.record_tokens:
            size = self.block_size
            self.pool.cache_full_blocks(
                new_full,
                new_hashes,
                request.token_ids[num_cached * size : num_full * size],
                request.block_hashes[num_cached - 1] if num_cached else None,
                request.hasher.lora,
                request.hasher.cache_salt,
            )
        else:
            self.pool.cache_full_blocks(new_full, new_hashes)
        self._uncommitted.extend(zip(new_full, new_hashes, strict=True))
        self._req_to_num_cached_blocks[request_id] = num_full
