"""Property tests: random admissions, steps, frees and preemptions on a small pool.

A test case is a list of operations, each interpreted against the current state the way a
scheduler would drive the manager. After every operation:

- ``check_integrity()`` holds;
- replaying every event taken so far gives exactly the pool's cached hashes;
- each running request's block table starts with its prefix hit and has only grown;
- every full computed block of a table is cached under the request's own hash, the rest are not;
- every ``BlockStored`` rebuilds its hashes from its parent, tokens and extra keys.

Prompts come from a three-token alphabet and mostly extend a prefix of an earlier prompt (or of a
decoded sequence), and the pool is small, so prefix hits, revived free blocks, duplicate blocks,
evictions, refused allocations and preemptions all happen often.
"""

from __future__ import annotations

import itertools

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvswitch.cache_index.events import BlockRemoved, BlockStored, CacheEvent, replay
from kvswitch.cache_index.hashing import BlockHasher
from kvswitch.worker.kv_cache_manager import KVCacheManager
from kvswitch.worker.request import Request

ALPHABET = st.integers(min_value=0, max_value=2)
NAMESPACE = "prop-model"
MAX_SUFFIX = 12
# Tokens a prefill step computes: the whole rest of the prompt (None) or a chunk of it.
CHUNK = st.one_of(st.none(), st.integers(1, 8), st.integers(1, 8))
# Operation kinds, repeated to weight them.
OPS = ("admit",) * 3 + ("step",) * 4 + ("finish",) * 2 + ("preempt", "readmit", "twin")


class Harness:
    """One KVCacheManager with the scheduler-side bookkeeping needed to check it."""

    def __init__(self, data: st.DataObject, num_blocks: int, block_size: int) -> None:
        self.data = data
        self.manager = KVCacheManager(num_blocks, block_size)
        self.block_size = block_size
        # Mostly plain prompts, some under a LoRA adapter (the same extra key on every block) or
        # a cache salt (an extra key on block 0 only): same tokens, other hashes.
        self.hashers = [
            BlockHasher(NAMESPACE, block_size),
            BlockHasher(NAMESPACE, block_size, lora="adapter"),
            BlockHasher(NAMESPACE, block_size, cache_salt="salt"),
        ]
        self.events: list[CacheEvent] = []  # every event taken so far, oldest first
        self.replayed: set[bytes] = set()  # the same events, replayed one at a time
        self.prompts: list[tuple[int, list[int]]] = []  # (hasher index, tokens) seen so far
        self.running: dict[str, Request] = {}
        self.hit_ids: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.waiting: list[Request] = []  # preempted, oldest first
        self.next_id = 0

    def draw(self, strategy: st.SearchStrategy, label: str):
        return self.data.draw(strategy, label=label)

    # -- operations -----------------------------------------------------------------------------

    def run(self, op: str) -> None:
        getattr(self, f"op_{op}")()
        self.check()

    def op_admit(self) -> None:
        tokens: list[int] = []
        hasher_index = self.draw(st.sampled_from([0, 0, 0, 0, 1, 2]), "hasher")
        if self.prompts and self.draw(st.integers(0, 4), "share") > 0:
            # Recent prompts are likely still being prefilled or decoded.
            recent = st.sampled_from(self.prompts[-3:])
            base_index, base = self.draw(st.one_of(recent, st.sampled_from(self.prompts)), "base")
            # Often the whole earlier sequence: requests computing the same blocks at once make
            # duplicates, and a prompt ending on a block boundary recomputes its cached last block.
            keep = st.one_of(st.just(len(base)), st.integers(0, len(base)))
            tokens = base[: self.draw(keep, "keep")]
            if self.draw(st.integers(0, 3), "same extras") > 0:
                hasher_index = base_index
        tokens = tokens + self.draw(st.lists(ALPHABET, max_size=MAX_SUFFIX), "suffix")
        if not tokens:
            tokens = [0]
        chunk = self.draw(CHUNK, "chunk")
        self.prompts.append((hasher_index, tokens))
        request = Request(f"r{self.next_id}", tokens, self.hashers[hasher_index])
        self.next_id += 1
        if not self._admit(request, chunk):
            event("new request refused")

    def op_twin(self) -> None:
        """Admit a copy of a request that is still prefilling: both compute the same blocks."""
        prefilling = sorted(
            rid for rid, r in self.running.items() if r.num_computed_tokens < r.num_tokens
        )
        if not prefilling:
            self.op_admit()
            return
        original = self.running[self.draw(st.sampled_from(prefilling), "original")]
        tokens = original.token_ids[: original.num_prompt_tokens]
        request = Request(f"r{self.next_id}", tokens, original.hasher)
        self.next_id += 1
        self._admit(request, self.draw(CHUNK, "chunk"))

    def op_readmit(self) -> None:
        if self.waiting and self._admit(self.waiting[0], None):
            self.waiting.pop(0)
            event("preempted request readmitted")

    def op_step(self) -> None:
        """One scheduler step for a running request: its next prefill chunk, or one decode."""
        request = self._pick_running()
        if request is None:
            return
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining:
            chunk = self.draw(CHUNK, "chunk")
            num_new = remaining if chunk is None else min(chunk, remaining)
            event("prefill chunk")
        else:
            request.append_token_ids([self.draw(ALPHABET, "token")])
            # Decoded sequences become prompts that later requests may share.
            self.prompts.append((self.hashers.index(request.hasher), list(request.token_ids)))
            num_new = 1
            event("decode")
        if self._allocate(request, num_new):
            request.num_computed_tokens += num_new
        else:
            self._preempt(request)

    def op_finish(self) -> None:
        request = self._pick_running()
        if request is not None:
            self._release(request)

    def op_preempt(self) -> None:
        request = self._pick_running()
        if request is not None:
            self._preempt(request)

    # -- helpers --------------------------------------------------------------------------------

    def _pick_running(self) -> Request | None:
        if not self.running:
            return None
        return self.running[self.draw(st.sampled_from(sorted(self.running)), "request")]

    def _state(self) -> tuple:
        pool = self.manager.pool
        return (
            {rid: self.manager.get_block_ids(rid) for rid in self.running},
            pool.free_queue.block_ids(),
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            sorted(pool.cached_block_hashes()),
        )

    def _allocate(self, request: Request, num_new: int, hit=()) -> bool:
        """allocate_slots, checking that can_allocate agrees and that a refusal changes nothing."""
        self._collect_events()
        expected = self.manager.can_allocate(request, num_new, hit)
        before = self._state()
        pool = self.manager.pool
        table = self.manager.get_block_ids(request.request_id)
        was_cached = {bid for bid in table if pool.blocks[bid].block_hash is not None}
        blocks = self.manager.allocate_slots(request, num_new, hit)
        assert (blocks is not None) == expected
        if blocks is None:
            assert self._state() == before
            assert self.manager.take_events() == []
            event("allocation refused")
            return False
        # Blocks cached by this step: is a duplicate followed by a newly cached hash?
        primary = [
            pool.get_cached_block(pool.blocks[bid].block_hash) is pool.blocks[bid]
            for bid in self.manager.get_block_ids(request.request_id)[len(hit) :]
            if bid not in was_cached and pool.blocks[bid].block_hash is not None
        ]
        if any(not a and b for a, b in itertools.pairwise(primary)):
            event("duplicate then new block in one step")
        return True

    def _admit(self, request: Request, chunk: int | None) -> bool:
        hit, num_hit_tokens = self.manager.get_computed_blocks(request)
        assert num_hit_tokens == len(hit) * self.block_size
        assert num_hit_tokens < request.num_tokens
        assert num_hit_tokens <= (request.num_tokens - 1) // self.block_size * self.block_size
        assert [b.block_hash for b in hit] == request.block_hashes[: len(hit)]
        if hit:
            event("prefix hit")
        if any(b.ref_cnt == 0 for b in hit):
            event("hit revives a free block")
        remaining = request.num_tokens - num_hit_tokens
        num_new = remaining if chunk is None else min(chunk, remaining)
        if not self._allocate(request, num_new, hit):
            return False
        request.num_computed_tokens = num_hit_tokens + num_new
        rid = request.request_id
        self.running[rid] = request
        self.hit_ids[rid] = [b.block_id for b in hit]
        self.tables[rid] = self.manager.get_block_ids(rid)
        return True

    def _release(self, request: Request) -> None:
        """Free a running request, checking its blocks join the tail end of chain first."""
        pool = self.manager.pool
        rid = request.request_id
        table = self.manager.get_block_ids(rid)
        freed = [bid for bid in reversed(table) if pool.blocks[bid].ref_cnt == 1]
        queue_before = pool.free_queue.block_ids()
        self.manager.free(request)
        assert pool.free_queue.block_ids() == queue_before + freed
        assert self.manager.get_block_ids(rid) == []
        del self.running[rid], self.hit_ids[rid], self.tables[rid]

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.num_computed_tokens = 0
        self.waiting.append(request)
        event("preempted")

    # -- checks ---------------------------------------------------------------------------------

    def check(self) -> None:
        manager = self.manager
        manager.check_integrity()
        self._collect_events()
        pool = manager.pool
        cached = set(pool.cached_block_hashes())
        assert replay(self.events) == cached
        assert self.replayed == cached
        assert cached == {b.block_hash for b in pool.blocks if b.block_hash is not None}
        if any(
            pool.get_cached_block(b.block_hash) is not b
            for b in pool.blocks
            if b.block_hash is not None
        ):
            event("duplicate blocks coexist")

        block_size = self.block_size
        for rid, request in self.running.items():
            table = manager.get_block_ids(rid)
            hit = self.hit_ids[rid]
            assert table[: len(hit)] == hit, f"{rid}: table {table} lost its hit {hit}"
            previous = self.tables[rid]
            assert table[: len(previous)] == previous, f"{rid}: table went {previous} -> {table}"
            self.tables[rid] = table
            assert len(table) == -(-request.num_computed_tokens // block_size)
            num_full = request.num_computed_tokens // block_size
            for i, block_id in enumerate(table):
                block_hash = pool.blocks[block_id].block_hash
                assert block_hash == (request.block_hashes[i] if i < num_full else None)

    def _collect_events(self) -> None:
        for e in self.manager.take_events():
            if isinstance(e, BlockStored):
                self._check_stored(e)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.replayed, "removed a hash that was not cached"
                event("eviction")
            replay([e], self.replayed)
            self.events.append(e)

    def _check_stored(self, e: BlockStored) -> None:
        """The hashes are a run of consecutive full blocks of a prompt seen so far, as its hasher
        names them; only new hashes are announced, and the run's parent is cached already."""
        run = list(e.block_hashes)
        for hasher_index, tokens in reversed(self.prompts):
            chain = self.hashers[hasher_index].hash_blocks(tokens)
            starts = [i for i, h in enumerate(chain) if h == run[0]]
            start = next((i for i in starts if chain[i : i + len(run)] == run), None)
            if start is not None:
                break
        else:
            raise AssertionError("stored hashes that are no prompt's consecutive blocks")
        assert not set(run) & self.replayed, "an already cached hash was stored again"
        assert start == 0 or chain[start - 1] in self.replayed, "a run stored before its parent"


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    num_blocks=st.integers(min_value=8, max_value=24),
    block_size=st.integers(min_value=2, max_value=4),
    ops=st.lists(st.sampled_from(OPS), min_size=20, max_size=60),
)
def test_random_workloads_keep_pool_and_events_consistent(
    data: st.DataObject, num_blocks: int, block_size: int, ops: list[str]
) -> None:
    harness = Harness(data, num_blocks, block_size)
    harness.check()
    for op in ops:
        harness.run(op)
    # Drain: freeing changes no cached hash, so it emits nothing; then the cache can be reset.
    cached = set(harness.manager.pool.cached_block_hashes())
    for request in list(harness.running.values()):
        harness._release(request)
        assert harness.manager.take_events() == []
        harness.check()
    assert set(harness.manager.pool.cached_block_hashes()) == cached
    assert harness.manager.num_free_blocks == num_blocks
    assert harness.manager.reset_prefix_cache() is True
    harness.check()
    assert harness.replayed == set()
