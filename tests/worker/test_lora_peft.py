"""Adapters trained with PEFT serve exactly: kvswitch's logits and greedy tokens for a request
naming an adapter are transformers' with PEFT's adapter on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvswitch.worker.engine import EngineConfig, LLMEngine
from kvswitch.worker.lora import MODULES
from kvswitch.worker.request import SamplingParams
from tests.worker.hf_reference import TOL, hf_logits, save_checkpoint
from tests.worker.teacher_forcing import logits_after_every_token

peft = pytest.importorskip("peft")


def save_peft_adapter(
    hf: torch.nn.Module, folder: Path, *, seed: int, **settings
) -> torch.nn.Module:
    """``hf`` with a PEFT LoRA adapter of random weights (PEFT starts B at zero), saved to
    ``folder`` with ``save_pretrained``; returns the adapted model."""
    config = peft.LoraConfig(lora_dropout=0.0, **settings)
    model = peft.get_peft_model(hf, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(folder)
    return model.eval()


def test_greedy_tokens_and_logits_are_transformers_with_peft(tmp_path: Path) -> None:
    """An adapter on every module, scaled as rsLoRA scales (alpha / sqrt(r)): cold and over a
    cached prefix of the same adapter's blocks, the engine's greedy tokens are those of
    transformers with the adapter, and each position's logits match it."""
    settings = {"r": 8, "lora_alpha": 16, "target_modules": list(MODULES), "use_rslora": True}
    hf = save_checkpoint(tmp_path / "base", "llama")
    adapted = save_peft_adapter(hf, tmp_path / "adapter", seed=3, **settings)
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path / "base"), block_size=4, lora=(f"ft={tmp_path / 'adapter'}",)
        )
    )
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 101, (21,), generator=generator).tolist()
    second = prompt[:16] + torch.randint(0, 101, (7,), generator=generator).tolist()
    for request_id, tokens, cached in [("cold", prompt, 0), ("hit", second, 16)]:
        request = engine.make_request(request_id, tokens, SamplingParams(max_tokens=5), lora="ft")
        engine.add(request)
        output = []
        while engine.has_unfinished():
            output += engine.step().token_ids
        assert request.num_cached_tokens == cached
        sequence = list(tokens)
        for _ in range(5):  # greedy, stopping at the checkpoint's end of sequence as it does
            sequence.append(int(hf_logits(adapted, sequence)[-1].argmax()))
            if sequence[-1] in engine.model_config.eos_token_ids:
                break
        assert output == sequence[len(tokens) :], request_id
        # The logits, not only their argmax: every position of the adapted sequence.
        runner_logits = logits_after_every_token(engine, sequence, lora="ft")
        torch.testing.assert_close(runner_logits, hf_logits(adapted, sequence), **TOL)
    adapted_logits = hf_logits(adapted, prompt)
    with adapted.disable_adapter():  # and the adapter makes a difference
        assert (hf_logits(adapted, prompt) - adapted_logits).abs().max() > 1e-2
