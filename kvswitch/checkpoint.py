"""What a ``--model`` argument names: a Hugging Face checkpoint directory, or a model with
random weights (``random:NAME``, a preset shape; none at all means the built-in tiny one)."""

from __future__ import annotations

from pathlib import Path

RANDOM_PREFIX = "random:"


def is_random(model_dir: str | Path | None) -> bool:
    """Whether ``model_dir`` names a model with random weights (None or ``random:NAME``)."""
    return model_dir is None or str(model_dir).startswith(RANDOM_PREFIX)
