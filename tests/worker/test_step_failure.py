"""A step that raises: its requests fail, the others go on, and no block keeps a hash for KV the
step never wrote (the next request with that prefix must compute it, not reuse garbage)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvswitch.cache_index.events import BlockStored, replay
from kvswitch.worker.engine import EngineConfig, LLMEngine, StepFailed
from kvswitch.worker.request import SamplingParams

GREEDY = SamplingParams(max_tokens=8)
DOCUMENT = [256, *b"The failed step must not leave hashes on blocks it never wrote. " * 3]


def prompt(question: bytes) -> list[int]:
    return [*DOCUMENT, *question]


class ExecuteFails:
    """Makes the runner's ``execute_batch`` raise on the calls numbered in ``failing`` (from 1)."""

    def __init__(self, engine: LLMEngine, failing: set[int]) -> None:
        self.calls = 0
        self._failing = failing
        self._execute: Callable = engine.runner.execute_batch
        engine.runner.execute_batch = self  # type: ignore[method-assign]

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self._failing:
            # Before the forward pass: none of the blocks the step cached gets its KV.
            raise RuntimeError("injected: CUDA error: an illegal memory access was encountered")
        return self._execute(*args, **kwargs)


def run_to_end(engine: LLMEngine, outputs: dict[str, list[int]]) -> None:
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)


def reference(*prompts: list[int]) -> list[list[int]]:
    return LLMEngine(EngineConfig()).generate(list(prompts), GREEDY)


def test_a_failed_prefill_uncaches_its_blocks_and_a_retry_computes_them() -> None:
    engine = LLMEngine(EngineConfig())
    ExecuteFails(engine, failing={1})
    engine.add_request("a", prompt(b"Q1?"), GREEDY)
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == ["a"]
    assert not engine.has_unfinished()

    events = engine.take_events()
    assert any(isinstance(e, BlockStored) for e in events)  # cached at allocation ...
    assert replay(events) == set()  # ... and taken back: the index ends with nothing
    assert engine.kv_cache.pool.cached_block_hashes() == []
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.pool.num_blocks

    engine.add_request("again", prompt(b"Q1?"), GREEDY)
    outputs: dict[str, list[int]] = {}
    run_to_end(engine, outputs)
    assert outputs["again"] == reference(prompt(b"Q1?"))[0]
    assert engine.stats.num_cached_tokens == 0  # nothing was reused


def test_a_failed_chunk_keeps_the_blocks_earlier_chunks_wrote() -> None:
    # Chunks of 64 tokens: the first step writes 4 blocks, the second step fails.
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=64))
    ExecuteFails(engine, failing={2})
    engine.add_request("a", prompt(b"Q1?"), GREEDY)
    assert len(engine.step()) == 0  # the first chunk, no token yet
    written = set(engine.kv_cache.pool.cached_block_hashes())
    assert len(written) == 4
    with pytest.raises(StepFailed):
        engine.step()
    assert set(engine.kv_cache.pool.cached_block_hashes()) == written
    assert replay(engine.take_events()) == written
    engine.kv_cache.check_integrity()

    engine.add_request("again", prompt(b"Q1?"), GREEDY)
    outputs: dict[str, list[int]] = {}
    run_to_end(engine, outputs)
    assert outputs["again"] == reference(prompt(b"Q1?"))[0]
    assert engine.stats.num_cached_tokens == 4 * 16


def test_requests_sharing_a_block_the_step_never_wrote_fail_together_and_others_go_on() -> None:
    # "a" and "b" share the document and run in the failing step ("b" hits "a"'s blocks, cached
    # moments before); "c" waits for a sequence slot and must be untouched.
    engine = LLMEngine(EngineConfig(max_num_seqs=2))
    calls = ExecuteFails(engine, failing={1})
    questions = {"a": b"Q1?", "b": b"Q2?", "c": b"Q3?"}
    for request_id, question in questions.items():
        engine.add_request(request_id, prompt(question), GREEDY)
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert sorted(failed.value.request_ids) == ["a", "b"]
    assert engine.kv_cache.pool.cached_block_hashes() == []
    engine.kv_cache.check_integrity()

    outputs: dict[str, list[int]] = {}
    run_to_end(engine, outputs)
    assert calls.calls > 1
    assert outputs == {"c": reference(prompt(b"Q3?"))[0]}
    assert replay(engine.take_events()) == set(engine.kv_cache.pool.cached_block_hashes())
    engine.kv_cache.check_integrity()


def test_a_failure_while_sampling_fails_the_step_and_keeps_the_written_blocks() -> None:
    engine = LLMEngine(EngineConfig())
    engine.add_request("a", prompt(b"Q1?"), GREEDY)

    def broken_sample(*args, **kwargs):
        raise RuntimeError("injected: probability tensor contains inf or nan")

    engine.sampler.sample = broken_sample  # type: ignore[method-assign]
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == ["a"]
    # The forward pass finished, so the blocks it cached hold the KV their hashes name.
    assert len(engine.kv_cache.pool.cached_block_hashes()) == len(prompt(b"Q1?")) // 16
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.pool.num_blocks
