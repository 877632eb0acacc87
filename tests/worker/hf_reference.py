"""Tiny Hugging Face checkpoints with random weights, and our model checked against transformers
on them: the reference every parity test uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvswitch.worker.model_runner import ModelRunner, ScheduledSeq
from kvswitch.worker.weights import load_model

transformers = pytest.importorskip("transformers")

TOL = {"atol": 1e-4, "rtol": 1e-4}
HF_CLASSES = {  # arch -> (config class, model class) names in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def save_checkpoint(tmp_path: Path, arch: str, **overrides) -> torch.nn.Module:
    """A tiny ``arch`` model with random weights (norms and biases too), saved to ``tmp_path``
    with ``save_pretrained``; returns transformers' model (eager attention, eval mode)."""
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
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    config_class, model_class = HF_CLASSES[arch]
    torch.manual_seed(0)
    hf = getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs))
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


def assert_serves_like_transformers(
    hf: torch.nn.Module,
    model_dir: Path,
    prompt: list[int],
    fresh_tokens: list[int],
    num_cached_tokens: int,
    *,
    block_size: int = 16,
    num_decode_steps: int = 2,
) -> None:
    """Our model loaded from ``model_dir`` gives ``hf``'s logits (fp32): for ``prompt`` prefilled
    cold on scattered blocks, for ``num_decode_steps`` greedy decode steps after it, and for a
    second prompt, ``prompt[:num_cached_tokens] + fresh_tokens``, that computes only
    ``fresh_tokens`` on top of the first one's cached blocks (a prefix hit)::

        prompt     |== cached blocks ==|---- rest of prompt ----|decode|
        second     |== cached blocks ==|---- fresh_tokens ----|
    """
    assert num_cached_tokens % block_size == 0, "a prefix hit is whole blocks"
    runner = ModelRunner(load_model(model_dir), num_blocks=64, block_size=block_size)
    num_blocks = -(-(len(prompt) + num_decode_steps) // block_size)
    blocks = list(range(2 * num_blocks, 0, -2))  # scattered, in descending order

    steps = [runner.execute([ScheduledSeq(prompt, 0, blocks)])[0]]
    seq = list(prompt)
    for _ in range(num_decode_steps):
        seq.append(int(steps[-1].argmax()))
        steps.append(runner.execute([ScheduledSeq(seq[-1:], len(seq) - 1, blocks)])[0])
    # One pass of transformers over the whole sequence: its row i is what follows seq[: i + 1].
    reference = hf_logits(hf, seq)[len(prompt) - 1 :]
    torch.testing.assert_close(torch.stack(steps), reference, **TOL)

    second = prompt[:num_cached_tokens] + fresh_tokens
    num_fresh_blocks = -(-len(second) // block_size) - num_cached_tokens // block_size
    fresh_blocks = list(range(2 * num_blocks + 1, 2 * num_blocks + 1 + num_fresh_blocks))
    cached_blocks = blocks[: num_cached_tokens // block_size]
    logits = runner.execute(
        [ScheduledSeq(fresh_tokens, num_cached_tokens, cached_blocks + fresh_blocks)]
    )
    torch.testing.assert_close(logits[0], hf_logits(hf, second)[-1], **TOL)
