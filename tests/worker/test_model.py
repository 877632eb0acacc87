"""Our paged model against Hugging Face transformers on the same checkpoint files (fp32)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvswitch.worker.engine import LLMEngine
from kvswitch.worker.engine_config import EngineConfig
from kvswitch.worker.model_config import ModelConfig
from kvswitch.worker.model_runner import ModelRunner, ScheduledSeq, num_blocks_for_budget
from kvswitch.worker.weights import load_model
from tests.worker.hf_reference import (
    TOL,
    assert_serves_like_transformers,
    hf_logits,
    save_checkpoint,
)

BLOCK_SIZE = 4


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {}),
        ("mistral", {}),
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


def test_a_config_missing_a_field_or_not_json_is_one_line_naming_the_file(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, "llama")
    config = tmp_path / "config.json"
    hf = json.loads(config.read_text())
    del hf["num_attention_heads"]
    config.write_text(json.dumps(hf))
    with pytest.raises(ValueError) as raised:
        load_model(tmp_path)
    assert str(raised.value) == (
        f"{config} has no 'num_attention_heads', which LlamaForCausalLM needs"
    )
    config.write_text("{not json")
    with pytest.raises(ValueError, match=rf"^{config} is not valid JSON: "):
        load_model(tmp_path)


def test_a_worker_whose_checkpoint_lacks_a_field_says_so_in_one_line(tmp_path: Path) -> None:
    """The engine core loads the model in a process of its own: its refusal must reach the
    operator as the worker's one line, with no traceback from either process."""
    save_checkpoint(tmp_path, "llama")
    hf = json.loads((tmp_path / "config.json").read_text())
    del hf["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    command = [sys.executable, "-m", "kvswitch.app.cli", "worker", "--port", "0"]
    done = subprocess.run(
        [*command, "--model", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    # The core's refusal is all there is to it: no warning about killing a core on its way out.
    assert "engine core" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"kvswitch worker: cannot load the model: {tmp_path / 'config.json'} has no "
        "'hidden_size', which LlamaForCausalLM needs"
    )


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

    def run(
        eos_token_id: int | None,
        prompt: list[int],
        max_tokens: int,
        generation_eos: list[int] | None = None,
    ):
        save_checkpoint(tmp_path, "llama", eos_token_id=eos_token_id)  # same weights each time
        if generation_eos is not None:
            (tmp_path / "generation_config.json").write_text(
                json.dumps({"eos_token_id": generation_eos})
            )
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
    # So does one that only generation_config.json lists (as Llama 3 instruct lists <|eot_id|>).
    tokens, reason = run(None, prompt, 12, generation_eos=[100, eos])
    assert (tokens, reason) == (free[: free.index(eos) + 1], FinishReason.STOP)
    # max_position_embeddings is 256: a 250-token prompt has room for 6 tokens, whatever max_tokens.
    tokens, reason = run(None, [i % 100 + 1 for i in range(250)], 50)
    assert (len(tokens), reason) == (6, FinishReason.LENGTH)


def test_generation_config_eos_ids_join_the_configs(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, "llama", eos_token_id=2)
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2,)  # its copy of config.json's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2, 7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2, 5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id must be"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2,)


LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 101,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}
QWEN2 = {**LLAMA, "architectures": ["Qwen2ForCausalLM"]}
MISTRAL = {**LLAMA, "architectures": ["MistralForCausalLM"]}


@pytest.mark.parametrize(
    "hf,message",
    [
        (
            {**LLAMA, "hidden_act": "gelu"},
            "config.json: hidden_act 'gelu' is not supported (kvswitch's MLP is SwiGLU",
        ),
        ({**QWEN2, "hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
        ({**LLAMA, "attention_bias": True}, "config.json: attention_bias true"),
        ({**LLAMA, "mlp_bias": True}, "config.json: mlp_bias true"),
        (
            {**LLAMA, "quantization_config": {"quant_method": "awq", "bits": 4}},
            "config.json: quantization_config (awq) is not supported",
        ),
        (
            {**MISTRAL, "sliding_window": 0},
            "config.json: sliding_window must be a positive integer, got 0",
        ),
    ],
)
def test_fields_that_change_the_math_are_refused_by_name(hf: dict, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        ModelConfig.from_hf(hf)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("hf", "context"),
    [
        ({**QWEN2, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, 64),
        (
            {
                **QWEN2,
                "use_sliding_window": True,
                "sliding_window": 64,
                "max_window_layers": 2,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            64,
        ),
        ({**MISTRAL, "sliding_window": 64}, 64),
        # transformers gives a Mistral config without the key a window of 4096.
        ({**MISTRAL, "max_position_embeddings": 32768}, 4096),
        ({**MISTRAL, "sliding_window": 512}, 256),  # longer than the context: no cut
    ],
)
def test_a_sliding_window_shorter_than_the_context_cuts_the_context_to_it(
    hf: dict, context: int
) -> None:
    assert ModelConfig.from_hf(hf).max_position_embeddings == context


@pytest.mark.parametrize(
    "hf",
    [
        # Qwen2.5's published configs: a window that use_sliding_window leaves off.
        {**QWEN2, "use_sliding_window": False, "sliding_window": 64, "max_window_layers": 1},
        # On, but from a layer the model does not have.
        {**QWEN2, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
        {**QWEN2, "use_sliding_window": True, "sliding_window": None},
        {**MISTRAL, "sliding_window": None},  # Mistral v0.2 and later
        {**MISTRAL, "sliding_window": 256},  # as long as the context
        {**LLAMA, "hidden_act": "swish", "attention_bias": False, "mlp_bias": False},
        {**QWEN2, "mlp_bias": True, "attention_bias": False},  # Qwen2 reads neither
        {**MISTRAL, "attention_bias": True},  # nor Mistral attention_bias
    ],
)
def test_fields_that_leave_the_math_alone_are_accepted(hf: dict) -> None:
    config = ModelConfig.from_hf(hf)
    assert config.attention_bias == (hf["architectures"] == ["Qwen2ForCausalLM"])


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("mistral", {"sliding_window": 48}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 48, "max_window_layers": 1}),
    ],
)
def test_a_sliding_window_model_is_exact_up_to_its_window_and_serves_no_further(
    tmp_path: Path, arch: str, overrides: dict
) -> None:
    hf = save_checkpoint(tmp_path, arch, **overrides)
    # Up to the window's last position (44 + 3 decode steps < 48), on a cached prefix too.
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 101, (44,), generator=gen).tolist()
    fresh = torch.randint(0, 101, (12,), generator=gen).tolist()
    assert_serves_like_transformers(hf, tmp_path, prompt, fresh, 32, num_decode_steps=3)
    # Past it the window changes the math (the same weights without a window give other
    # logits), so the context served ends there.
    no_window = {"use_sliding_window": False} if arch == "qwen2" else {"sliding_window": None}
    full = save_checkpoint(tmp_path / "full", arch, **{**overrides, **no_window})
    long = torch.randint(0, 101, (80,), generator=gen).tolist()
    assert not torch.allclose(hf_logits(full, long)[-1], hf_logits(hf, long)[-1], **TOL)
    assert ModelConfig.from_dir(tmp_path).max_position_embeddings == 48
    engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=16))
    assert engine.max_model_len == 48


def test_fused_projections_compute_the_same_in_the_same_memory() -> None:
    """``fuse`` (as load_model does) runs q/k/v and gate/up as one matmul each: the same logits
    as the separate projections, the parameters now views of the fused weights (no memory
    added, the checkpoint's names kept), and qwen2's q/k/v biases fused too."""
    from kvswitch.worker.model import CausalLM

    for preset, bias in (("tiny", False), ("tiny", True)):
        torch.manual_seed(0)
        config = ModelConfig.random_preset(preset)
        if bias:
            config = dataclasses.replace(config, attention_bias=True)
        model = CausalLM(config)
        for parameter in model.parameters():
            torch.nn.init.normal_(parameter, std=0.05)
        runner = ModelRunner(model, num_blocks=16, block_size=BLOCK_SIZE)
        seqs = [ScheduledSeq(list(range(3, 14)), 0, [4, 9, 2])]
        plain = runner.execute(seqs, every_token=True)
        names = list(model.state_dict())
        model.fuse()
        assert list(model.state_dict()) == names
        attention = model.model.layers[0].self_attn
        fused = attention.qkv_proj
        assert fused is not None and model.model.layers[0].mlp.gate_up_proj is not None
        storage = fused.weight.untyped_storage().data_ptr()
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
            assert projection.weight.untyped_storage().data_ptr() == storage
            if bias:
                assert projection.bias.untyped_storage().data_ptr() == (
                    fused.bias.untyped_storage().data_ptr()
                )
        torch.testing.assert_close(runner.execute(seqs, every_token=True), plain)
