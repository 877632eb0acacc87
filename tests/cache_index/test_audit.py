"""``kvswitch index stats`` / ``audit`` against a real Redis and a real worker publishing to it."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import redis

from cache_index.redis_index import KeySchema
from kvswitch.cli import main
from tests.worker.background import BackgroundWorker
from worker.server import WorkerConfig

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
