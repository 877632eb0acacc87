"""LoRA adapters in PEFT's format: read, scaled and checked (``worker/lora.py``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from kvswitch.worker.lora import LoraFormatError, load_lora_adapter

HIDDEN, RANK = 8, 4


def write_adapter(
    folder: Path,
    config: dict[str, Any] | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """An adapter as PEFT saves one: rank 4 on q_proj and v_proj of two layers."""
    folder.mkdir(parents=True, exist_ok=True)
    settings = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "lora_dropout": 0.05,
        "task_type": "CAUSAL_LM",
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": "meta-llama/Llama-3.2-1B",
        **(config or {}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    if weights is None:
        weights = {}
        for layer in range(2):
            for module in ("q_proj", "v_proj"):
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                weights[f"{prefix}.lora_A.weight"] = torch.randn(RANK, HIDDEN)
                weights[f"{prefix}.lora_B.weight"] = torch.randn(HIDDEN, RANK)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    return folder


def test_an_adapter_is_read_with_its_scaling_and_weights(tmp_path: Path) -> None:
    adapter = load_lora_adapter("sql", write_adapter(tmp_path / "sql"))
    assert (adapter.name, adapter.rank, adapter.scaling) == ("sql", RANK, 8 / RANK)
    assert adapter.target_modules == {"q_proj", "v_proj"}
    assert adapter.layers == [0, 1] and len(adapter.weights) == 4
    a, b = adapter.weights[(1, "v_proj")]
    assert a.shape == (RANK, HIDDEN) and b.shape == (HIDDEN, RANK)
    # rsLoRA scales by the rank's square root.
    rs = load_lora_adapter("rs", write_adapter(tmp_path / "rs", {"use_rslora": True}))
    assert rs.scaling == pytest.approx(8 / math.sqrt(RANK))
    # One module named as a string is a list of one.
    one = {"target_modules": "q_proj"}
    q_only = {
        f"base_model.model.model.layers.0.self_attn.q_proj.lora_{h}.weight": t
        for h, t in (("A", torch.randn(RANK, HIDDEN)), ("B", torch.randn(HIDDEN, RANK)))
    }
    assert load_lora_adapter("q", write_adapter(tmp_path / "q", one, q_only)).layers == [0]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"peft_type": "PREFIX_TUNING"}, "only LORA is served"),
        ({"use_dora": True}, "use_dora = True is not served"),
        ({"bias": "all"}, "bias = 'all' is not served"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
        ({"r": 0}, "r must be a positive integer"),
        ({"r": 128}, "rank 128 is above --max-lora-rank 64"),
        ({"lora_alpha": "big"}, "lora_alpha must be a positive number"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules \\['lm_head'\\]"),
    ],
)
def test_what_is_not_a_plain_lora_is_refused_by_name(
    tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    with pytest.raises(LoraFormatError, match=message):
        load_lora_adapter("x", write_adapter(tmp_path / "x", config))


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path: Path) -> None:
    prefix = "base_model.model.model.layers.0.self_attn"
    cases = {
        "has no lora_B": {f"{prefix}.q_proj.lora_A.weight": torch.randn(RANK, HIDDEN)},
        "do not agree with rank 4": {
            f"{prefix}.q_proj.lora_A.weight": torch.randn(RANK + 1, HIDDEN),
            f"{prefix}.q_proj.lora_B.weight": torch.randn(HIDDEN, RANK + 1),
        },
        "which target_modules does not name": {
            f"{prefix}.k_proj.lora_A.weight": torch.randn(RANK, HIDDEN),
            f"{prefix}.k_proj.lora_B.weight": torch.randn(HIDDEN, RANK),
        },
        "is not a LoRA weight": {"lm_head.weight": torch.randn(4, 4)},
    }
    for i, (message, weights) in enumerate(cases.items()):
        with pytest.raises(LoraFormatError, match=message):
            load_lora_adapter("x", write_adapter(tmp_path / f"x{i}", weights=weights))
    with pytest.raises(LoraFormatError, match="not a PEFT adapter"):
        load_lora_adapter("x", tmp_path)


def test_one_step_mixes_adapters_and_the_base_token_by_token() -> None:
    """Five tokens: two of slot 0, one of the base model, two of slot 2 (rank 2, zero-padded to
    4): each gets its own adapter's product, the base token none, as one at a time would."""
    from kvswitch.worker.lora import add_lora

    torch.manual_seed(0)
    num_in, num_out, slots = 6, 5, 3
    a = torch.randn(slots, RANK, num_in)
    b = torch.randn(slots, num_out, RANK)
    a[2, 2:], b[2, :, 2:] = 0, 0  # a rank-2 adapter in a rank-4 slot
    scaling = torch.tensor([2.0, 0.5, 4.0])
    x = torch.randn(5, num_in)
    base = torch.randn(5, num_out)
    slot_of_token = torch.tensor([0, 0, -1, 2, 2])
    y = add_lora(base.clone(), x, slot_of_token, a, b.transpose(1, 2), scaling)
    for t, slot in enumerate(slot_of_token.tolist()):
        expected = base[t].clone()
        if slot >= 0:
            expected += scaling[slot] * (b[slot] @ (a[slot] @ x[t]))
        torch.testing.assert_close(y[t], expected)
    # Slot 1, in no token's use, leaves the output as the others make it.
    assert torch.equal(y[2], base[2])
