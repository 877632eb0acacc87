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
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kvswitch.kernels.reference import DENSE_TOKENS, add_lora_ref, lora_token_weight
from kvswitch.worker.attention import use_triton
from kvswitch.worker.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_WEIGHT_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
# Settings a plain LoRA leaves at these values; another value is something else to serve.
_MUST_BE = {
    "bias": ("none", None),
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
    b_t: torch.Tensor,
    scaling: torch.Tensor,
) -> torch.Tensor:
    """``y`` plus each token's adapter on one module, in place: for a token of slot ``s``,
    ``scaling[s] * B_s @ (A_s @ x)``; a token of slot -1 (the base model) is left as it is.
    ``x`` [tokens, in], ``y`` [tokens, out]; ``a`` [slots, rank, in] (A) and ``b_t`` [slots,
    rank, out] (B transposed), adapters of a lower rank zero-padded; ``scaling`` [slots]. On
    CUDA the Triton kernels (``kernels.lora``), elsewhere their torch reference."""
    if use_triton(y.device):
        from kvswitch.kernels.lora import add_lora as add_lora_kernel

        return add_lora_kernel(y, x, slot_of_token, a, b_t, scaling)
    return add_lora_ref(y, x, slot_of_token, a, b_t, scaling)


# Modules that read the same rows: a step shrinks the rows for a group's adapters at once.
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
SHARED_INPUTS = (QKV, ("o_proj",), GATE_UP, ("down_proj",))


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each module an adapter may target, for ``config``'s layers."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_q_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def check_fits(adapter: LoraAdapter, config: ModelConfig) -> None:
    """``LoraFormatError`` unless every weight of ``adapter`` fits a layer of ``config``'s."""
    shapes = module_shapes(config)
    for (layer, module), (a, b) in adapter.weights.items():
        fan_in, fan_out = shapes[module]
        if layer >= config.num_layers or a.shape[1] != fan_in or b.shape[0] != fan_out:
            raise LoraFormatError(
                f"adapter {adapter.name}: layer {layer} {module} (A {tuple(a.shape)}, B "
                f"{tuple(b.shape)}) does not fit this model ({config.num_layers} layers, "
                f"{module} {fan_in} -> {fan_out})"
            )


class LoraSlots:
    """The adapters on the model's device: ``max_loras`` slots, each holding one adapter's A and
    B for every layer and module (zero-padded to ``max_rank``; zero where it targets nothing),
    stacked by slot, and the step's slot of each token, which the model's projections read::

        a[layer, module]   [max_loras, max_rank, in]
        b_t[layer, module] [max_loras, max_rank, out]  (B transposed)
        slot_of_token      [tokens]: a slot, or -1 for the base model; None: no adapter this step
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_loras: int,
        max_rank: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if max_loras <= 0 or max_rank <= 0:
            raise ValueError(
                f"max_loras and max_rank must be positive, got {max_loras}, {max_rank}"
            )
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(config.num_layers):
            for module, (fan_in, fan_out) in module_shapes(config).items():
                self.weights[(layer, module)] = (
                    torch.zeros((max_loras, max_rank, fan_in), dtype=dtype, device=device),
                    torch.zeros((max_loras, max_rank, fan_out), dtype=dtype, device=device),
                )
        self.ranks = [0] * max_loras  # of the adapter in each slot
        # Off CUDA, a step of few tokens multiplies by every slot at once (add_lora_dense), by
        # copies of the slots cut to the highest rank loaded (the slots' padding up to max_rank
        # would be multiplied too) and laid end to end: ``_shrink[(layer, modules)]`` the A's of
        # modules that read the same rows (q, k, v; gate, up), so that one matmul shrinks the
        # rows for all of them; ``_expand[(layer, module)]`` a module's B. Made again after a
        # slot changes.
        self._dense = not use_triton(torch.device(device))
        self._dense_rank = 0  # 0: the copies are to be made
        self._shrink: dict[tuple[int, tuple[str, ...]], torch.Tensor] = {}
        self._expand: dict[tuple[int, str], torch.Tensor] = {}
        self.scaling = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.names: list[str | None] = [None] * max_loras
        self.slot_of_token: torch.Tensor | None = None
        self._token_weight: torch.Tensor | None = None  # the step's, for add_lora_dense

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` in ``slot``, replacing what it held; ValueError if it does not fit
        the model."""
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"adapter {adapter.name}: rank {adapter.rank} is above --max-lora-rank "
                f"{self.max_rank}"
            )
        check_fits(adapter, self.config)
        self.clear(slot)
        rank = adapter.rank
        for key, (a, b) in adapter.weights.items():
            slot_a, slot_b_t = self.weights[key]
            slot_a[slot, :rank].copy_(a)
            slot_b_t[slot, :rank].copy_(b.T)
        self.scaling[slot] = adapter.scaling
        self.names[slot] = adapter.name
        self.ranks[slot] = rank

    def clear(self, slot: int) -> None:
        for a, b_t in self.weights.values():
            a[slot].zero_()
            b_t[slot].zero_()
        self.scaling[slot] = 0.0
        self.names[slot] = None
        self.ranks[slot] = 0
        self._dense_rank = 0

    def begin_step(self, slot_of_token: torch.Tensor | None) -> None:
        """The step's slot of each token, -1 for the base model; None: no adapter this step."""
        self.slot_of_token = slot_of_token
        self._token_weight = None
        if slot_of_token is not None and self._dense and len(slot_of_token) <= DENSE_TOKENS:
            self._token_weight = lora_token_weight(slot_of_token, self.scaling, self.dtype)
            if not self._dense_rank:
                self._lay_out_dense()

    def _lay_out_dense(self) -> None:
        rank = self._dense_rank = max(max(self.ranks), 1)
        for layer in range(self.config.num_layers):
            for group in SHARED_INPUTS:
                a_group = [self.weights[(layer, m)][0][:, :rank] for m in group]
                if len(group) > 1:
                    self._shrink[(layer, group)] = torch.cat(a_group).flatten(0, 1)
                for module, a in zip(group, a_group, strict=True):
                    b_t = self.weights[(layer, module)][1]
                    self._shrink[(layer, (module,))] = a.flatten(0, 1)
                    self._expand[(layer, module)] = b_t[:, :rank].flatten(0, 1)

    def apply(self, layer: int, module: str, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y``, the module's output for the rows ``x``, with each token's adapter added in
        place (nothing when the step has none)."""
        (y,) = self.apply_shared(layer, (module,), (y,), x)
        return y

    def apply_shared(
        self,
        layer: int,
        modules: tuple[str, ...],
        ys: tuple[torch.Tensor, ...],
        x: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """``apply`` for modules that read the same rows ``x`` (a group of ``SHARED_INPUTS``,
        whole and in its order, or any module alone), their outputs ``ys``."""
        if self.slot_of_token is None:
            return ys
        weight = self._token_weight
        if weight is None:
            return tuple(
                add_lora(y, x, self.slot_of_token, *self.weights[(layer, m)], self.scaling)
                for m, y in zip(modules, ys, strict=True)
            )
        shrunk = x @ self._shrink[(layer, modules)].T  # [tokens, modules * slots * rank]
        shrunk = shrunk.view(x.shape[0], len(modules), self.max_loras, -1) * weight[:, None]
        for i, (module, y) in enumerate(zip(modules, ys, strict=True)):
            y += (shrunk[:, i].flatten(1) @ self._expand[(layer, module)]).to(y.dtype)
        return ys


class LoraManager:
    """The adapters an engine serves, by name: their folders, the ones read into host memory
    (at most ``max_cpu_loras``, least recently used dropped first) and the ones in a device slot
    of ``slots`` (the least recently used slot that the step does not need is reused)."""

    def __init__(self, slots: LoraSlots, paths: dict[str, str], *, max_cpu_loras: int = 0) -> None:
        self.slots = slots
        # 0: every adapter served stays in host memory (those loaded at run time too).
        self._max_cpu_loras = max_cpu_loras
        if 0 < max_cpu_loras < slots.max_loras:
            raise ValueError(
                f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras "
                f"({slots.max_loras}): an adapter in a slot is also kept in host memory"
            )
        self.paths: dict[str, str] = {}
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.num_disk_loads = 0
        self.num_slot_loads = 0
        for name, path in paths.items():
            self.register(name, path)

    @property
    def max_cpu_loras(self) -> int:
        """How many adapters host memory keeps."""
        return self._max_cpu_loras or max(self.slots.max_loras, len(self.paths))

    def register(self, name: str, path: str) -> LoraAdapter:
        """Serve the adapter in the folder ``path`` as ``name`` (read and checked now);
        ValueError if the name is taken or the adapter does not fit."""
        if name in self.paths:
            raise ValueError(f"adapter {name!r} is already loaded (from {self.paths[name]})")
        adapter = load_lora_adapter(name, path, max_rank=self.slots.max_rank)
        check_fits(adapter, self.slots.config)
        self.paths[name] = str(path)
        self._keep(adapter)
        return adapter

    def unregister(self, name: str) -> None:
        """Stop serving ``name``: its slot and host copy are freed. KeyError if unknown."""
        del self.paths[name]
        self._host.pop(name, None)
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self.slots.clear(slot)

    def knows(self, name: str) -> bool:
        return name in self.paths

    @property
    def names(self) -> list[str]:
        return sorted(self.paths)

    @property
    def in_slots(self) -> list[str]:
        return sorted(self._slot_of)

    @property
    def in_host_memory(self) -> list[str]:
        return sorted(self._host)

    @property
    def num_free_slots(self) -> int:
        return self.slots.max_loras - len(self._slot_of)

    def slots_for(self, names: set[str]) -> dict[str, int]:
        """A device slot for each adapter a step uses, loading those not in one (from host
        memory, or from their folder) into free slots or the least recently used ones it does
        not need."""
        if len(names) > self.slots.max_loras:
            raise ValueError(
                f"a step uses {len(names)} adapters; --max-loras is {self.slots.max_loras}"
            )
        for name in names:
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
        for name in names:
            if name not in self._slot_of:
                self._slot_of[name] = self._load_into_slot(name, names)
        return {name: self._slot_of[name] for name in names}

    def _load_into_slot(self, name: str, needed: set[str]) -> int:
        taken = set(self._slot_of.values())
        free = [s for s in range(self.slots.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next(n for n in self._slot_of if n not in needed)
            slot = self._slot_of.pop(victim)
        adapter = self._host.get(name)
        if adapter is None:
            adapter = load_lora_adapter(name, self.paths[name], max_rank=self.slots.max_rank)
            self.num_disk_loads += 1
        self._keep(adapter)
        self.slots.load(slot, adapter)
        self.num_slot_loads += 1
        return slot

    def _keep(self, adapter: LoraAdapter) -> None:
        """Keep ``adapter`` in host memory as the most recently used, dropping the least
        recently used copy beyond ``max_cpu_loras``."""
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
