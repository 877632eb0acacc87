"""A worker slow to answer keeps its streams: its serving loop held up past the load poll's
timeout (a real worker process, ``tests/slow_worker.py``), a stream running there ends there,
with no failover. The router runs in this process (``BackgroundCluster``), over real gRPC."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvswitch.client import Client
from kvswitch.serving import READY_MARK
from kvswitch.tokenizer import ByteTokenizer
from kvswitch.worker.engine import LLMEngine
from kvswitch.worker.request import SamplingParams
from kvswitch.worker.server import start_worker
from tests.router.harness import BLOCK_BYTES, WORKER_CONFIG, BackgroundCluster

SLOW_WORKER = Path(__file__).parents[1] / "slow_worker.py"
BLOCK_S = 1.5  # the serving loop blocked: past the load poll's 1 s timeout
PROMPT = "A worker busy for a moment is not a worker gone. " * 3
MAX_TOKENS = 48


@contextlib.contextmanager
def slow_worker(router_address: str, hold_file: Path, log: Path) -> Iterator[None]:
    """``tests/slow_worker.py`` as worker ``slow`` of the router, in a process group of its own
    (its engine core with it)."""
    env = {**os.environ, "KVSWITCH_TEST_HOLD_FILE": str(hold_file)}
    env["KVSWITCH_TEST_BLOCK_S"] = str(BLOCK_S)
    args = ["worker", "--port", "0", "--worker-id", "slow", "--grace-s", "0"]
    args += ["--index", f"grpc://{router_address}", "--kv-cache-bytes", str(256 * BLOCK_BYTES)]
    with log.open("w") as stderr:
        popen = subprocess.Popen(
            [sys.executable, str(SLOW_WORKER), *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            start_new_session=True,
        )
    try:
        assert popen.stdout is not None
        for line in popen.stdout:
            if READY_MARK in line:
                break
        else:
            raise RuntimeError(f"the slow worker exited before serving; see {log}")
        yield
    finally:
        os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


def wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def test_a_stream_on_a_worker_whose_loop_blocks_past_its_poll_ends_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The stream is routed to ``slow`` (the only worker then), another worker joins, and slow's
    serving loop blocks 1.5 s: its load poll times out, and it is left out of routing for a
    moment, but the stream running there goes on and ends there (one failed poll took the worker
    for lost and moved the stream to the other worker, to compute it again)."""
    caplog.set_level(logging.WARNING, logger="kvswitch.router.workers")
    hold_file = tmp_path / "block-now"
    cluster = BackgroundCluster(num_workers=0)
    directory = cluster.router.router.directory
    try:
        with (
            slow_worker(cluster.address, hold_file, tmp_path / "slow.log"),
            Client(cluster.address, timeout_s=60, max_retries=0) as client,
            ThreadPoolExecutor(1) as pool,
        ):
            wait_for(lambda: [h.worker_id for h in directory.routable()] == ["slow"], "slow")
            future = pool.submit(client.generate, PROMPT, max_tokens=MAX_TOKENS)
            [slow] = directory.handles()
            wait_for(lambda: slow.num_in_flight == 1, "the stream on slow")
            # NOTE: not add_worker, which waits for the router to route to its own workers only.
            w0 = dataclasses.replace(cluster.worker_config, worker_id="w0")
            cluster.workers.append(cluster.run(start_worker(w0)))
            wait_for(lambda: len(directory.routable()) == 2, "w0 routable")
            hold_file.touch()  # slow's loop blocks now, with the stream under way
            result = future.result(timeout=60)
    finally:
        cluster.close()
    # The block was seen: a load poll of slow timed out.
    assert "worker slow stopped answering its load polls" in caplog.text
    assert result.stats.worker_id == "slow"
    assert not result.route.reason.startswith("failover"), result.route.reason
    registry = cluster.router.metrics.registry
    for kind in ("mid_stream", "before_first_token"):
        assert registry.get_sample_value("kvswitch_router_failovers_total", {"kind": kind}) == 0
    reference = LLMEngine(WORKER_CONFIG.engine_config())
    prompt_ids = ByteTokenizer().encode(PROMPT)
    assert list(result.token_ids) == reference.generate([prompt_ids], SamplingParams(MAX_TOKENS))[0]
