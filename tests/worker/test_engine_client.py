"""The engine core behind its client: the same outputs as the engine itself, in a process of its
own or on a thread; admission checked before anything reaches the core; a core that dies is seen
at once and fails what it held, and a core whose serving process dies does not outlive it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvswitch.worker.engine import EngineConfig, LLMEngine
from kvswitch.worker.engine_client import (
    EngineClient,
    EngineDied,
    EngineStartError,
    EngineStopped,
)
from kvswitch.worker.request import RequestOutput, SamplingParams

PROMPTS = [[256, *b"The engine core runs apart. " * 3], [256, *b"A second, shorter prompt"]]


async def collect(queue: asyncio.Queue) -> tuple[list[int], RequestOutput]:
    """The request's tokens, and its last output with the first token's figures copied in."""
    tokens: list[int] = []
    first = None
    while True:
        item = await queue.get()
        if isinstance(item, Exception):
            raise item
        first = first or item
        tokens += item.new_token_ids
        if item.finished:
            item.num_prompt_tokens, item.ttft_s = first.num_prompt_tokens, first.ttft_s
            return tokens, item


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return LLMEngine(EngineConfig()).generate(PROMPTS, SamplingParams(max_tokens=6))


@pytest.mark.parametrize("in_process", [False, True], ids=["process", "thread"])
def test_the_core_produces_what_the_engine_does(
    in_process: bool, expected: list[list[int]]
) -> None:
    engine = EngineClient.start(EngineConfig(), in_process=in_process)
    assert (engine.pid is None) == in_process
    assert engine.pid != os.getpid()

    async def main() -> list[tuple[list[int], RequestOutput]]:
        queues = [
            await engine.submit(f"r{i}", np.array(p), SamplingParams(max_tokens=6))
            for i, p in enumerate(PROMPTS)
        ]
        return [await collect(q) for q in queues]

    try:
        results = asyncio.run(main())
        assert [tokens for tokens, _ in results] == expected
        assert all(last.finish_reason.value == "length" for _, last in results)
        assert results[0][1].num_prompt_tokens == len(PROMPTS[0])
        assert all(last.ttft_s > 0 for _, last in results)
        load = engine.load
        assert load.num_running_requests == load.num_waiting_requests == 0
        assert load.num_free_blocks == load.num_total_blocks == engine.facts.num_blocks
        assert engine.counters.num_steps >= 6
        event_seq, cached = engine.snapshot().result(timeout=10)
        assert event_seq == engine.event_seq >= 1
        assert len(cached) == sum(len(p) // 16 for p in PROMPTS)  # every full prompt block
    finally:
        engine.stop()
    with pytest.raises(EngineStopped):
        engine.snapshot()


def test_admission_refuses_what_can_never_run_before_the_core_sees_it() -> None:
    engine = EngineClient.start(EngineConfig(), in_process=True)
    vocab_size, max_model_len = engine.facts.vocab_size, engine.facts.max_model_len
    cases = [
        ([], "the prompt is empty"),
        ([1, vocab_size], f"token id {vocab_size} is outside the vocabulary [0, {vocab_size})"),
        ([1, -3, 2], f"token id -3 is outside the vocabulary [0, {vocab_size})"),
        ([1] * max_model_len, f"this worker's context length is {max_model_len}"),
    ]

    async def main() -> None:
        for prompt, message in cases:
            with pytest.raises(ValueError, match=re.escape(message)):
                await engine.submit("bad", np.array(prompt, np.int64), SamplingParams())
        with pytest.raises(ValueError, match="token ids must be integers, got float64"):
            await engine.submit("bad", [1.5, 2], SamplingParams())
        with pytest.raises(ValueError, match="lora: unknown adapter 'x'"):
            await engine.submit("bad", [1, 2], SamplingParams(), lora="x")
        with pytest.raises(ValueError, match=r"num_resumed_tokens must be in \[0, 2\)"):
            await engine.submit("bad", [1, 2], SamplingParams(), num_resumed_tokens=2)
        running = await engine.submit("twice", [1, 2, 3], SamplingParams(max_tokens=400))
        with pytest.raises(ValueError, match="request id 'twice' is already running"):
            await engine.submit("twice", [1, 2, 3], SamplingParams())
        engine.abort("twice")
        assert running.empty() or not (await running.get()).finished

    try:
        asyncio.run(main())
        deadline = time.monotonic() + 5
        while engine.load.num_running_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.load.num_free_blocks == engine.load.num_total_blocks
        assert engine.counters.num_failed_steps == 0
    finally:
        engine.stop()


def test_a_killed_core_fails_its_streams_and_refuses_new_work() -> None:
    engine = EngineClient.start(EngineConfig())
    deaths: list[str] = []
    engine.on_death(deaths.append)

    async def main() -> None:
        queue = await engine.submit("long", PROMPTS[0], SamplingParams(max_tokens=100_000))
        first = await queue.get()
        assert isinstance(first, RequestOutput) and not first.finished
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineDied, match=r"the engine core died \(killed by SIGKILL\)"):
            await asyncio.wait_for(collect(queue), 10)
        with pytest.raises(EngineDied):
            await engine.submit("after", PROMPTS[1], SamplingParams())
        with pytest.raises(EngineDied):
            engine.snapshot()
        engine.abort("long")  # a no-op now, and never raises

    try:
        asyncio.run(main())
        assert deaths == ["the engine core died (killed by SIGKILL)"]
    finally:
        engine.stop()


def test_a_core_whose_model_cannot_load_says_why() -> None:
    with pytest.raises(EngineStartError, match=r"/nonexistent/checkpoint has no config\.json"):
        EngineClient.start(EngineConfig(model="/nonexistent/checkpoint"))


# A script that starts an engine without a main guard: its spawned core runs the script again,
# and that second start fails, as multiprocessing says it must.
UNGUARDED_SCRIPT = """
from kvswitch.worker.engine_client import EngineClient
from kvswitch.worker.engine_config import EngineConfig

EngineClient.start(EngineConfig())
"""


def test_a_core_that_cannot_start_reports_why_not_a_cleanup_error(tmp_path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "bootstrapping phase" in done.stderr  # the core's own cause, as it printed it
    assert "can only join a started process" not in done.stderr
    assert "EngineStartError" in done.stderr


# A serving process whose core is busy decoding when the process is killed.
ORPHAN_SCRIPT = """
import asyncio, time
from kvswitch.worker.engine_client import EngineClient
from kvswitch.worker.engine_config import EngineConfig
from kvswitch.worker.request import SamplingParams

async def main():
    engine = EngineClient.start(EngineConfig())
    queue = await engine.submit("long", [1, 2, 3], SamplingParams(max_tokens=100_000))
    await queue.get()
    print(engine.pid, flush=True)
    time.sleep(600)

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_the_core_does_not_outlive_its_serving_process(tmp_path) -> None:
    script = tmp_path / "serve.py"
    script.write_text(ORPHAN_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(parent.stdout.readline())
        os.kill(core_pid, 0)  # it runs
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(core_pid):
            assert time.monotonic() < deadline, "the engine core outlived its serving process"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
