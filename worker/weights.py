"""Build a model: from a Hugging Face checkpoint directory, or the built-in random default."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from kvswitch.worker.model import CausalLM
from kvswitch.worker.model_config import ModelConfig

DEFAULT_SEED = 0
RANDOM_PREFIX = "random:"


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
    return model.to(device=device, dtype=dtype).eval()


def is_random(model_dir: str | Path | None) -> bool:
    """Whether ``model_dir`` names a model with random weights (None or ``random:NAME``)."""
    return model_dir is None or str(model_dir).startswith(RANDOM_PREFIX)


def model_config(model_dir: str | Path | None) -> ModelConfig:
    """The shapes of the model ``load_model`` would build, without building it."""
    if is_random(model_dir):
        return ModelConfig.random_preset(
            str(model_dir)[len(RANDOM_PREFIX) :] if model_dir else "tiny"
        )
    return ModelConfig.from_dir(model_dir)


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
