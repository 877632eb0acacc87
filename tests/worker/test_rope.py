"""RoPE variants: served as transformers computes them, from either config.json layout, or
refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvswitch.worker.model_config import ModelConfig
from kvswitch.worker.rope import RopeConfig
from tests.worker.hf_reference import assert_serves_like_transformers, save_checkpoint, transformers
from tests.worker.test_model import LLAMA

MAX_POSITIONS = 256
ORIGINAL_MAX_POSITIONS = 64  # small, so that the prompts below run well past it
# Dynamic NTK scaling begins past max_position_embeddings: the prompts below run up to its edge.
DYNAMIC_MAX_POSITIONS = 128

# name -> (arch, rope_type, the section's parameters, rope_theta, the old layout's type key).
# The old layout is written as the published files have it: Meta's llama3 with rope_type, Qwen2.5's
# yarn and older linear / dynamic fine-tunes with type.
VARIANTS: dict[str, tuple[str, str, dict[str, Any], float, str]] = {
    "default": ("llama", "default", {}, 500000.0, "rope_type"),
    "llama3": (
        "llama",
        "llama3",
        {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL_MAX_POSITIONS,
        },
        500000.0,
        "rope_type",
    ),
    "linear": ("llama", "linear", {"factor": 4.0}, 10000.0, "type"),
    "yarn": (
        "qwen2",
        "yarn",
        {"factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX_POSITIONS},
        1000000.0,
        "type",
    ),
    "yarn-every-key": (
        "mistral",
        "yarn",
        {
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL_MAX_POSITIONS,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "truncate": False,
        },
        10000.0,
        "rope_type",
    ),
    "yarn-attention-factor": (
        "llama",
        "yarn",
        {
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL_MAX_POSITIONS,
            "attention_factor": 1.5,
        },
        10000.0,
        "rope_type",
    ),
    "dynamic": ("llama", "dynamic", {"factor": 2.0}, 10000.0, "type"),
}
LAYOUTS = ("rope_scaling", "rope_parameters")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # NOTE: tensors this small gain nothing from torch's thread pool, and on a busy 2-core
    # machine its spinning threads made each test take seconds instead of milliseconds.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def write_checkpoint(tmp_path: Path, variant: str, layout: str) -> torch.nn.Module:
    """A tiny checkpoint whose config.json names ``variant`` in ``layout``; returns the model
    transformers loads from it."""
    arch, rope_type, params, theta, type_key = VARIANTS[variant]
    max_positions = DYNAMIC_MAX_POSITIONS if rope_type == "dynamic" else MAX_POSITIONS
    save_checkpoint(tmp_path, arch, max_position_embeddings=max_positions)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        config.pop(key, None)
    if layout == "rope_scaling":  # Meta's and Qwen's published files
        config["rope_theta"] = theta
        config["rope_scaling"] = None if rope_type == "default" else {type_key: rope_type, **params}
    else:  # what transformers 5 writes
        config["rope_parameters"] = {"rope_type": rope_type, "rope_theta": theta, **params}
    path.write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    )
    assert hf.model.rotary_emb.rope_type == rope_type  # transformers read what we meant
    return hf.eval()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_transformers_cold_and_on_a_cached_prefix(
    tmp_path: Path, variant: str, layout: str
) -> None:
    if layout == "rope_parameters" and int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers reads rope_parameters from version 5")
    hf = write_checkpoint(tmp_path, variant, layout)
    gen = torch.Generator().manual_seed(2)
    # Positions up to 125: twice the original context of llama3 and yarn, and just within
    # dynamic's max_position_embeddings.
    prompt = torch.randint(0, 101, (90,), generator=gen).tolist()
    fresh = torch.randint(0, 101, (46,), generator=gen).tolist()
    assert_serves_like_transformers(hf, tmp_path, prompt, fresh, num_cached_tokens=80)


@pytest.mark.parametrize("variant", ["llama3", "yarn", "yarn-every-key"])
def test_both_layouts_read_the_same(variant: str) -> None:
    _, rope_type, params, theta, type_key = VARIANTS[variant]
    old = {"rope_theta": theta, "rope_scaling": {type_key: rope_type, **params}}
    new = {"rope_parameters": {"rope_type": rope_type, "rope_theta": theta, **params}}
    assert RopeConfig.from_hf(old, MAX_POSITIONS) == RopeConfig.from_hf(new, MAX_POSITIONS)
    both = {**old, **new}  # as some files carry them, agreeing
    assert RopeConfig.from_hf(both, MAX_POSITIONS) == RopeConfig.from_hf(new, MAX_POSITIONS)


def test_qwen2_5_yarn_serves_four_times_its_context() -> None:
    qwen = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 101,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": 131072,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    config = ModelConfig.from_hf(qwen)
    assert (config.rope.rope_type, config.max_position_embeddings) == ("yarn", 131072)
    assert ModelConfig.from_hf({**qwen, "rope_scaling": None}).max_position_embeddings == 32768


def test_meta_llama_3_1_config_is_llama3() -> None:
    meta = {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }
    assert RopeConfig.from_hf(meta, 131072) == RopeConfig(
        "llama3", 500000.0, 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0
    )


def test_defaults_are_filled_in_as_transformers_fills_them() -> None:
    assert RopeConfig.from_hf({}, 4096) == RopeConfig()
    # rope_theta inside the section wins over a top-level one.
    nested = {"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert RopeConfig.from_hf(nested, 4096).rope_theta == 5e5
    # yarn: original context from max_position_embeddings, a null factor from the two lengths,
    # a top-level original_max_position_embeddings preferred to the section's.
    yarn = RopeConfig.from_hf({"rope_scaling": {"type": "yarn", "factor": 2.0}}, 4096)
    assert (yarn.original_max_position_embeddings, yarn.factor) == (4096, 2.0)
    yarn = RopeConfig.from_hf(
        {
            "rope_scaling": {
                "type": "yarn",
                "factor": None,
                "original_max_position_embeddings": 1024,
            }
        },
        4096,
    )
    assert yarn.factor == 4.0
    assert yarn.attention_scale == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    top = RopeConfig.from_hf(
        {
            "original_max_position_embeddings": 512,
            "rope_scaling": {
                "type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 1024,
            },
        },
        4096,
    )
    assert top.original_max_position_embeddings == 512


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "fields,message",
    [
        (
            {
                "rope_scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1.0],
                    "long_factor": [2.0],
                }
            },
            "config.json: rope_scaling.rope_type 'longrope' is not supported (kvswitch serves "
            "default, llama3, linear, yarn, dynamic)",
        ),
        ({"rope_scaling": {"type": "su"}}, "rope_scaling.type 'su' is not supported"),
        (
            {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
            "rope_parameters.rope_type 'proportional' is not supported",
        ),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "long_factor": [1.0]}}, "long_factor"),
        ({"rope_parameters": {**LLAMA3, "mrope_section": [2, 2]}}, "rope_parameters.mrope_section"),
        (
            {"rope_scaling": {"type": "linear", "factor": 2.0, "rope_type": "yarn"}},
            "rope_scaling.type 'linear' and rope_scaling.rope_type 'yarn' disagree",
        ),
        ({"rope_scaling": {"type": "linear"}}, "rope_scaling.factor is missing"),
        (
            {"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}},
            "rope_scaling.low_freq_factor is missing",
        ),
        ({"rope_scaling": {**LLAMA3, "factor": "8"}}, "rope_scaling.factor must be a number"),
        (
            {"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}},
            "rope_scaling: llama3 needs 0 < low_freq_factor < high_freq_factor",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 0}}, "factor must be positive"),
        ({"rope_theta": 0}, "config.json: rope_theta must be positive"),
        (
            {"rope_scaling": {"type": "yarn", "factor": 4.0, "truncate": "no"}},
            "rope_scaling.truncate must be true or false",
        ),
        ({"partial_rotary_factor": 0.5}, "config.json: partial_rotary_factor 0.5"),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
            "rope_parameters.partial_rotary_factor 0.25",
        ),
        (
            {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": LLAMA3},
            "rope_scaling and rope_parameters describe different RoPE variants",
        ),
    ],
)
def test_unsupported_rope_is_refused_naming_the_field(fields: dict, message: str) -> None:
    hf = {**LLAMA, "max_position_embeddings": 131072, **fields}
    with pytest.raises(ValueError) as raised:
        ModelConfig.from_hf(hf)
    assert message in str(raised.value)


def test_a_whole_partial_rotary_factor_is_accepted() -> None:
    hf = {"partial_rotary_factor": 1.0, "rope_parameters": {"partial_rotary_factor": 1}}
    assert RopeConfig.from_hf(hf, 4096) == RopeConfig()
