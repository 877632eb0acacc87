"""What a ``--model`` argument names: a Hugging Face checkpoint directory, or a model with
random weights (``random:NAME``, a preset shape; none at all means the built-in tiny one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RANDOM_PREFIX = "random:"


def is_random(model_dir: str | Path | None) -> bool:
    """Whether ``model_dir`` names a model with random weights (None or ``random:NAME``)."""
    return model_dir is None or str(model_dir).startswith(RANDOM_PREFIX)


def check_model_dir(model: str | Path | None) -> None:
    """ValueError unless ``model`` names a checkpoint directory that exists (or random weights,
    or none: the built-in model). A missing directory is a typo, not a model."""
    if model and not is_random(model) and not Path(model).is_dir():
        raise ValueError(f"--model {model}: no such checkpoint directory")


def token_ids(value: Any, field: str = "config.json: eos_token_id") -> tuple[int, ...]:
    """An ``eos_token_id`` entry (null, an id or a list of ids) as a tuple; ValueError naming
    ``field`` for anything else."""
    values = value if isinstance(value, list) else ([] if value is None else [value])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{field} must be a token id or a list of them, got {value!r}")
    return tuple(values)


def generation_eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The EOS ids a checkpoint's ``generation_config.json`` lists (Llama 3's instruct models
    list their end-of-turn tokens only there); none without that file."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    generation = json.loads(path.read_text())
    return token_ids(generation.get("eos_token_id"), "generation_config.json: eos_token_id")


def embedding_pooling(model_dir: str | Path | None) -> str | None:
    """How a sentence-transformers checkpoint pools its hidden states into an embedding
    (``modules.json``'s Pooling module: ``"mean"`` or ``"last"``); None where it does not say
    or says another way (CLS, max), which kvswitch does not pool by."""
    if is_random(model_dir):
        return None
    assert model_dir is not None
    modules = Path(model_dir) / "modules.json"
    if not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        if str(module.get("type", "")).endswith("Pooling"):
            config = Path(model_dir) / module.get("path", "") / "config.json"
            if not config.is_file():
                return None
            modes = json.loads(config.read_text())
            if modes.get("pooling_mode_mean_tokens"):
                return "mean"
            if modes.get("pooling_mode_lasttoken"):
                return "last"
    return None
