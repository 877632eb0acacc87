"""Build a model: from a Hugging Face checkpoint directory, or the built-in random default."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvswitch.checkpoint import RANDOM_PREFIX, is_random
from kvswitch.worker.model import CausalLM
from kvswitch.worker.model_config import ModelConfig

DEFAULT_SEED = 0


def load_model(
    model_dir: str | Path | None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> CausalLM:
    """The checkpoint in ``model_dir`` (``config.json`` + ``*.safetensors``); with None the
    built-in tiny model, and with ``random:NAME`` a preset shape (``ModelConfig.random_preset``),
    both with deterministic random weights."""
    model = CausalLM(model_config(model_dir))
    if is_random(model_dir):
        init_random_weights(model, seed=DEFAULT_SEED)
    else:
        load_safetensors(model, Path(model_dir))
    return model.to(device=device, dtype=dtype).eval().fuse()


def model_config(model_dir: str | Path | None) -> ModelConfig:
    """The shapes of the model ``load_model`` would build, without building it."""
    if is_random(model_dir):
        return ModelConfig.random_preset(
            str(model_dir)[len(RANDOM_PREFIX) :] if model_dir else "tiny"
        )
    return ModelConfig.from_dir(model_dir)


# Files that make a checkpoint what it is, besides its weights; hashed whole when present.
IDENTITY_FILES = (
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
)
NUM_WEIGHT_SAMPLES = 16  # evenly spaced reads per weight file ...
WEIGHT_SAMPLE_BYTES = 4096  # ... of this many bytes each


def model_namespace(model_dir: str | Path | None, served_model_name: str = "") -> str:
    """The block-hash namespace of a model: hashes agree only within one namespace.

    ``served_model_name`` when the operator gives one. Otherwise a random model's preset name,
    or for a checkpoint its ``model_type`` and a digest of its content: the identity files whole,
    each weight file's name, size and evenly spaced samples of its bytes. The same checkpoint
    gets the same namespace at any path on any host; a fine-tune of it (other weights, same
    config) gets another. See docs/HASHING.md.
    """
    if served_model_name:
        return served_model_name
    if is_random(model_dir):
        return model_config(model_dir).name
    root = Path(model_dir)
    digest = hashlib.sha256()
    for name in IDENTITY_FILES:
        path = root / name
        if path.is_file():
            content = path.read_bytes()
            digest.update(f"{name}\0{len(content)}\0".encode())
            digest.update(content)
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            for i in range(NUM_WEIGHT_SAMPLES):
                f.seek(size * i // NUM_WEIGHT_SAMPLES)
                digest.update(f.read(WEIGHT_SAMPLE_BYTES))
    model_type = json.loads((root / "config.json").read_text()).get("model_type") or "model"
    return f"{model_type}-{digest.hexdigest()[:16]}"


def init_random_weights(model: CausalLM, seed: int) -> None:
    """Same seed, same weights, on any machine: drawn on CPU from a private generator."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)


def load_safetensors(model: CausalLM, model_dir: Path) -> None:
    """Copy every tensor of the checkpoint into the parameter of the same name."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no *.safetensors weights")
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # recomputed from the config
                    if name not in params:
                        raise ValueError(f"{path.name}: unexpected tensor {name!r}")
                    tensor = f.get_tensor(name)
                    if tensor.shape != params[name].shape:
                        raise ValueError(
                            f"{path.name}: {name} has shape {tuple(tensor.shape)}, the config "
                            f"implies {tuple(params[name].shape)}"
                        )
                    params[name].copy_(tensor)
                    loaded.add(name)
    if model.config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(
            f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )
