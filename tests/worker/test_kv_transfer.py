"""Cached blocks read out of one engine and written into another: the second then serves the
prompt from its cache, token for token as the first did, and its pool stays consistent."""

from __future__ import annotations

import asyncio
import os
import tempfile

import numpy as np
import pytest

from kvswitch.cache_index.events import BlockStored
from kvswitch.worker.engine import EngineConfig, LLMEngine
from kvswitch.worker.engine_client import EngineClient
from kvswitch.worker.kv_layout import SHM_DIR, SHM_PREFIX, KVLayout
from kvswitch.worker.request import SamplingParams

BLOCK_BYTES = 32 << 10  # one 16-token block of the built-in model in fp32
PROMPT = [256, *b"A long shared document, block after block of it. " * 6]  # 301 tokens: 18 blocks
GREEDY = SamplingParams(max_tokens=12)


def hashes(engine: LLMEngine, prompt: list[int] = PROMPT) -> list[bytes]:
    return engine.hasher().hash_blocks(np.array(prompt))


def engine(**overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**overrides))


def check(engine: LLMEngine) -> None:
    engine.kv_cache.check_integrity()


def test_blocks_moved_to_another_engine_serve_its_prompt_from_cache() -> None:
    source, target = engine(), engine()
    [expected] = source.generate([PROMPT], GREEDY)
    chain = hashes(source)
    num_found, data = source.read_cached_blocks(chain)
    assert num_found == len(chain) == 18
    assert len(data) == num_found * source.kv_layout.bytes_per_block == 18 * BLOCK_BYTES

    assert target.write_cached_blocks(chain, data) == 18
    check(target)
    events = target.take_events()
    assert [e.block_hashes for e in events if isinstance(e, BlockStored)] == [tuple(chain)]
    assert target.kv_cache.num_free_blocks == target.kv_cache.pool.num_blocks  # evictable
    assert target.generate([PROMPT], GREEDY) == [expected]
    # All but the last block's tokens came from the cache: the last one is always computed.
    assert target.stats.num_cached_tokens == 18 * 16
    check(target)


def test_written_kv_is_what_was_read() -> None:
    source, target = engine(), engine()
    source.generate([PROMPT], GREEDY)
    chain = hashes(source)
    _, data = source.read_cached_blocks(chain)
    target.write_cached_blocks(chain, data)
    assert target.read_cached_blocks(chain) == (18, data)


def test_reading_stops_at_the_first_block_not_held() -> None:
    source = engine()
    source.generate([PROMPT[:100]], GREEDY)  # 6 full blocks of the same chain
    num_found, data = source.read_cached_blocks(hashes(source))
    assert num_found == 6 and len(data) == 6 * BLOCK_BYTES
    assert source.read_cached_blocks([b"\0" * 16]) == (0, b"")


def test_blocks_held_already_are_skipped_and_kept() -> None:
    source, target = engine(), engine()
    source.generate([PROMPT], GREEDY)
    target.generate([PROMPT[:100]], GREEDY)  # the first 6 blocks
    target.take_events()
    chain = hashes(source)
    _, data = source.read_cached_blocks(chain)
    assert target.write_cached_blocks(chain, data) == 12
    events = target.take_events()
    assert [e.block_hashes for e in events if isinstance(e, BlockStored)] == [tuple(chain[6:])]
    assert target.read_cached_blocks(chain)[0] == 18
    check(target)


def test_a_small_cache_takes_the_leading_blocks_and_evicts_the_oldest() -> None:
    source = engine()
    source.generate([PROMPT], GREEDY)
    chain = hashes(source)
    _, data = source.read_cached_blocks(chain)
    small = engine(kv_cache_bytes=10 * BLOCK_BYTES)
    assert small.write_cached_blocks(chain, data) == 10
    assert small.read_cached_blocks(chain)[0] == 10
    check(small)
    # Written again, the chain's cached head is held while its tail takes the free blocks: the
    # head survives and nothing more fits.
    assert small.write_cached_blocks(chain, data) == 0
    assert small.read_cached_blocks(chain)[0] == 10
    check(small)


def test_what_cannot_be_written_is_refused_and_changes_nothing() -> None:
    source = engine()
    source.generate([PROMPT], GREEDY)
    chain = hashes(source)
    _, data = source.read_cached_blocks(chain)
    target = engine()
    with pytest.raises(ValueError, match="bytes for 18 blocks"):
        target.write_cached_blocks(chain, data[:-1])
    with pytest.raises(ValueError, match="prefix caching is off"):
        engine(enable_prefix_caching=False).write_cached_blocks(chain, data)
    assert target.read_cached_blocks(chain)[0] == 0
    check(target)


def test_layouts_name_their_difference() -> None:
    fp32 = KVLayout(2, 16, 4, 64, "float32")
    assert fp32.bytes_per_block == 2 * 2 * 16 * 4 * 64 * 4
    fp32.check_same(KVLayout(2, 16, 4, 64, "float32"))
    with pytest.raises(ValueError, match=r"'dtype': \('bfloat16', 'float32'\)"):
        fp32.check_same(KVLayout(2, 16, 4, 64, "bfloat16"))


def test_engine_cores_in_their_own_processes_move_blocks_between_steps() -> None:
    source, target = EngineClient.start(EngineConfig()), EngineClient.start(EngineConfig())
    try:

        async def run_prompt() -> None:
            queue = await source.submit("r", np.array(PROMPT), GREEDY)
            while not (await queue.get()).finished:
                pass

        asyncio.run(run_prompt())
        chain = hashes(engine())
        num_found, data = source.read_blocks(chain).result(timeout=30)
        assert (num_found, len(data)) == (18, 18 * BLOCK_BYTES)
        assert target.write_blocks(chain, data).result(timeout=30) == 18
        assert target.read_blocks(chain).result(timeout=30) == (18, data)
        with pytest.raises(ValueError, match="bytes for 18 blocks"):
            target.write_blocks(chain, data[:100]).result(timeout=30)
        _, cached = target.snapshot().result(timeout=30)
        assert set(chain) <= set(cached)
    finally:
        source.stop()
        target.stop()


def test_blocks_cross_shared_memory_at_any_offset(tmp_path) -> None:
    source, target = engine(), engine()
    source.generate([PROMPT], GREEDY)
    chain = hashes(source)
    _, expected = source.read_cached_blocks(chain)
    descriptor, path = tempfile.mkstemp(prefix=SHM_PREFIX, dir=SHM_DIR)
    try:
        os.ftruncate(descriptor, 100 + 18 * BLOCK_BYTES)  # an offset no page starts at
        # Two chunks, as a fetch in chunks writes them: blocks 0-6, then 7-17.
        for first, end in ((0, 7), (7, 18)):
            into = (path, 100 + first * BLOCK_BYTES)
            assert source.read_cached_blocks(chain[first:end], into=into) == (end - first, b"")
            assert target.write_cached_blocks_from(chain[first:end], into) == end - first
        assert target.read_cached_blocks(chain) == (18, expected)
        check(target)
        with pytest.raises(ValueError, match="holds"):
            target.write_cached_blocks_from(chain, (path, 200))  # past the file's end
    finally:
        os.close(descriptor)
        os.unlink(path)
