"""Rotary position embeddings: which variant a checkpoint uses, and the cos/sin table it implies.

A Hugging Face ``config.json`` names its variant in one of two layouts: the older
``rope_scaling`` (``type`` or ``rope_type``, with ``rope_theta`` at the top level, as Meta's and
Qwen's published files have it) or the newer ``rope_parameters`` (``rope_type`` with
``rope_theta`` inside). ``RopeConfig.from_hf`` reads both to the same value; the model asks it
only for ``cos_sin``. The variants compute what transformers computes for them:

- ``default``: ``inv_freq[i] = theta ** (-2i / head_dim)``.
- ``linear``: every frequency divided by ``factor`` (positions interpolated).
- ``llama3``: frequencies whose wavelength exceeds ``original_max_position_embeddings /
  low_freq_factor`` divided by ``factor``, those shorter than ``... / high_freq_factor`` kept,
  a smooth blend between.
- ``yarn``: a ramp over the dimensions between keeping a frequency and dividing it by ``factor``
  (bounds from ``beta_fast`` / ``beta_slow``), and cos/sin multiplied by an attention factor.
- ``dynamic``: NTK scaling that changes the frequencies only once a sequence passes
  ``max_position_embeddings``. kvswitch never runs a sequence that far (a request's context is
  capped there), so every position it computes gets the default frequencies, as in transformers.
  Past that length the rotation of every position would depend on the sequence's total length,
  and a cached prefix's keys, rotated for a shorter sequence, would be wrong.

Anything else (``longrope``, ``su``, keys a variant does not read) is refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROPE_TYPES = ("default", "llama3", "linear", "yarn", "dynamic")
DEFAULT_THETA = 10000.0  # transformers' default when a config names no rope_theta

# The keys each variant reads, besides rope_type / type, rope_theta and partial_rotary_factor.
VARIANT_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}
COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """One RoPE variant with every parameter resolved (defaults filled in as transformers fills
    them). Field names are the ``config.json`` keys. ``original_max_position_embeddings`` is
    read by llama3 and yarn only; the yarn fields by yarn only."""

    rope_type: str = "default"
    rope_theta: float = DEFAULT_THETA
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # NOTE: yarn uses mscale and mscale_all_dim only when both are non-zero, and
    # attention_factor, when given, instead of anything it would derive.
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported (kvswitch serves "
                f"{', '.join(ROPE_TYPES)})"
            )
        for name in ("rope_theta", "factor", "beta_fast", "beta_slow"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"attention_factor must be positive, got {self.attention_factor}")
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"original_max_position_embeddings must be positive for rope_type "
                f"{self.rope_type!r}, got {self.original_max_position_embeddings}"
            )
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"llama3 needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )

    # -- reading config.json ---------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], max_position_embeddings: int) -> RopeConfig:
        """The variant a Hugging Face ``config.json`` names, in either layout. Raises ValueError
        naming the field for a variant, key or value kvswitch does not implement."""
        old, new = hf.get("rope_scaling"), hf.get("rope_parameters")
        if old and new:
            # NOTE: transformers lets rope_scaling win; two that disagree are a broken file.
            parsed_old = _parse(hf, "rope_scaling", old, max_position_embeddings)
            parsed_new = _parse(hf, "rope_parameters", new, max_position_embeddings)
            if parsed_old != parsed_new:
                raise ValueError(
                    "config.json: rope_scaling and rope_parameters describe different RoPE "
                    "variants; keep one of them"
                )
            return parsed_old
        if old:
            return _parse(hf, "rope_scaling", old, max_position_embeddings)
        return _parse(hf, "rope_parameters", new or {}, max_position_embeddings)

    def context_len(self, max_position_embeddings: int) -> int:
        """The longest context this variant serves, given ``config.json``'s
        ``max_position_embeddings``. For yarn, ``original_max_position_embeddings * factor`` when
        that is longer: Qwen2.5 keeps 32768 there and enables 4x by adding ``rope_scaling``, and
        the yarn table holds at any position. llama3 and linear configs state the extended length
        themselves; dynamic must stay within it (see the module docstring)."""
        if self.rope_type == "yarn":
            extended = int(self.original_max_position_embeddings * self.factor)
            return max(max_position_embeddings, extended)
        return max_position_embeddings

    # -- the math --------------------------------------------------------------------------------

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """The rotation speed (radians per position) of each of the ``head_dim / 2`` pairs."""
        import torch  # NOTE: here, not at the top: reading a config needs no torch

        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (self.rope_theta**exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv_freq)
        if self.rope_type == "yarn":
            return self._yarn(inv_freq, head_dim)
        return inv_freq  # default, and dynamic within max_position_embeddings

    @property
    def attention_scale(self) -> float:
        """What cos and sin are multiplied by (so attention logits by its square); 1 but for
        yarn."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor, 1.0)

    def cos_sin(self, head_dim: int, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position's angles, ``[num_positions, head_dim / 2]`` in fp32,
        each multiplied by ``attention_scale``."""
        import torch

        angles = torch.outer(torch.arange(num_positions).float(), self.inv_freq(head_dim))
        scale = self.attention_scale
        return angles.cos() * scale, angles.sin() * scale

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        import torch

        context = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        long_wavelen = context / self.low_freq_factor  # slower than this: divided by factor
        short_wavelen = context / self.high_freq_factor  # faster than this: kept
        scaled = torch.where(wavelen > long_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (context / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        between = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
        return torch.where(between, blended, scaled)

    def _yarn(self, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
        import torch

        context = self.original_max_position_embeddings

        def dim_turning(num_turns: float) -> float:
            # The dimension whose frequency turns num_turns times over the original context.
            return (
                head_dim
                * math.log(context / (num_turns * 2 * math.pi))
                / (2 * math.log(self.rope_theta))
            )

        low, high = dim_turning(self.beta_fast), dim_turning(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # as transformers does, to keep the ramp finite
        # 0 below low (fast pairs, kept), 1 above high (slow pairs, divided by factor).
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        return inv_freq / self.factor * ramp + inv_freq * (1 - ramp)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _parse(
    hf: Mapping[str, Any], section: str, params: Any, max_position_embeddings: int
) -> RopeConfig:
    """``params`` is ``hf[section]``; error messages name its keys as ``section.key``."""
    if not isinstance(params, Mapping):
        raise ValueError(f"config.json: {section} must be an object, got {params!r}")
    rope_type, type_field = _read_type(section, params)
    for key in params:
        if key not in COMMON_KEYS and key not in VARIANT_KEYS[rope_type]:
            reads = ", ".join(VARIANT_KEYS[rope_type]) or "no other keys"
            raise ValueError(
                f"config.json: {section}.{key} is not supported with {type_field} {rope_type!r} "
                f"(kvswitch reads {reads}; it refuses what it would otherwise ignore)"
            )
    for key in REQUIRED_KEYS[rope_type]:
        # NOTE: yarn alone may leave factor null (transformers then derives it, below).
        if key not in params or (params[key] is None and rope_type != "yarn"):
            raise ValueError(f"config.json: {section}.{key} is missing; {rope_type} needs it")
    for where, value in (
        (f"{section}.partial_rotary_factor", params.get("partial_rotary_factor")),
        ("partial_rotary_factor", hf.get("partial_rotary_factor")),
    ):
        if value is not None and value != 1:
            raise ValueError(
                f"config.json: {where} {value!r} is not supported: kvswitch rotates whole heads"
            )

    # NOTE: the value inside the section wins over the top level, as in transformers.
    theta = params.get("rope_theta")
    theta_field = f"{section}.rope_theta"
    if theta is None:
        theta, theta_field = hf.get("rope_theta"), "rope_theta"
    theta = DEFAULT_THETA if theta is None else _number(theta_field, theta)
    if theta <= 0:
        raise ValueError(f"config.json: {theta_field} must be positive, got {theta}")

    fields: dict[str, Any] = {"rope_type": rope_type, "rope_theta": theta}
    if rope_type in ("llama3", "yarn"):
        # NOTE: transformers prefers a top-level original_max_position_embeddings to the
        # section's, and falls back to max_position_embeddings.
        original = hf.get("original_max_position_embeddings")
        original_field = "original_max_position_embeddings"
        if original is None:
            original = params.get("original_max_position_embeddings", max_position_embeddings)
            original_field = f"{section}.original_max_position_embeddings"
        if not isinstance(original, int) or isinstance(original, bool):
            raise ValueError(f"config.json: {original_field} must be an integer, got {original!r}")
        fields["original_max_position_embeddings"] = original
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
        if key in VARIANT_KEYS[rope_type] and params.get(key) is not None:
            fields[key] = _number(f"{section}.{key}", params[key])
    if rope_type == "yarn":
        if params["factor"] is None:  # transformers then derives it from the two lengths
            fields["factor"] = max_position_embeddings / fields["original_max_position_embeddings"]
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if params.get(key) is not None:
                fields[key] = _number(f"{section}.{key}", params[key])
        # NOTE: transformers reads a zero beta as absent (`or 32`, `or 1`).
        fields["beta_fast"] = fields.get("beta_fast") or 32.0
        fields["beta_slow"] = fields.get("beta_slow") or 1.0
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"config.json: {section}.truncate must be true or false")
        fields["truncate"] = truncate
    try:
        return RopeConfig(**fields)
    except ValueError as e:
        raise ValueError(f"config.json: {section}: {e}") from None


def _read_type(section: str, params: Mapping[str, Any]) -> tuple[str, str]:
    """The variant ``params`` names (``rope_type``, or ``type`` in older files), and the field
    that names it, for messages."""
    type_keys = [key for key in ("rope_type", "type") if key in params]
    if len(type_keys) == 2 and params["type"] != params["rope_type"]:
        raise ValueError(
            f"config.json: {section}.type {params['type']!r} and {section}.rope_type "
            f"{params['rope_type']!r} disagree"
        )
    rope_type = params[type_keys[0]] if type_keys else "default"
    type_field = f"{section}.{type_keys[0] if type_keys else 'rope_type'}"
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"config.json: {type_field} {rope_type!r} is not supported (kvswitch serves "
            f"{', '.join(ROPE_TYPES)})"
        )
    return rope_type, type_field


def _number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"config.json: {field} must be a number, got {value!r}")
    return float(value)
