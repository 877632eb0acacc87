"""A kvswitch worker publishing its cache events as a vLLM engine does (``--kv-events-config``):
a reader of vLLM's events (kvswitch's own feed here) names its blocks exactly as the worker
does, so that a router that follows vLLM fleets can route kvswitch workers too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import grpc
import pytest

from kvswitch.cache_index.engine_feed import EngineEndpoints, EngineEventFeed
from kvswitch.cache_index.events import BlockStored
from kvswitch.cache_index.hashing import BlockHasher, hash_prompt_blocks
from kvswitch.cache_index.memory_index import MemoryIndex
from kvswitch.cache_index.vllm_events import EngineBlockNames
from kvswitch.serving import start_server_process
from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvswitch.worker import core_protocol as wire
from kvswitch.worker.kv_cache_manager import KVCacheManager
from kvswitch.worker.request import Request
from kvswitch.worker.worker_config import WorkerConfig
from tests.worker.driver import admit

B = 16


def free_port_v6() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return s.getsockname()[1]


def test_a_workers_vllm_events_name_its_blocks_as_it_does() -> None:
    events, replay = (f"tcp://[::1]:{free_port_v6()}" for _ in range(2))
    config = {"enable_kv_cache_events": True, "endpoint": events, "replay_endpoint": replay}
    worker, address = start_server_process(
        ["worker", "--port", "0", "--kv-events-config", json.dumps(config)]
    )
    prompts = [[256, *b"The first document, block after block. " * 3], [256, *b"Another " * 9]]
    salts = [None, "tenant-7"]  # a salted prompt is named salted: only the same salt matches it

    async def main() -> None:
        stub = worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(address))
        snapshot = [c async for c in stub.Snapshot(worker_pb2.SnapshotRequest())]
        namespace = snapshot[0].model
        index = MemoryIndex()
        endpoints = EngineEndpoints("kvswitch-0", f"http://{address}", events, replay)
        feed = EngineEventFeed(endpoints, index, EngineBlockNames(namespace, B))
        task = asyncio.create_task(feed.run())
        try:
            await asyncio.wait_for(feed.wait_subscribed(), 30)
            for i, prompt in enumerate(prompts):
                request = worker_pb2.WorkerGenerateRequest(
                    request_id=f"r{i}",
                    prompt_token_ids=prompt,
                    sampling=common_pb2.SamplingParams(max_tokens=20, temperature=0.0),
                    cache_salt=salts[i] or "",
                )
                async for _ in stub.Generate(request, timeout=60):
                    pass
            held = {
                h async for c in stub.Snapshot(worker_pb2.SnapshotRequest()) for h in c.block_hashes
            }
            deadline = time.monotonic() + 30
            while feed.names.block_names() != held:
                assert time.monotonic() < deadline, (len(feed.names), len(held), feed.status)
                await asyncio.sleep(0.01)
            for prompt, salt in zip(prompts, salts, strict=True):
                chain = hash_prompt_blocks(prompt, B, namespace, cache_salt=salt)
                assert (await index.match(namespace, chain))["kvswitch-0"] == len(chain)
            unsalted = hash_prompt_blocks(prompts[1], B, namespace)
            assert (await index.match(namespace, unsalted)).get("kvswitch-0", 0) == 0
            assert feed.names.stats.num_orphans == 0 and not feed.status.degraded
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    try:
        asyncio.run(main())
    finally:
        worker.terminate()
        worker.wait(timeout=30)


def test_stored_events_carry_tokens_parent_and_adapter_when_asked_and_cross_the_pipe() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    manager.record_tokens = True
    hasher = BlockHasher("m", block_size=4, lora="sql", cache_salt="t1")
    request = Request("r", list(range(10, 19)), hasher)  # two full blocks and a token
    admit(manager, request)
    [event] = manager.take_events()
    assert event == BlockStored(
        tuple(request.block_hashes), tuple(range(10, 18)), None, "sql", "t1"
    )
    assert wire.events_from_wire(wire.events_to_wire([event])) == [event]
    plain = KVCacheManager(num_blocks=8, block_size=4)
    admit(plain, Request("r", list(range(10, 19)), hasher))
    assert plain.take_events() == [BlockStored(tuple(request.block_hashes))]  # hashes only


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"enable_kv_cache_events": True}, "binds tcp://\\*:5557 beyond this machine"),
        ({"enable_kv_cache_events": True, "endpoint": "ipc:///tmp/e", "replay_endpoint":
          "tcp://0.0.0.0:5558"}, "binds tcp://0.0.0.0:5558"),
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher is zmq or null"),
        ({"enable_kv_cache_event": True}, "unknown fields enable_kv_cache_event"),
    ],
)  # fmt: skip
def test_a_config_that_would_expose_the_events_or_is_not_vllms_is_refused(
    settings: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerConfig(port=0, kv_events_config=json.dumps(settings))
    insecure = WorkerConfig(
        port=0, kv_events_config='{"enable_kv_cache_events": true}', insecure=True
    )
    assert insecure.engine_config().record_block_tokens
    assert not WorkerConfig(port=0).engine_config().record_block_tokens
