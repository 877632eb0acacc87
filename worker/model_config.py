"""The shape of a Llama-family decoder, read from a Hugging Face ``config.json`` or built in."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvswitch.checkpoint import generation_eos_token_ids, token_ids
from kvswitch.worker.rope import RopeConfig

# Architectures whose weights use Llama's parameter names; Qwen2 adds biases to q/k/v.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# The names transformers gives SiLU; the MLP is SwiGLU and computes nothing else.
SILU_NAMES = ("silu", "swish")
QWEN2_DEFAULT_SLIDING_WINDOW = 4096  # what transformers assumes when a config names none
QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28
MISTRAL_DEFAULT_SLIDING_WINDOW = 4096


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int  # the longest context served (``RopeConfig.context_len``)
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
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
                rope=RopeConfig(rope_theta=500000.0),
                tie_word_embeddings=True,
                name="random-llama-1b",
            ),
        }
        if name not in presets:
            raise ValueError(f"unknown random model {name!r}; choose from {', '.join(presets)}")
        return presets[name]

    @classmethod
    def from_hf(
        cls, hf: dict[str, Any], name: str = "", source: str = "config.json"
    ) -> ModelConfig:
        """Read a Hugging Face ``config.json`` of a supported architecture. Raises ValueError
        naming the field for anything that would change the model's math and that kvswitch does
        not implement (a RoPE variant, another activation, extra biases, quantized weights):
        such a checkpoint is refused, never served differently. A sliding attention window
        shorter than the context cuts the context to it (``attention_window``). A required
        field that is missing is a ValueError naming it and ``source`` (the file read)."""
        architecture = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; kvswitch runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        configured_positions = hf.get("max_position_embeddings", 4096)
        rope = RopeConfig.from_hf(hf, configured_positions)
        max_position_embeddings = rope.context_len(configured_positions)
        check_supported_fields(hf, architecture)
        window = attention_window(hf, architecture)
        if window is not None:
            # NOTE: within its window a sliding-window layer sees every token before, as a
            # full-attention one does: served exactly, with the context cut to the window.
            max_position_embeddings = min(max_position_embeddings, window)

        def required(field: str) -> Any:
            if field not in hf:
                raise ValueError(f"{source} has no {field!r}, which {architecture} needs")
            return hf[field]

        num_q_heads = required("num_attention_heads")
        hidden_size = required("hidden_size")
        return cls(
            vocab_size=required("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=required("intermediate_size"),
            num_layers=required("num_hidden_layers"),
            num_q_heads=num_q_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_q_heads,
            head_dim=hf.get("head_dim") or hidden_size // num_q_heads,
            max_position_embeddings=max_position_embeddings,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope=rope,
            # NOTE: transformers gives Qwen2 q/k/v biases and Mistral none, whatever the config
            # says; Llama's attention_bias (which also biases o_proj) is refused above.
            attention_bias=architecture == "Qwen2ForCausalLM",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=token_ids(hf.get("eos_token_id")),
            name=name or hf.get("_name_or_path") or architecture,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """``config.json`` of a checkpoint directory, with the EOS ids of its
        ``generation_config.json`` (when it has one) added to ``eos_token_ids``: Llama 3's
        instruct models list their end-of-turn tokens only there."""
        root = Path(model_dir)
        path = root / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no config.json: not a Hugging Face model directory")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(hf, dict):
            raise ValueError(f"{path} holds a JSON {type(hf).__name__}, not an object")
        config = cls.from_hf(hf, name=root.name, source=str(path))
        extra = generation_eos_token_ids(root)
        eos_ids = tuple(dict.fromkeys((*config.eos_token_ids, *extra)))
        return dataclasses.replace(config, eos_token_ids=eos_ids)


def check_supported_fields(hf: dict[str, Any], architecture: str) -> None:
    """ValueError naming the first field of ``config.json`` that changes the math of
    ``architecture`` (as transformers reads it) in a way kvswitch does not implement. RoPE fields
    are ``RopeConfig.from_hf``'s to check."""
    activation = hf.get("hidden_act", "silu")
    if activation not in SILU_NAMES:
        raise ValueError(
            f"config.json: hidden_act {activation!r} is not supported (kvswitch's MLP is SwiGLU, "
            "hidden_act silu)"
        )
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ValueError(
            f"config.json: quantization_config ({method or 'no quant_method'}) is not "
            "supported: kvswitch loads unquantized fp32/fp16/bf16 weights"
        )
    if architecture == "LlamaForCausalLM":
        for field, what in (
            ("attention_bias", "biases on the q/k/v/o projections"),
            ("mlp_bias", "biases on the MLP projections"),
        ):
            if hf.get(field):
                raise ValueError(
                    f"config.json: {field} true ({what}) is not supported for {architecture}"
                )


def attention_window(hf: dict[str, Any], architecture: str) -> int | None:
    """How many tokens back a sliding-window layer of ``architecture`` attends, as transformers
    reads ``config.json``; None when no layer slides. ValueError for a window that is no
    positive integer."""
    window = None
    if architecture == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        # NOTE: Qwen2 slides only with use_sliding_window, and only in the layers layer_types
        # names (by default those from max_window_layers on); published configs carry a
        # sliding_window that is off.
        window = hf.get("sliding_window", QWEN2_DEFAULT_SLIDING_WINDOW)
        max_window_layers = hf.get("max_window_layers", QWEN2_DEFAULT_MAX_WINDOW_LAYERS)
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if i >= max_window_layers else "full_attention"
            for i in range(hf["num_hidden_layers"])
        ]
        if "sliding_attention" not in layer_types:
            return None
    elif architecture == "MistralForCausalLM":
        window = hf.get("sliding_window", MISTRAL_DEFAULT_SLIDING_WINDOW)
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 1
    ):
        raise ValueError(f"config.json: sliding_window must be a positive integer, got {window!r}")
    return window
