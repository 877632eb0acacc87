"""A worker with a host tier in a fleet: the index holds its blocks per tier (its own entry both
tiers', a second entry, ``#gpu``, its device's alone, as an engine's tiers are held), and the
router counts a matched block in the host tier at ``--cpu-block-weight``."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from kvswitch.cache_index.index import TIER_ROLE
from kvswitch.client import Client
from kvswitch.worker.server import WorkerServer
from tests.router.harness import ROUTER_CONFIG, WORKER_CONFIG, BackgroundCluster, wait_until

BLOCK = 16
BLOCK_BYTES = 32 << 10  # the built-in model's KV block


def copies_done(worker: WorkerServer) -> bool:
    return worker.engine.load.num_host_copies == 0


@pytest.mark.parametrize("cpu_weight", [0.8, 1.0])
def test_a_prefix_in_the_host_tier_counts_at_its_tiers_weight(cpu_weight: float) -> None:
    router = dataclasses.replace(ROUTER_CONFIG, pending_ttl_s=0.05, cpu_block_weight=cpu_weight)
    worker = dataclasses.replace(
        WORKER_CONFIG,
        kv_cache_bytes=12 * BLOCK_BYTES,
        offload_gb=64 * BLOCK_BYTES / 2**30,
    )
    rng = np.random.default_rng(0)
    first, other = ([256, *rng.integers(0, 256, n * BLOCK).tolist()] for n in (5, 10))
    with BackgroundCluster(1, router, worker) as cluster, Client(cluster.address) as client:
        (served,) = cluster.workers
        infos = cluster.run(cluster.router.router.index.live_workers())
        assert {(i.worker_id, i.role) for i in infos} >= {("w0#gpu", TIER_ROLE)}
        assert client.generate(prompt_token_ids=first, max_tokens=1).stats.num_cached_tokens == 0
        wait_until(lambda: copies_done(served), "the first prompt's blocks are copied out")
        client.generate(prompt_token_ids=other, max_tokens=1)  # evicts four of them
        wait_until(
            lambda: copies_done(served) and served.engine.load.num_host_blocks >= 4,
            "four blocks are in the host tier",
        )
        index = cluster.router.router.index
        hashes = cluster.router.router.plan(token_ids=first).block_hashes
        wait_until(
            lambda: cluster.run(index.match(served.engine.namespace, hashes)).get("w0#gpu") == 1,
            "the device tier's entry holds the first block alone",
        )
        assert cluster.run(index.match(served.engine.namespace, hashes))["w0"] == 5
        time.sleep(0.1)  # past the router's guesses of where the prompts went
        result = client.generate(prompt_token_ids=first, max_tokens=1)
    # One block on the device, four in host memory, each of those counting cpu_weight.
    assert result.route.num_matched_blocks == int(1 + cpu_weight * 4)
    assert result.stats.num_cached_tokens == 5 * BLOCK  # and all five cached: four loaded back
