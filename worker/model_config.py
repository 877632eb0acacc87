"""The shape of a Llama-family decoder, read from a Hugging Face ``config.json`` or built in."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Architectures whose weights use Llama's parameter names; Qwen2 adds biases to q/k/v.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "kvswitch-tiny"

    def __post_init__(self) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, field) <= 0:
                raise ValueError(
                    f"model config: {field} must be positive, got {getattr(self, field)}"
                )
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: {self.num_q_heads} query heads cannot share "
                f"{self.num_kv_heads} KV heads evenly"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token per element byte (multiply by the dtype's size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def tiny(cls) -> ModelConfig:
        """The built-in default: small enough that a 4K-token CPU prefill takes well under a
        second, with a byte-level vocabulary (256 bytes and a BOS token)."""
        return cls(
            vocab_size=257,
            hidden_size=256,
            intermediate_size=512,
            num_layers=2,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=64,
            max_position_embeddings=16384,
            bos_token_id=256,
        )

    @classmethod
    def random_preset(cls, name: str) -> ModelConfig:
        """Shapes for benchmarks with random weights (``--model random:NAME``); no tokenizer."""
        presets = {
            "tiny": cls.tiny(),
            # The tiny shape with a context long enough for 128K-token prompts (host-work
            # benchmarks: its forward costs little next to the serving around it).
            "tiny-long": dataclasses.replace(
                cls.tiny(), max_position_embeddings=262144, name="random-tiny-long"
            ),
            # The shape of a 1B-class Llama (16 layers, hidden 2048, 32/8 heads of 64).
            "llama-1b": cls(
                vocab_size=128256,
                hidden_size=2048,
                intermediate_size=8192,
                num_layers=16,
                num_q_heads=32,
                num_kv_heads=8,
                head_dim=64,
                max_position_embeddings=131072,
                rope_theta=500000.0,
                tie_word_embeddings=True,
                name="random-llama-1b",
            ),
        }
        if name not in presets:
            raise ValueError(f"unknown random model {name!r}; choose from {', '.join(presets)}")
        return presets[name]

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "") -> ModelConfig:
        """Read a Hugging Face ``config.json`` of a supported architecture."""
        architectures = hf.get("architectures") or ["LlamaForCausalLM"]
        if architectures[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architectures[0]!r}; kvswitch runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope_scaling = hf.get("rope_scaling") or {}
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # newer configs nest it under rope_parameters
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        num_q_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_q_heads=num_q_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_q_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_q_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            attention_bias=bool(hf.get("attention_bias", architectures[0] == "Qwen2ForCausalLM")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name or hf.get("_name_or_path") or architectures[0],
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no config.json: not a Hugging Face model directory")
        return cls.from_hf(json.loads(path.read_text()), name=Path(model_dir).name)
