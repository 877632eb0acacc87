"""Cache salts keep tenants apart: requests under different salts never share a KV block.

The salt is an extra key of every chain's first block (docs/HASHING.md), so the same prompt
under two salts has two disjoint chains. These tests follow one prompt through each place a
block is named: the worker's pool (block ids), the router's index (hashes and matches) and
what a client sees (``num_cached_tokens``, ``num_matched_blocks``).

Each prompt is 69 tokens: four full 16-token blocks and a 5-token tail. A hit reuses at most
``(69 - 1) // 16 = 4`` blocks (the last prompt token is always computed), so a full hit is
exactly 64 cached tokens and a miss exactly 0.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest

from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.cache_index.local_redis import LocalRedis
from kvswitch.client import Client, GenerateResult
from kvswitch.worker.engine import EngineConfig, LLMEngine
from kvswitch.worker.request import SamplingParams
from tests.router.harness import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    ROUTER_CONFIG,
    WORKER_CONFIG,
    BackgroundCluster,
)

NUM_FULL_BLOCKS = 4
NUM_PROMPT_TOKENS = NUM_FULL_BLOCKS * BLOCK_SIZE + 5
FULL_HIT_TOKENS = NUM_FULL_BLOCKS * BLOCK_SIZE
MAX_TOKENS = 2  # 69 + 2 tokens fill no fifth block: only the prompt's four are ever cached


def prompt_of(tag: int) -> list[int]:
    """A prompt of its own for each test, so that the module's shared worker never holds it
    before the test runs."""
    text = f"Tenant {tag}: the confidential quarterly report, page after page of it. " * 2
    return [256, *text.encode()][:NUM_PROMPT_TOKENS]


@pytest.fixture(scope="module")
def cluster() -> Iterator[BackgroundCluster]:
    background = BackgroundCluster(num_workers=1)  # one worker: every request meets the others
    yield background
    background.close()


@pytest.fixture(scope="module")
def client(cluster: BackgroundCluster) -> Iterator[Client]:
    with Client(cluster.address, timeout_s=30) as c:
        yield c


@pytest.fixture(scope="module")
def namespace(cluster: BackgroundCluster) -> str:
    return cluster.worker("w0").engine.namespace


def generate(client: Client, prompt: list[int], salt: str | None) -> GenerateResult:
    return client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, cache_salt=salt)


def chain_of(prompt: list[int], namespace: str, salt: str | None) -> list[bytes]:
    return hash_prompt_blocks(prompt, BLOCK_SIZE, namespace, cache_salt=salt)


def match(cluster: BackgroundCluster, namespace: str, chain: list[bytes]) -> dict[str, int]:
    """What the router's embedded index answers for ``chain``, asked on the router's loop."""
    return cluster.run(cluster.router.index.match(namespace, chain))


def wait_for_match(
    cluster: BackgroundCluster, namespace: str, chain: list[bytes], timeout_s: float = 5.0
) -> dict[str, int]:
    """The index's answer for ``chain`` once the worker has published all of it."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = match(cluster, namespace, chain)
        if answer.get("w0") == len(chain) or time.monotonic() > deadline:
            return answer
        time.sleep(0.02)


def num_cached_on_worker(cluster: BackgroundCluster, chain: list[bytes]) -> int:
    """Leading blocks of ``chain`` that the worker's own pool holds cached."""
    return cluster.worker("w0").engine.read_blocks(chain, with_data=False).result(timeout=10)[0]


# -- through the router ----------------------------------------------------------------------


def test_another_salt_reuses_nothing_and_its_own_salt_everything(
    cluster: BackgroundCluster, client: Client, namespace: str
) -> None:
    prompt = prompt_of(1)
    first = generate(client, prompt, "tenant-a")
    second = generate(client, prompt, "tenant-b")
    again = generate(client, prompt, "tenant-a")
    assert [r.stats.worker_id for r in (first, second, again)] == ["w0"] * 3
    assert [r.stats.num_prompt_tokens for r in (first, second, again)] == [NUM_PROMPT_TOKENS] * 3
    assert first.stats.num_cached_tokens == 0
    assert second.stats.num_cached_tokens == 0  # tenant-a's blocks sit on the same worker
    assert again.stats.num_cached_tokens == FULL_HIT_TOKENS
    # The two tenants' tokens are the same, so are their outputs: only the cache is apart.
    assert first.token_ids == second.token_ids == again.token_ids
    # The worker holds both chains, each whole.
    assert num_cached_on_worker(cluster, chain_of(prompt, namespace, "tenant-a")) == 4
    assert num_cached_on_worker(cluster, chain_of(prompt, namespace, "tenant-b")) == 4


def test_the_index_holds_each_salts_chain_apart(
    cluster: BackgroundCluster, client: Client, namespace: str
) -> None:
    prompt = prompt_of(2)
    chain_a = chain_of(prompt, namespace, "tenant-a")
    chain_b = chain_of(prompt, namespace, "tenant-b")
    assert len(chain_a) == len(chain_b) == NUM_FULL_BLOCKS
    assert not set(chain_a) & set(chain_b)

    first = generate(client, prompt, "tenant-a")
    assert first.stats.num_cached_tokens == 0
    assert wait_for_match(cluster, namespace, chain_a) == {"w0": 4}
    # Only tenant-a ran: the same tokens under tenant-b's salt match nothing, in the index and
    # in the worker's pool, and the router routes them as a miss.
    assert match(cluster, namespace, chain_b) == {"w0": 0}
    assert num_cached_on_worker(cluster, chain_b) == 0
    second = generate(client, prompt, "tenant-b")
    assert (second.route.num_matched_blocks, second.stats.num_cached_tokens) == (0, 0)

    assert wait_for_match(cluster, namespace, chain_b) == {"w0": 4}
    assert match(cluster, namespace, chain_a) == {"w0": 4}
    held = cluster.run(cluster.router.index.worker_block_hashes("w0"))
    assert set(chain_a) <= held and set(chain_b) <= held
    third = generate(client, prompt, "tenant-a")
    assert (third.route.num_matched_blocks, third.stats.num_cached_tokens) == (4, FULL_HIT_TOKENS)


@pytest.mark.parametrize(
    ("first_salt", "second_salt"),
    [(None, "tenant-a"), ("tenant-a", None)],
    ids=["none-first", "salt-first"],
)
def test_no_salt_and_a_salt_never_share(
    cluster: BackgroundCluster,
    client: Client,
    namespace: str,
    first_salt: str | None,
    second_salt: str | None,
) -> None:
    prompt = prompt_of(3 if first_salt is None else 4)
    chain_first = chain_of(prompt, namespace, first_salt)
    chain_second = chain_of(prompt, namespace, second_salt)
    assert not set(chain_first) & set(chain_second)

    first = generate(client, prompt, first_salt)
    assert wait_for_match(cluster, namespace, chain_first) == {"w0": 4}
    second = generate(client, prompt, second_salt)
    again = generate(client, prompt, first_salt)
    assert first.stats.num_cached_tokens == 0
    assert (second.route.num_matched_blocks, second.stats.num_cached_tokens) == (0, 0)
    assert again.stats.num_cached_tokens == FULL_HIT_TOKENS


# -- in the worker's pool --------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_bytes=32 * BLOCK_BYTES))  # 32 blocks, ids 0..31


def test_salts_hold_disjoint_blocks_in_the_pool_and_one_salt_shares(engine: LLMEngine) -> None:
    prompt = prompt_of(5)
    params = SamplingParams(max_tokens=4)
    engine.add_request("a", prompt, params, cache_salt="tenant-a")
    engine.add_request("b", prompt, params, cache_salt="tenant-b")
    engine.add_request("a-again", prompt, params, cache_salt="tenant-a")
    engine.add_request("plain", prompt, params)
    engine.step()  # all four prefilled in one step, none finished

    # Blocks are cached as they are allocated, so "a-again" finds "a"'s four full blocks in the
    # same step; every other request gets five new blocks (four full, one for the tail).
    block_ids = engine.kv_cache.get_block_ids
    assert block_ids("a") == [0, 1, 2, 3, 4]
    assert block_ids("b") == [5, 6, 7, 8, 9]
    assert block_ids("a-again") == [0, 1, 2, 3, 10]
    assert block_ids("plain") == [11, 12, 13, 14, 15]
    assert engine.kv_cache.stats.num_hit_tokens == FULL_HIT_TOKENS  # "a-again"'s alone

    while engine.has_unfinished():
        engine.step()
    # Finished, each salt's chain stays cached in the blocks it was computed in.
    pool = engine.kv_cache.pool

    def cached_ids(salt: str | None) -> list[int | None]:
        blocks = [pool.get_cached_block(h) for h in engine.hasher(salt).hash_blocks(prompt)]
        return [block.block_id if block is not None else None for block in blocks]

    assert cached_ids("tenant-a") == [0, 1, 2, 3]
    assert cached_ids("tenant-b") == [5, 6, 7, 8]
    assert cached_ids(None) == [11, 12, 13, 14]
    assert cached_ids("tenant-c") == [None] * 4

    # Later, each salt hits its own blocks and only those.
    engine.add_request("b-later", prompt, params, cache_salt="tenant-b")
    engine.add_request("c-later", prompt, params, cache_salt="tenant-c")
    engine.step()
    assert block_ids("b-later")[:4] == [5, 6, 7, 8]
    assert not set(block_ids("c-later")) & {0, 1, 2, 3, 5, 6, 7, 8, 11, 12, 13, 14}
    while engine.has_unfinished():
        engine.step()
    engine.kv_cache.check_integrity()


def test_two_fleets_share_a_redis_apart_under_their_key_prefixes() -> None:
    """Each fleet's router sees only its own workers and its own cached blocks."""
    prompt = [256] + [70 + i % 20 for i in range(68)]
    with LocalRedis() as redis_server:
        fleets = []
        try:
            for prefix in ("fleet-a", "fleet-b"):
                router = dataclasses.replace(
                    ROUTER_CONFIG, index=redis_server.url, index_prefix=prefix
                )
                worker = dataclasses.replace(WORKER_CONFIG, index_prefix=prefix)
                fleets.append(BackgroundCluster(0, router, worker))
                fleets[-1].add_worker(f"{prefix}-w0")
            for fleet, prefix in zip(fleets, ("fleet-a", "fleet-b"), strict=True):
                directory = fleet.router.router.directory
                assert [h.worker_id for h in directory.handles()] == [f"{prefix}-w0"]
            with Client(fleets[0].address) as client:
                client.generate(prompt_token_ids=prompt, max_tokens=1)
            with Client(fleets[1].address) as client:
                # The same prompt on the other fleet: nothing of fleet A's cache is seen there.
                result = client.generate(prompt_token_ids=prompt, max_tokens=1)
            assert result.stats.num_cached_tokens == 0 and result.route.num_matched_blocks == 0
        finally:
            for fleet in fleets:
                fleet.close()
