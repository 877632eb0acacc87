"""LoRA adapters in PEFT's format, read and checked: ``adapter_config.json`` beside
``adapter_model.safetensors``.

An adapter adds ``scaling * B @ (A @ x)`` to the output of each module it targets, per layer:
``A`` is ``[rank, in]``, ``B`` is ``[out, rank]``, ``scaling`` is ``lora_alpha / rank`` (or
``lora_alpha / sqrt(rank)`` with rsLoRA). kvswitch takes what that formula covers and refuses the
rest by name, rather than serve an adapter other than the one trained:

    peft_type LORA; target_modules among q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
    (a list, or a name for one); bias "none"; no DoRA, no fan_in_fan_out, no modules_to_save,
    no rank_pattern / alpha_pattern, no layers_to_transform; rank at most ``max_rank``

Weights are named as PEFT saves them: ``base_model.model.model.layers.{i}.{self_attn|mlp}.
{module}.lora_{A|B}.weight``; every targeted module of every layer that has one must have both,
with shapes that agree with the rank.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_WEIGHT_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
# Settings a plain LoRA leaves at these values; another value is something else to serve.
_MUST_BE = {
    "bias": ("none",),
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "layers_to_transform": (None, []),
}


class LoraFormatError(ValueError):
    """The adapter is not one kvswitch can serve, and the message says what and where."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter, its weights on the CPU as saved."""

    name: str
    rank: int
    scaling: float
    target_modules: frozenset[str]
    # (layer, module) -> (A [rank, in], B [out, rank])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.weights})


def load_lora_adapter(name: str, path: str | Path, *, max_rank: int = 64) -> LoraAdapter:
    """The adapter in the folder ``path``, served as ``name``; ``LoraFormatError`` saying why
    not."""
    folder = Path(path)
    config = _read_config(folder)
    rank, scaling, targets = _check_config(config, folder, max_rank)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoraFormatError(f"adapter {name}: no {WEIGHTS_FILE} in {folder}")
    tensors = load_file(str(weights_path))
    weights = _pair_weights(tensors, name, rank, targets)
    return LoraAdapter(name, rank, scaling, targets, weights)


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoraFormatError(f"{folder} holds no {CONFIG_FILE}: not a PEFT adapter") from None
    except (OSError, ValueError) as e:
        raise LoraFormatError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoraFormatError(f"{path} is not a JSON object")
    return config


def _check_config(
    config: dict[str, Any], folder: Path, max_rank: int
) -> tuple[int, float, frozenset[str]]:
    where = folder / CONFIG_FILE
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraFormatError(f"{where}: peft_type {peft_type!r}; only LORA is served")
    for key, allowed in _MUST_BE.items():
        if config.get(key) not in allowed:
            raise LoraFormatError(
                f"{where}: {key} = {config.get(key)!r} is not served (kvswitch serves "
                f"{key} = {allowed[0]!r})"
            )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise LoraFormatError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraFormatError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise LoraFormatError(f"{where}: lora_alpha must be a positive number, got {alpha!r}")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets
    if not isinstance(names, list) or not names or not all(isinstance(t, str) for t in names):
        raise LoraFormatError(f"{where}: target_modules must name modules, got {targets!r}")
    unknown = sorted(set(names) - set(MODULES))
    if unknown:
        raise LoraFormatError(
            f"{where}: target_modules {unknown} are not served; kvswitch serves {list(MODULES)}"
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling), frozenset(names)


def _pair_weights(
    tensors: dict[str, torch.Tensor], name: str, rank: int, targets: frozenset[str]
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _WEIGHT_NAME.match(key)
        if match is None:
            raise LoraFormatError(
                f"adapter {name}: weight {key!r} is not a LoRA weight kvswitch reads"
            )
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in targets:
            raise LoraFormatError(
                f"adapter {name}: weight {key!r} is for {module}, which target_modules does "
                "not name"
            )
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise LoraFormatError(f"adapter {name}: {WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            missing = "lora_A" if a is None else "lora_B"
            raise LoraFormatError(f"adapter {name}: layer {layer} {module} has no {missing}")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraFormatError(
                f"adapter {name}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not agree with rank {rank} (A is [rank, in], B [out, rank])"
            )
        weights[(layer, module)] = (a, b)
    return weights


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    slot_of_token: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
) -> torch.Tensor:
    """``y`` plus each token's adapter on one module: for a token of slot ``s``,
    ``scaling[s] * b[s] @ (a[s] @ x)``; a token of slot -1 (the base model) is left as it is.

    ``x`` [tokens, in], ``y`` [tokens, out]; ``a`` [slots, rank, in] and ``b`` [slots, out,
    rank], adapters of a lower rank zero-padded; ``scaling`` [slots]. The torch reference of
    the batched shrink and expand: one low-rank product per slot present in the step, over that
    slot's tokens only (the base model's tokens cost nothing), in place on ``y``."""
    for slot in torch.unique(slot_of_token).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(slot_of_token == slot, as_tuple=True)[0]
        shrunk = x.index_select(0, rows) @ a[slot].T.to(x.dtype)  # [tokens of slot, rank]
        expanded = (shrunk @ b[slot].T.to(x.dtype)) * scaling[slot].to(x.dtype)
        y.index_add_(0, rows, expanded.to(y.dtype))
    return y
