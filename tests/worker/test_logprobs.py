"""Logprobs of output and prompt tokens, and prompt embeddings, from the engine, against a cold
full forward of transformers on the same checkpoint; the hidden-state cache serves a cached
prefix's rows, and a block whose rows are gone is computed again, never guessed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvswitch.worker.engine import LLMEngine
from kvswitch.worker.engine_config import EngineConfig
from kvswitch.worker.request import RequestOutput, SamplingParams, TokenLogprobs
from tests.worker.hf_reference import save_checkpoint

TOL = 2e-4
BLOCK = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp("llama")
    return save_checkpoint(path, "llama"), path


def engine_for(path: Path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), block_size=BLOCK, **overrides))


def run(engine: LLMEngine, request_id: str, prompt: list[int], params, **options):
    """The request's outputs, run to its end."""
    engine.add_request(request_id, prompt, params, **options)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def hf_logprobs(hf: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def hf_hidden(hf: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """The final hidden states (after the last norm) of a cold forward."""
    with torch.no_grad():
        return hf(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1][0]


def assert_prompt_logprobs(
    hf: torch.nn.Module, prompt: list[int], got: list[TokenLogprobs], num_top: int
) -> None:
    want = hf_logprobs(hf, prompt)
    assert len(got) == len(prompt) - 1
    for position, entry in enumerate(got, start=1):
        row = want[position - 1]
        assert entry.logprob == pytest.approx(row[prompt[position]].item(), abs=TOL)
        values = row.topk(num_top).values
        assert list(entry.top_logprobs) == pytest.approx(values.tolist(), abs=TOL)
        # NOTE: ids may swap only where their logprobs tie within the tolerance.
        assert [row[i].item() for i in entry.top_token_ids] == pytest.approx(
            values.tolist(), abs=TOL
        )


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 101, length).tolist()


def test_sampled_tokens_logprobs_are_the_models(checkpoint) -> None:
    hf, path = checkpoint
    engine = engine_for(path)
    tokens = prompt(1, 37)
    outputs = run(engine, "a", tokens, SamplingParams(max_tokens=6, logprobs=3))
    output_ids = [o.new_token_ids[0] for o in outputs]
    want = hf_logprobs(hf, tokens + output_ids)
    for step, output in enumerate(outputs):
        row = want[len(tokens) - 1 + step]
        (entry,) = output.logprobs.tokens()
        assert entry.logprob == pytest.approx(row[output_ids[step]].item(), abs=TOL)
        assert entry.top_token_ids[0] == output_ids[step]  # greedy: the most likely
        assert list(entry.top_logprobs) == pytest.approx(row.topk(3).values.tolist(), abs=TOL)
    # Not asked: none.
    assert all(o.logprobs is None for o in run(engine, "b", tokens, SamplingParams(max_tokens=2)))


def test_sampled_rows_logprobs_come_from_the_model_not_the_temperature(checkpoint) -> None:
    hf, path = checkpoint
    engine = engine_for(path)
    tokens = prompt(2, 20)
    params = SamplingParams(max_tokens=1, temperature=5.0, seed=3, logprobs=0)
    (output,) = run(engine, "a", tokens, params)
    want = hf_logprobs(hf, tokens)[-1]
    (entry,) = output.logprobs.tokens()
    assert entry.logprob == pytest.approx(want[output.new_token_ids[0]].item(), abs=TOL)
    assert entry.top_token_ids == ()


@pytest.mark.parametrize("cache", [True, False], ids=["hidden cache", "no hidden cache"])
def test_prompt_logprobs_equal_a_cold_forward_with_and_without_a_hit(checkpoint, cache) -> None:
    hf, path = checkpoint
    engine = engine_for(path, cache_hidden_states=cache)
    shared = prompt(3, 3 * BLOCK)
    first, second = shared + prompt(4, 21), shared + prompt(5, 9)
    (out,) = run(engine, "a", first, SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert out.num_cached_tokens == 0
    assert_prompt_logprobs(hf, first, out.prompt_logprobs.tokens(), 2)

    (out,) = run(engine, "b", second, SamplingParams(max_tokens=1, prompt_logprobs=2))
    # With the cache the shared blocks' rows are reused; without it they are computed (and so
    # is their KV, as vLLM does for prompt logprobs).
    assert out.num_cached_tokens == (3 * BLOCK if cache else 0)
    assert_prompt_logprobs(hf, second, out.prompt_logprobs.tokens(), 2)
    # A request that wants no hidden states hits the KV either way.
    (out,) = run(engine, "c", second, SamplingParams(max_tokens=1))
    assert out.num_cached_tokens == 3 * BLOCK and out.prompt_logprobs is None


def test_a_prompt_computed_in_chunks_gathers_every_row(checkpoint) -> None:
    hf, path = checkpoint
    engine = engine_for(path, cache_hidden_states=True, max_num_batched_tokens=24)
    tokens = prompt(6, 70)
    (out,) = run(engine, "a", tokens, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert_prompt_logprobs(hf, tokens, out.prompt_logprobs.tokens(), 1)
    (out,) = run(engine, "b", tokens, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert out.num_cached_tokens == 4 * BLOCK
    assert_prompt_logprobs(hf, tokens, out.prompt_logprobs.tokens(), 1)


def test_blocks_decoded_into_are_cached_with_their_rows(checkpoint) -> None:
    hf, path = checkpoint
    engine = engine_for(path, cache_hidden_states=True)
    tokens = prompt(7, 2 * BLOCK - 3)
    outputs = run(engine, "a", tokens, SamplingParams(max_tokens=BLOCK + 4))
    whole = tokens + [o.new_token_ids[0] for o in outputs]
    (out,) = run(engine, "b", whole, SamplingParams(max_tokens=1, prompt_logprobs=0))
    # The second and third blocks filled while decoding: their rows came from decode steps.
    assert out.num_cached_tokens == 3 * BLOCK
    assert_prompt_logprobs(hf, whole, out.prompt_logprobs.tokens(), 0)


def test_a_reused_block_has_no_rows_and_is_computed_again(checkpoint) -> None:
    hf, path = checkpoint
    # Room for 8 blocks: the second prompt's blocks evict the first one's.
    per_block = 2 * 2 * 2 * 16 * BLOCK * 4  # K and V, 2 layers, 2 heads of 16, fp32
    engine = engine_for(path, cache_hidden_states=True, kv_cache_bytes=8 * per_block)
    first, other = prompt(8, 4 * BLOCK + 1), prompt(9, 7 * BLOCK + 1)
    run(engine, "a", first, SamplingParams(max_tokens=1))
    run(engine, "b", other, SamplingParams(max_tokens=1))
    (out,) = run(engine, "c", first, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert out.num_cached_tokens == 0
    assert_prompt_logprobs(hf, first, out.prompt_logprobs.tokens(), 1)


def test_blocks_written_by_a_transfer_bring_no_rows(checkpoint) -> None:
    hf, path = checkpoint
    source = engine_for(path)
    target = engine_for(path, cache_hidden_states=True)
    tokens = prompt(10, 3 * BLOCK + 5)
    run(source, "a", tokens, SamplingParams(max_tokens=1))
    hashes = source.hasher().hash_blocks(np.array(tokens))
    num_blocks, data = source.read_cached_blocks(hashes)
    assert target.write_cached_blocks(hashes[:num_blocks], data) == 3
    (out,) = run(target, "b", tokens, SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert out.num_cached_tokens == 0  # the KV is here, its rows are not: computed
    assert_prompt_logprobs(hf, tokens, out.prompt_logprobs.tokens(), 0)
    (out,) = run(target, "c", tokens, SamplingParams(max_tokens=1))
    assert out.num_cached_tokens == 3 * BLOCK


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_pool_transformers_hidden_states(checkpoint, pooling) -> None:
    hf, path = checkpoint
    engine = engine_for(path, cache_hidden_states=True)
    tokens = prompt(11, 2 * BLOCK + 7)
    want = hf_hidden(hf, tokens)
    want = want[-1] if pooling == "last" else want.mean(dim=0)
    want = torch.nn.functional.normalize(want, dim=0)
    for request_id in ("cold", "warm"):
        (out,) = run(engine, request_id, tokens, SamplingParams(max_tokens=1), pooling=pooling)
        assert out.num_cached_tokens == (0 if request_id == "cold" else 2 * BLOCK)
        assert out.embedding == pytest.approx(want.tolist(), abs=TOL)


def test_bad_asks_are_refused(checkpoint) -> None:
    _, path = checkpoint
    engine = engine_for(path)
    with pytest.raises(ValueError, match="logprobs must be in"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="pooling must be one of"):
        engine.add_request("a", [1, 2], SamplingParams(), pooling="cls")
    request = engine.make_request("b", [1] * 40, SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="cannot take its prompt's KV from a peer"):
        engine.add_awaiting_kv(request)
    with pytest.raises(ValueError, match="cache_hidden_states needs"):
        EngineConfig(device="cuda", cuda_graphs=True, cache_hidden_states=True)
    assert EngineConfig(device="cuda", cache_hidden_states=True).cuda_graphs is False


def test_a_blocks_rows_belong_to_the_hash_they_were_recorded_for() -> None:
    from kvswitch.worker.block_pool import KVBlock
    from kvswitch.worker.hidden_cache import HiddenStateCache

    cache = HiddenStateCache(4, 2, 3, torch.float32, max_bytes=3 * 2 * 3 * 4)
    assert (cache.num_blocks, cache.bytes_per_block) == (3, 24)  # capped at 3 blocks
    blocks = [KVBlock(i) for i in range(4)]
    for block, name in zip(blocks, [b"h0", b"h1", b"h2", b"h3"], strict=True):
        block.block_hash = name
    rows = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    cache.write(np.arange(8), rows)  # slots 6 and 7 are past the cap: dropped
    cache.record([0, 1, 2, 3], [b"h0", b"h1", b"h2", b"h3"])
    assert cache.num_cached_blocks(blocks) == 3  # block 3 has no rows
    assert torch.equal(cache.read([1, 0]), torch.cat([rows[2:4], rows[0:2]]))
    blocks[1].block_hash = b"other"  # the block now holds other KV (a transfer, say)
    assert cache.num_cached_blocks(blocks) == 1
    blocks[1].block_hash = b"h1"
    cache.write(np.array([2]), rows[:1])  # a step writes into block 1: its rows are gone
    assert cache.num_cached_blocks(blocks) == 1
