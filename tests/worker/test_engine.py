"""The engine end to end on the built-in model: batching, chunked prefill, preemption, caching."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvswitch.worker.engine import EngineConfig, LLMEngine, kv_cache_budget_bytes
from kvswitch.worker.request import BATCH, INTERACTIVE, FinishReason, SamplingParams

BLOCK_BYTES = 32 << 10  # one 16-token block of the built-in model in fp32

DOC = list(b"# Staff list\n| 1 | Ada Stone | 34 | Engineer |\n| 2 | Ben Reyes | 51 | Chef |\n" * 2)


def prompts() -> list[list[int]]:
    """Prompts that share a long document prefix, plus two unrelated ones."""
    questions = [b"Q: how old is Ada?", b"Q: what does Ben do?", b"Q: who is 34?", b"Q: row 2?"]
    shared = [[256, *DOC, *q] for q in questions]
    return [*shared, [256, *b"hello there, a short one"], [256, *b"x" * 70]]


def run(engine: LLMEngine, params: SamplingParams) -> list[list[int]]:
    return engine.generate(prompts(), params)


def make_engine(**overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**overrides))


GREEDY = SamplingParams(max_tokens=24)


def test_prefix_caching_does_not_change_greedy_outputs() -> None:
    cached = make_engine()
    uncached = make_engine(enable_prefix_caching=False)
    out_cached = run(cached, GREEDY)
    assert out_cached == run(uncached, GREEDY)
    assert all(len(tokens) == 24 for tokens in out_cached)
    # A second round over the same prompts hits the cache and still matches.
    again = run(cached, GREEDY)
    assert again == out_cached
    assert cached.stats.num_cached_tokens > 0
    assert uncached.stats.num_cached_tokens == 0


def test_outputs_survive_preemption_and_chunked_prefill() -> None:
    reference = run(make_engine(enable_prefix_caching=False), GREEDY)
    tight = make_engine(kv_cache_bytes=24 * BLOCK_BYTES, max_num_batched_tokens=40)
    assert run(tight, GREEDY) == reference
    assert tight.stats.num_preemptions > 0
    assert tight.stats.max_step_tokens <= 40
    tight_uncached = make_engine(
        kv_cache_bytes=24 * BLOCK_BYTES, max_num_batched_tokens=40, enable_prefix_caching=False
    )
    assert run(tight_uncached, GREEDY) == reference
    assert tight_uncached.stats.num_preemptions > 0
    tight.kv_cache.check_integrity()
    assert tight.kv_cache.num_free_blocks == tight.kv_cache.pool.num_blocks


def test_seeded_sampling_is_reproducible_in_any_batch() -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    alone = make_engine().generate([prompts()[0]], params)[0]
    batched = make_engine().generate(prompts(), [params, *[GREEDY] * 5])[0]
    assert alone == batched
    other_seed = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=8)
    assert make_engine().generate([prompts()[0]], other_seed)[0] != alone


def _run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams, **kwargs) -> list[int]:
    engine.add_request("one", prompt, params, **kwargs)
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for output in engine.step() for t in output.new_token_ids]
    return tokens


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_a_resumed_request_continues_exactly(temperature: float) -> None:
    """What a router does when a worker dies mid-stream: the prompt plus the tokens already
    sent, on a fresh engine, gives the rest of the same output (seeded or greedy)."""
    prompt = prompts()[0]
    params = SamplingParams(max_tokens=14, temperature=temperature, seed=11)
    whole = _run_one(make_engine(), prompt, params)
    assert len(whole) == 14
    for num_sent in (1, 5, 13):
        rest_params = SamplingParams(max_tokens=14 - num_sent, temperature=temperature, seed=11)
        rest = _run_one(
            make_engine(),
            prompt + whole[:num_sent],
            rest_params,
            num_resumed_tokens=num_sent,
        )
        assert whole[:num_sent] + rest == whole
    # Without the offset, a seeded request would start its draws over.
    if temperature:
        restart_params = SamplingParams(max_tokens=9, temperature=temperature, seed=11)
        restarted = _run_one(make_engine(), prompt + whole[:5], restart_params)
        assert restarted != whole[5:]


def test_stop_tokens_and_max_tokens_finish_requests() -> None:
    engine = make_engine()
    first = engine.generate([prompts()[0]], GREEDY)[0]
    stop_at = first[5]
    engine.add_request(
        "stop", prompts()[0], SamplingParams(max_tokens=24, stop_token_ids=(stop_at,))
    )
    engine.add_request("len", prompts()[1], SamplingParams(max_tokens=3))
    finished = {}
    tokens: dict[str, list[int]] = {"stop": [], "len": []}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {"stop": FinishReason.STOP, "len": FinishReason.LENGTH}
    assert tokens["stop"] == first[: first.index(stop_at) + 1]
    assert len(tokens["len"]) == 3


def test_first_output_reports_cache_and_ttft() -> None:
    engine = make_engine()
    engine.generate([prompts()[0]], GREEDY)
    engine.add_request("r", prompts()[1], GREEDY)
    [first] = engine.step()
    assert first.ttft_s is not None and first.ttft_s > 0
    assert first.num_prompt_tokens == len(prompts()[1])
    shared = len(DOC) + 1  # BOS + document
    assert first.num_cached_tokens == shared // 16 * 16
    [second] = engine.step()
    assert second.ttft_s is None


def test_abort_frees_blocks() -> None:
    engine = make_engine()
    engine.add_request("a", prompts()[0], GREEDY)
    engine.step()
    assert engine.kv_cache.num_free_blocks < engine.kv_cache.pool.num_blocks
    assert engine.abort("a") is True
    assert engine.abort("a") is False
    assert not engine.has_unfinished()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.pool.num_blocks


@pytest.mark.parametrize(
    "prompt,params,kwargs,message",
    [
        ([], GREEDY, {}, "prompt is empty"),
        ([1, 257], GREEDY, {}, "outside the vocabulary"),
        ([1, -1], GREEDY, {}, "outside the vocabulary"),
        ([1, 2], GREEDY, {"lora": "sql-adapter"}, "lora: unknown adapter"),
        ([1] * 20000, GREEDY, {}, "context length"),
        ([1, 2], GREEDY, {"num_resumed_tokens": 2}, "num_resumed_tokens"),
        ([1, 2], GREEDY, {"num_resumed_tokens": -1}, "num_resumed_tokens"),
    ],
)
def test_bad_requests_are_rejected(prompt, params, kwargs, message) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params, **kwargs)
    assert not engine.has_unfinished()
    assert engine.generate([[256, 65]], SamplingParams(max_tokens=2))[0]  # still serving


def test_engine_config_is_validated() -> None:
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match="holds no block"):
        make_engine(kv_cache_bytes=100)


def test_gpu_memory_fraction_needs_a_gpu_and_a_sane_value() -> None:
    with pytest.raises(ValueError, match="cuda device"):
        EngineConfig(gpu_memory_fraction=0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        EngineConfig(device="cuda", gpu_memory_fraction=1.5)
    assert kv_cache_budget_bytes(EngineConfig(kv_cache_bytes=1 << 20)) == 1 << 20


def test_cpu_threads_bounds_the_engine_cores_torch_threads() -> None:
    """Several CPU workers on one host each take a share of the cores (kvswitch up gives them
    cores // workers)."""
    code = (
        "import torch\n"
        "from kvswitch.worker.engine_config import EngineConfig\n"
        "from kvswitch.worker.engine_core import _build_engine\n"
        "_build_engine(EngineConfig(cpu_threads=1, kv_cache_bytes=1 << 20))\n"
        "print(torch.get_num_threads())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "1"
    with pytest.raises(ValueError, match="cpu_threads must be >= 0"):
        EngineConfig(cpu_threads=-1)


def test_an_interactive_request_starts_before_the_batch_ones_waiting() -> None:
    """One sequence at a time: while one runs, two batch requests and then two interactive ones
    queue; the interactive ones start first, each class in arrival order."""
    engine = make_engine(max_num_seqs=1)
    params = SamplingParams(max_tokens=4)
    engine.add_request("running", [256, *b"first in"], params, priority=BATCH)
    engine.step()
    for request_id, priority in [
        ("batch-1", BATCH),
        ("batch-2", BATCH),
        ("chat-1", INTERACTIVE),
        ("chat-2", INTERACTIVE),
    ]:
        engine.add_request(request_id, [256, *request_id.encode()], params, priority=priority)
    started = []
    while engine.has_unfinished():
        started += engine.step().first
    assert started == ["chat-1", "chat-2", "batch-1", "batch-2"]
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("bad", [256, 1], params, priority=7)
