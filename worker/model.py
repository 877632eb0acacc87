"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

Parameter names follow Hugging Face's Llama layout (``model.layers.0.self_attn.q_proj.weight``,
...), so a checkpoint's state dict loads as it is. Tokens of all sequences in a step are packed
into one row dimension; attention finds each sequence's context through ``AttentionMetadata``.

On CUDA, RMSNorm (with the residual add before it) and the rotary embedding run as Triton kernels,
attention as the paged kernels; elsewhere all of them run as their torch references
(``kernels.reference``), which compute the same thing up to rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

import torch
from torch import nn

from kvswitch.kernels.reference import rms_norm_ref, rotary_ref
from kvswitch.worker.attention import AttentionMetadata, PagedAttention, use_triton
from kvswitch.worker.lora import GATE_UP, QKV
from kvswitch.worker.model_config import ModelConfig
from kvswitch.worker.rope import RopeConfig

if TYPE_CHECKING:
    from kvswitch.worker.lora import LoraSlots


class RMSNorm(nn.Module):
    """Normalizes each row by its root mean square, scaled by ``weight``; given the residual
    stream, adds it first and hands the sum on (a decoder layer's "add, then norm")."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [num_tokens, hidden_size] -> its norm; with ``residual``, ``h = residual + x`` ->
        ``(norm(h), h)``."""
        if use_triton(x.device):
            from kvswitch.kernels import rms_norm  # Triton: imported where it runs

            return rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_ref(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """Rotates query/key halves by position-dependent angles (the non-interleaved layout), from
    a table of ``max_positions`` rows that ``rope`` computes (its variant, its scale)."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        cos, sin = rope.cos_sin(head_dim, max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_tokens, num_q_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim],
        rotated. On CUDA these are q and k themselves, rotated in place; elsewhere new tensors."""
        if use_triton(q.device):
            from kvswitch.kernels import rotary

            # NOTE: in place: q and k are this step's fresh projections, which nothing else reads.
            rotary(q, k, self.cos, self.sin, positions)
            return q, k
        return rotary_ref(q, k, self.cos, self.sin, positions)


class FusedLinears(nn.Module):
    """Several linear layers over the same input as one matmul, its output split among them.

    The layers keep their parameters (and their checkpoint names), which become views of one
    weight (and bias) holding them side by side: no memory is added. Made once the model is
    where it runs (``CausalLM.fuse``); the parts' parameters must not be replaced afterwards.
    """

    def __init__(self, parts: list[nn.Linear]) -> None:
        super().__init__()
        self.sizes = [part.out_features for part in parts]
        weight = torch.cat([part.weight.detach() for part in parts])
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer(
            "bias",
            torch.cat([p.bias.detach() for p in parts]) if parts[0].bias is not None else None,
            persistent=False,
        )
        for part, rows in zip(parts, weight.split(self.sizes), strict=True):
            part.weight.data = rows
        if self.bias is not None:
            for part, values in zip(parts, self.bias.split(self.sizes), strict=True):
                part.bias.data = values

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return nn.functional.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_q_heads = config.num_q_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, config.num_q_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, config.num_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, config.num_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_q_heads * config.head_dim, hidden, bias=False)
        self.attn = PagedAttention(scale=config.head_dim**-0.5)
        self.qkv_proj: FusedLinears | None = None  # q, k and v in one matmul, once fused
        # The adapters' slots, once attached (CausalLM.attach_loras), and this layer's index.
        self.loras: LoraSlots | None = None
        self.layer_index = 0

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project(x, positions, rotary)
        return self.output(self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta))

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rotated queries and keys, and the values, of the rows of ``x``."""
        num_tokens = x.shape[0]
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            # NOTE: column slices of one output: rows keep its stride, which every kernel takes.
            q, k, v = self.qkv_proj(x)
        loras = self.loras
        if loras is not None:
            # NOTE: in place, into the slices: before the rotary, as the adapter was trained.
            q, k, v = loras.apply_shared(self.layer_index, QKV, (q, k, v), x)
        q = q.view(num_tokens, self.num_q_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        return q, k, v

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        x = attended.reshape(attended.shape[0], -1)
        if self.loras is None:
            return self.o_proj(x)
        return self.loras.apply(self.layer_index, "o_proj", self.o_proj(x), x)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_proj: FusedLinears | None = None  # gate and up in one matmul, once fused
        self.loras: LoraSlots | None = None  # as Attention's
        self.layer_index = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x)
        loras = self.loras
        if loras is None:
            return self.down_proj(nn.functional.silu(gate) * up)
        layer = self.layer_index
        gate, up = loras.apply_shared(layer, GATE_UP, (gate, up), x)
        hidden = nn.functional.silu(gate) * up
        return loras.apply(layer, "down_proj", self.down_proj(hidden), hidden)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` is the layer's input (``residual`` None: ``x`` alone, the first
        layer). Returns the MLP's output and the residual stream it is still to be added to::

            residual = residual + x;             out = attn(norm1(residual))
            residual = residual + out;           out = mlp(norm2(residual))
            return out, residual                 (the next norm adds them)
        """
        q, k, v, residual = self.attention_inputs(x, residual, positions, rotary)
        attended = self.self_attn.attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.attention_output(attended, residual)

    def attention_inputs(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to attention: ``(q, k, v, residual)``. Attention alone reads the KV
        cache and the step's metadata, so the parts before and after it can be replayed from
        CUDA graphs of fixed shapes (``worker.cuda_graphs.PrefillGraphs``)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        return *self.self_attn.project(x, positions, rotary), residual

    def attention_output(
        self, attended: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after attention: ``(mlp output, residual)`` from attention's output."""
        x = self.self_attn.output(attended)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, meta)
        return self.final_norm(x, residual)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:  # no layers
            return self.norm(x)
        # NOTE: the last layer's MLP output joins the stream here, in the final norm's add.
        return self.norm(x, residual)[0]


class CausalLM(nn.Module):
    """The decoder plus its output head: hidden states of chosen rows -> next-token logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (fp32) of the rows ``logit_rows`` of the packed batch, e.g. each sequence's
        last new token."""
        return self.logits(self.model(input_ids, positions, kv_caches, meta), logit_rows)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden[rows]).float()

    def attach_loras(self, slots: LoraSlots) -> None:
        """Add to every projection its tokens' adapters from ``slots`` (``slots.slot_of_token``
        says which, per step; none while it is None)."""
        for index, layer in enumerate(self.model.layers):
            for part in (layer.self_attn, layer.mlp):
                part.loras, part.layer_index = slots, index

    def fuse(self) -> CausalLM:
        """Run each layer's q, k and v projections as one matmul, and its MLP's gate and up as
        another: fewer, larger matmuls (for a step of a few hundred tokens, which reads every
        weight once, the larger ones come nearer the memory's bandwidth) and fewer launches.
        Call it once the model has its device and dtype."""
        for layer in self.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            if attention.qkv_proj is None:
                attention.qkv_proj = FusedLinears(
                    [attention.q_proj, attention.k_proj, attention.v_proj]
                )
                mlp.gate_up_proj = FusedLinears([mlp.gate_proj, mlp.up_proj])
        return self
