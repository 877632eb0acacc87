"""Routers and workers agree on how blocks are named: a keyed fleet routes by cache with keyed
names, and a worker that names blocks otherwise is refused when it registers, naming both."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from kvswitch.cache_index.grpc_index import worker_info_from_proto, worker_info_to_proto
from kvswitch.cache_index.hashing import XXH3_NAMING, BlockNaming, hash_prompt_blocks
from kvswitch.cache_index.index import WorkerInfo
from kvswitch.cache_index.memory_index import MemoryIndex
from kvswitch.cache_index.redis_index import _info_from_fields
from kvswitch.client import Client
from kvswitch.router.router import NoWorkerError, Router
from kvswitch.router.workers import WorkerDirectory
from kvswitch.v1 import index_pb2
from kvswitch.worker.server import start_worker
from tests.router.harness import (
    BLOCK_SIZE,
    ROUTER_CONFIG,
    WORKER_CONFIG,
    BackgroundCluster,
    wait_until,
)

FLEET_TOKEN = "block-naming-fleet-token"
KEYED = BlockNaming.from_fleet_token(FLEET_TOKEN)


def info(worker_id: str, naming: BlockNaming) -> WorkerInfo:
    return WorkerInfo(
        worker_id, f"127.0.0.1:{len(worker_id)}", "m", 16, num_blocks=64,
        block_hash=naming.mode, block_hash_key_id=naming.key_id,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("router", "worker", "worker_says", "router_says"),
    [
        (XXH3_NAMING, KEYED, f"blake2b-keyed (key {KEYED.key_id})", "xxh3"),
        (KEYED, XXH3_NAMING, "xxh3", f"blake2b-keyed (key {KEYED.key_id})"),
        (
            KEYED,
            BlockNaming.from_fleet_token("another token"),
            f"blake2b-keyed (key {BlockNaming.from_fleet_token('another token').key_id})",
            f"blake2b-keyed (key {KEYED.key_id})",
        ),
    ],
    ids=["keyed-worker", "xxh3-worker", "other-key"],
)
def test_a_worker_that_names_blocks_otherwise_is_refused_naming_both(
    router: BlockNaming,
    worker: BlockNaming,
    worker_says: str,
    router_says: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body() -> None:
        index = MemoryIndex()
        await index.register(info("odd", worker), ttl_s=60)
        await index.register(info("same", router), ttl_s=60)
        directory = WorkerDirectory(index, naming=router)
        with caplog.at_level(logging.ERROR, "kvswitch.router.workers"):
            await directory.refresh()
            await directory.refresh()  # said once, not at every refresh
        assert [h.worker_id for h in directory.handles()] == ["same"]
        why = f"worker odd hashes blocks with {worker_says} but this router uses {router_says}"
        assert directory.refused["odd"].startswith(why)
        assert [r.getMessage() for r in caplog.records if "odd" in r.getMessage()] == [
            directory.refused["odd"]
        ]
        # The only worker of the model refused: requests say why, naming both.
        await index.deregister("same")
        await directory.refresh()
        with pytest.raises(NoWorkerError, match=why.replace("(", r"\(").replace(")", r"\)")):
            Router(index, directory, None).plan(token_ids=list(range(40)))
        # Registered again, the right way: routed to, no longer refused.
        await index.register(info("odd", router), ttl_s=60)
        await directory.refresh()
        assert [h.worker_id for h in directory.handles()] == ["odd"]
        assert directory.refused == {}
        await directory.stop()

    asyncio.run(body())


def test_registrations_without_a_block_hash_mean_xxh3() -> None:
    """Workers older than the fields, over gRPC and in Redis, named blocks with xxh3."""
    old = index_pb2.WorkerInfo(
        worker_id="w", address="x:1", namespace="m", block_size=16, role="both"
    )
    assert worker_info_from_proto(old).names_blocks_as(XXH3_NAMING)
    fields = {b"address": b"x:1", b"namespace": b"m", b"block_size": b"16", b"role": b"both"}
    assert _info_from_fields("w", {**fields, b"num_blocks": b"4"}).names_blocks_as(XXH3_NAMING)
    keyed = info("w", KEYED)
    assert worker_info_from_proto(worker_info_to_proto(keyed)) == keyed


def test_a_keyed_fleet_routes_by_keyed_names_and_refuses_an_xxh3_worker() -> None:
    router_config = dataclasses.replace(ROUTER_CONFIG, fleet_token=FLEET_TOKEN)
    worker_config = dataclasses.replace(WORKER_CONFIG, fleet_token=FLEET_TOKEN)
    with BackgroundCluster(1, router_config, worker_config) as cluster:
        worker = cluster.worker("w0")
        prompt = [256] + [65 + i % 26 for i in range(80)]
        keyed_chain = hash_prompt_blocks(prompt, BLOCK_SIZE, worker.engine.namespace, naming=KEYED)
        with Client(cluster.address) as client:
            client.generate(prompt_token_ids=prompt, max_tokens=1)
            # The worker's cache holds the keyed names, and the index has them from its events.
            index = cluster.router.index
            wait_until(
                lambda: set(keyed_chain) <= cluster.run(index.worker_block_hashes("w0")),
                "the index holds the prompt's keyed block names",
            )
            again = client.generate(prompt_token_ids=prompt, max_tokens=1)
        assert again.route.num_matched_blocks == len(keyed_chain) == 5
        plain = hash_prompt_blocks(prompt, BLOCK_SIZE, worker.engine.namespace)
        assert not set(plain) & cluster.run(index.worker_block_hashes("w0"))

        # A worker of the fleet (it holds the token) told to use xxh3 registers, and is refused.
        odd = cluster.run(
            start_worker(
                dataclasses.replace(cluster.worker_config, worker_id="odd", block_hash="xxh3")
            )
        )
        directory = cluster.router.router.directory
        try:
            wait_until(lambda: "odd" in directory.refused, "the router refuses the xxh3 worker")
            assert directory.refused["odd"].startswith(
                f"worker odd hashes blocks with xxh3 but this router uses blake2b-keyed "
                f"(key {KEYED.key_id})"
            )
            assert [h.worker_id for h in directory.handles()] == ["w0"]
        finally:
            cluster.run(odd.stop(0))
