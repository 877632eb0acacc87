"""An engine step that raises, on real processes: the request is tried on one more worker, not on
every worker, and no worker's cache (nor the index) keeps blocks whose KV was never written."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvswitch.app.cli import main
from kvswitch.client import Client, KvswitchError
from kvswitch.deploy.local import ClusterConfig, LocalCluster, running
from kvswitch.tokenizer import ByteTokenizer
from kvswitch.worker.engine import EngineConfig, LLMEngine
from kvswitch.worker.request import SamplingParams

FAULTY_WORKER = Path(__file__).parents[1] / "faulty_worker.py"
FAIL_ON = "~"  # each worker's first step that computes this character raises
DOCUMENT = "Blocks are cached when they are allocated, before the step writes them. " * 3
PROMPT = f"{DOCUMENT}{FAIL_ON} What breaks?"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    token = ByteTokenizer().encode(FAIL_ON)[-1]  # after the BOS token
    monkeypatch.setenv("KVSWITCH_TEST_FAIL_ON_TOKEN", str(token))
    monkeypatch.setenv("KVSWITCH_TEST_FAIL_TIMES", "1")
    config = ClusterConfig(workers=3, port=0, grace_s=0.5)
    command = (sys.executable, str(FAULTY_WORKER))
    with running(config, log_dir=tmp_path, worker_command=command) as cluster:
        yield cluster


def workers_that_failed(cluster: LocalCluster, expected: int) -> list[str]:
    deadline = time.monotonic() + 5.0
    while True:
        failed = [
            f"worker-{i}"
            for i in range(3)
            if "injected failure" in (cluster.log_dir / f"worker-{i}.log").read_text()
        ]
        if len(failed) >= expected or time.monotonic() > deadline:
            return failed
        time.sleep(0.05)


def test_a_request_that_breaks_engines_fails_over_once_and_poisons_no_cache(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    with Client(cluster.address, max_retries=0, timeout_s=60) as client:
        with pytest.raises(KvswitchError) as error:
            client.generate(PROMPT, max_tokens=8)
        assert error.value.code == grpc.StatusCode.INTERNAL
        assert "failed the engines of 2 workers" in error.value.details
        # One failover, not max_failovers: the third worker never saw the request.
        assert len(workers_that_failed(cluster, expected=3)) == 2

        # The two failed steps cached the prompt's blocks and took them back: the same prompt
        # now finds nothing cached anywhere and computes it (it would read never-written KV).
        time.sleep(0.3)  # the workers publish their events every 20 ms
        result = client.generate(PROMPT, max_tokens=8)
    reference = LLMEngine(EngineConfig())
    prompt_ids = ByteTokenizer().encode(PROMPT)
    assert list(result.token_ids) == reference.generate([prompt_ids], SamplingParams(8))[0]
    assert result.stats.num_cached_tokens == 0

    time.sleep(0.3)
    capsys.readouterr()
    assert main(["index", "audit", "--index", cluster.index_url]) == 0
    audit = json.loads(capsys.readouterr().out)
    assert len(audit["workers"]) == 3
    assert cluster.dead_processes() == []
