"""Our paged model against Hugging Face transformers on the same checkpoint files (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvswitch.worker.model_config import ModelConfig
from kvswitch.worker.model_runner import ModelRunner, ScheduledSeq, num_blocks_for_budget
from kvswitch.worker.weights import load_model

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
TOL = {"atol": 1e-4, "rtol": 1e-4}


def save_checkpoint(tmp_path: Path, arch: str, **overrides) -> torch.nn.Module:
    kwargs = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    if arch == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    with torch.no_grad():  # random, non-trivial norms and biases
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name else 0.0))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    hf.config._attn_implementation = "eager"
    return hf.eval()


def hf_logits(hf: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {}),
    ],
)
def test_prefill_decode_and_prefix_hit_match_transformers(
    tmp_path: Path, arch: str, overrides: dict
) -> None:
    hf = save_checkpoint(tmp_path, arch, **overrides)
    model = load_model(tmp_path)
    assert model.config.attention_bias == (arch == "qwen2")
    runner = ModelRunner(model, num_blocks=32, block_size=BLOCK_SIZE)
    gen = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(0, 101, (19,), generator=gen).tolist()
    prompt_b = torch.randint(0, 101, (8,), generator=gen).tolist()

    # Prefill of two prompts in one batch, on scattered blocks.
    blocks_a, blocks_b = [9, 2, 17, 5, 11], [30, 1]
    logits = runner.execute(
        [ScheduledSeq(prompt_a, 0, blocks_a), ScheduledSeq(prompt_b, 0, blocks_b)]
    )
    torch.testing.assert_close(logits[0], hf_logits(hf, prompt_a)[-1], **TOL)
    torch.testing.assert_close(logits[1], hf_logits(hf, prompt_b)[-1], **TOL)

    # Decode step by step (batched: both sequences in each step), greedy.
    seq_a, seq_b = list(prompt_a), list(prompt_b)
    blocks_a.append(12)
    next_a, next_b = int(logits[0].argmax()), int(logits[1].argmax())
    for _ in range(3):
        seq_a.append(next_a)
        seq_b.append(next_b)
        logits = runner.execute(
            [
                ScheduledSeq([next_a], len(seq_a) - 1, blocks_a),
                ScheduledSeq([next_b], len(seq_b) - 1, [*blocks_b, 3]),
            ]
        )
        torch.testing.assert_close(logits[0], hf_logits(hf, seq_a)[-1], **TOL)
        torch.testing.assert_close(logits[1], hf_logits(hf, seq_b)[-1], **TOL)
        next_a, next_b = int(logits[0].argmax()), int(logits[1].argmax())

    # Prefill on top of a cached prefix: reuse prompt A's first 4 blocks, compute only the rest.
    prompt_c = prompt_a[:16] + torch.randint(0, 101, (7,), generator=gen).tolist()
    logits = runner.execute([ScheduledSeq(prompt_c[16:], 16, [*blocks_a[:4], 20, 21])])
    torch.testing.assert_close(logits[0], hf_logits(hf, prompt_c)[-1], **TOL)


def test_default_model_is_deterministic() -> None:
    a, b = load_model(None), load_model(None)
    assert a.config == ModelConfig.tiny()
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    runner = ModelRunner(a, num_blocks=8, block_size=16)
    logits = runner.execute([ScheduledSeq([256, 72, 105], 0, [0])])
    assert logits.shape == (1, 257)
    assert logits.std() > 0


def test_kv_blocks_from_budget() -> None:
    model = load_model(None)
    # 2 (K, V) x 2 layers x 2 KV heads x 64 dims x 16 tokens x 4 bytes = 32 KiB per block.
    assert num_blocks_for_budget(model, 16, torch.float32, 1 << 20) == 32
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_budget(model, 16, torch.float32, 1000)


def test_bad_checkpoints_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model(tmp_path)
    save_checkpoint(tmp_path, "llama")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_model(tmp_path)


def test_random_presets() -> None:
    tiny = load_model("random:tiny")
    assert tiny.config == ModelConfig.tiny()
    assert torch.equal(tiny.lm_head.weight, load_model(None).lm_head.weight)
    big = ModelConfig.random_preset("llama-1b")
    assert (big.num_layers, big.hidden_size, big.num_kv_heads) == (16, 2048, 8)
    with pytest.raises(ValueError, match="unknown random model"):
        load_model("random:nope")


def test_engine_stops_on_the_checkpoints_eos_and_at_its_context_length(tmp_path: Path) -> None:
    from kvswitch.worker.engine import EngineConfig, LLMEngine
    from kvswitch.worker.request import FinishReason, SamplingParams

    def run(eos_token_id: int | None, prompt: list[int], max_tokens: int):
        save_checkpoint(tmp_path, "llama", eos_token_id=eos_token_id)  # same weights each time
        engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=BLOCK_SIZE))
        engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens))
        tokens, reason = [], None
        while engine.has_unfinished():
            for output in engine.step():
                tokens += output.new_token_ids
                reason = output.finish_reason
        return tokens, reason

    prompt = list(range(1, 20))
    free, reason = run(None, prompt, 12)
    assert (len(free), reason) == (12, FinishReason.LENGTH)
    eos = free[4]  # EOS from config.json ends the request there
    tokens, reason = run(eos, prompt, 12)
    assert (tokens, reason) == (free[: free.index(eos) + 1], FinishReason.STOP)
    # max_position_embeddings is 256: a 250-token prompt has room for 6 tokens, whatever max_tokens.
    tokens, reason = run(None, [i % 100 + 1 for i in range(250)], 50)
    assert (len(tokens), reason) == (6, FinishReason.LENGTH)
