"""``kvswitch index stats`` / ``audit`` against a real Redis and a real worker publishing to it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time

import grpc
import numpy as np
import pytest
import redis

from kvswitch.app.cli import main
from kvswitch.cache_index.redis_index import KeySchema
from kvswitch.v1 import common_pb2, worker_pb2
from kvswitch.worker.server import WorkerConfig
from tests.worker.background import BackgroundWorker, engine_core_pids

CONFIG = WorkerConfig(port=0, kv_cache_bytes=64 * (32 << 10), grace_s=0.0)
PROMPT = [256, *b"a document that several questions will share. " * 2]


def run_tool(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_stats_and_audit_of_a_live_worker(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The worker publishes under the default key prefix, where the tools look too; no other
    # test on this Redis uses it.
    worker = BackgroundWorker(dataclasses.replace(CONFIG, index=redis_url, worker_id="w1"))
    try:
        worker.generate(PROMPT, max_tokens=4)
        index_args = ["--index", redis_url]
        deadline = time.monotonic() + 5
        while True:
            report = run_tool(capsys, "index", "audit", *index_args)
            (entry,) = report["workers"]
            if entry["num_in_index"] == entry["num_on_worker"] > 0:
                break
            assert time.monotonic() < deadline, report
            time.sleep(0.05)
        assert (report["num_stale"], report["num_missing"]) == (0, 0)

        stats = run_tool(capsys, "index", "stats", *index_args)
        assert stats["num_workers"] == 1
        assert stats["workers"][0]["worker_id"] == "w1"
        assert stats["num_entries"] == entry["num_on_worker"]

        # Corrupt the index behind the publisher's back: one bogus entry, one real one gone.
        blocks_key = KeySchema("kvswitch").worker("w1").blocks
        with redis.Redis.from_url(redis_url) as client:
            real = next(iter(client.smembers(blocks_key)))
            client.sadd(blocks_key, b"\xff" * 16)
            client.srem(blocks_key, real)
        report = run_tool(capsys, "index", "audit", *index_args)
        assert (report["num_stale"], report["num_missing"]) == (1, 1)
    finally:
        worker.close()


def test_index_tools_need_a_shared_index(capsys: pytest.CaptureFixture[str]) -> None:
    for url in ("", "memory://"):
        with pytest.raises(SystemExit) as exit_info:
            main(["index", "stats", "--index", url])
        assert exit_info.value.code == 2
    assert "Redis URL" in capsys.readouterr().err


def test_worker_index_recovers_after_redis_restarts_mid_stream(
    spawn_redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """Redis dies while the worker keeps caching and comes back empty: the publisher
    re-registers and resyncs, and the audit ends with nothing stale and nothing missing."""
    server = spawn_redis()
    worker = BackgroundWorker(dataclasses.replace(CONFIG, index=server.url, worker_id="w2"))

    def converged() -> dict:
        deadline = time.monotonic() + 15
        while True:
            report = run_tool(capsys, "index", "audit", "--index", server.url)
            workers = report["workers"]
            if (
                len(workers) == 1
                and workers[0]["num_in_index"] == workers[0]["num_on_worker"] > 0
                and report["num_stale"] == report["num_missing"] == 0
            ):
                return workers[0]
            assert time.monotonic() < deadline, report
            time.sleep(0.1)

    try:
        worker.generate(PROMPT, max_tokens=4)
        before = converged()
        server.stop()
        for i in range(3):  # events while the index is down
            worker.generate([256, *bytes([70 + i]) * 50], max_tokens=4)
        time.sleep(1.5)  # longer than the client's own retries: the publisher sees errors
        server.start()
        worker.generate([256, *b"after the restart " * 4], max_tokens=4)
        after = converged()
        assert after["num_on_worker"] > before["num_on_worker"]
        publisher = worker.server.publisher
        assert publisher.num_errors > 0
        assert publisher.num_resyncs >= 2  # the first sync, and the one after the restart
    finally:
        worker.close()


def test_index_stats_says_which_engine_is_degraded(redis_url: str) -> None:
    """An engine registered degraded by the router that follows it (its events lost past
    replay) is listed so by kvswitch index stats, for whoever reads the index."""
    import asyncio

    from kvswitch.cache_index.audit import IndexToolConfig, stats_report
    from kvswitch.cache_index.index import WorkerInfo
    from kvswitch.cache_index.redis_index import RedisIndex

    why = "batches 4..9 are older than the engine's replay buffer"
    engine = WorkerInfo("vllm-a", "http://10.0.0.5:8000", "llama", 16, degraded=why)
    whole = WorkerInfo("vllm-b", "http://10.0.0.6:8000", "llama", 16)

    async def register() -> None:
        index = await RedisIndex.connect(redis_url, prefix="stats-degraded")
        try:
            for info in (engine, whole):
                await index.register(info, 30.0)
        finally:
            await index.close()

    asyncio.run(register())
    report = asyncio.run(stats_report(IndexToolConfig(index=redis_url, prefix="stats-degraded")))
    listed = {w["worker_id"]: w for w in report["workers"]}
    assert listed["vllm-a"]["degraded"] == why
    assert "degraded" not in listed["vllm-b"]
    assert listed["vllm-a"]["address"] == "http://10.0.0.5:8000"


def test_audit_counts_the_host_tier_as_the_worker_s_blocks(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker with a host tier (its engine core a process of its own): blocks the device
    evicts are offloaded and loaded back; the index, fed its events, agrees with its snapshot
    of both tiers."""
    worker = BackgroundWorker(tiered_config(redis_url, "tiered"))
    rng = np.random.default_rng(0)
    first, other = (rng.integers(0, 256, n * 16 + 1).tolist() for n in (5, 10))
    try:
        worker.generate(first, max_tokens=1)
        wait_until_copied(worker)
        worker.generate(other, max_tokens=1)  # evicts four of the first prompt's blocks
        wait_until_copied(worker)
        assert worker.load().num_host_blocks >= 4
        registry = worker.server.metrics.registry
        assert registry.get_sample_value("kvswitch_worker_host_blocks") >= 4
        assert registry.get_sample_value("kvswitch_worker_host_total_blocks") == 64
        *_, final = worker.generate(first, max_tokens=1)
        assert final.stats.num_cached_tokens == 5 * 16  # four of them loaded back
        wait_until_copied(worker)
        report = audit_until_clean(capsys, redis_url, "tiered")
        entries = {entry["worker_id"]: entry for entry in report["workers"]}
        assert set(entries) == {"tiered", "tiered#gpu"}
        # More than the device holds in the worker's own entry: both tiers; its device's alone
        # in the other.
        assert entries["tiered"]["num_on_worker"] > 12 >= entries["tiered#gpu"]["num_on_worker"]
    finally:
        worker.close()


def tiered_config(redis_url: str, name: str) -> WorkerConfig:
    """A worker named ``name`` (its index prefix too) of 12 device blocks over 64 of host."""
    return dataclasses.replace(
        CONFIG,
        index=redis_url,
        worker_id=name,
        index_prefix=name,
        kv_cache_bytes=12 * (32 << 10),
        offload_gb=64 * (32 << 10) / 2**30,
    )


def wait_until_copied(worker: BackgroundWorker, timeout_s: float = 30) -> None:
    """Until the worker's host tier has no copy in flight (its load report says so after the
    step that saw them done)."""
    deadline = time.monotonic() + timeout_s
    while worker.load().num_host_copies:
        assert time.monotonic() < deadline, f"the host tier never finished copying: {worker.load()}"
        time.sleep(0.01)


def audit_until_clean(capsys: pytest.CaptureFixture[str], redis_url: str, prefix: str) -> dict:
    """``kvswitch index audit`` once every entry agrees with its worker (the events of the
    latest steps may still be on their way)."""
    deadline = time.monotonic() + 10
    while True:
        report = run_tool(capsys, "index", "audit", "--index", redis_url, "--prefix", prefix)
        settled = all(e["num_in_index"] == e["num_on_worker"] for e in report["workers"])
        if settled and (report["num_stale"], report["num_missing"]) == (0, 0):
            return report
        assert time.monotonic() < deadline, report
        time.sleep(0.05)


def test_a_worker_killed_while_it_moves_blocks_between_tiers_is_clean_after_its_restart(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine core killed right after a prompt that loads blocks back was sent (whatever
    the copies had done by then), then the worker started again under its name: the index
    agrees with it, both entries."""
    config = tiered_config(redis_url, "killed")
    rng = np.random.default_rng(1)
    first, other = (rng.integers(0, 256, n * 16 + 1).tolist() for n in (5, 10))
    worker = BackgroundWorker(config)
    try:
        worker.generate(first, max_tokens=1)
        wait_until_copied(worker)
        worker.generate(other, max_tokens=1)
        wait_until_copied(worker)
        request = worker_pb2.WorkerGenerateRequest(
            prompt_token_ids=first, sampling=common_pb2.SamplingParams(max_tokens=1)
        )
        stream = worker.stub.Generate(request, timeout=30)
        for pid in engine_core_pids(os.getpid()):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(grpc.RpcError):
            list(stream)
    finally:
        worker.close()
    restarted = BackgroundWorker(config)
    try:
        restarted.generate(other, max_tokens=1)
        report = audit_until_clean(capsys, redis_url, "killed")
        assert {e["worker_id"] for e in report["workers"]} == {"killed", "killed#gpu"}
    finally:
        restarted.close()
