"""Pure-torch references of the kernels; also the worker's CPU execution path.

Paged attention's layout, shared with its kernels (see ``kernels/layout.py``)::

    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables      [num_seqs, max_blocks] int32   (page i of sequence s is block_tables[s, i])
    slot              block_id * block_size + offset

Attention runs in fp32 through torch's ``scaled_dot_product_attention`` on the gathered pages;
outputs are cast back to the query dtype. RMSNorm and rotary embeddings are the model's own math,
written once here: the model calls these off CUDA, and the kernels are tested against them.
"""

from __future__ import annotations

from typing import overload

import torch


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key[i]`` / ``value[i]`` ([num_tokens, num_kv_heads, head_dim]) to slot
    ``slot_mapping[i]``; slot -1 is padding and is skipped."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots] = key[valid].to(
        k_cache.dtype
    )
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots] = value[valid].to(
        v_cache.dtype
    )


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` rows of one sequence: [num_tokens, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_pages = -(-num_tokens // block_size)
    pages = cache[block_table[:num_pages].long()]  # [num_pages, block_size, heads, dim]
    return pages.reshape(-1, *cache.shape[2:])[:num_tokens]


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, q_start: int
) -> torch.Tensor:
    """query [q_len, Hq, D] at positions q_start.. over key/value [kv_len, Hkv, D], causal."""
    q_len, kv_len = query.shape[0], key.shape[0]
    # NOTE: 4-D [1, heads, len, dim] inputs take torch's fused CPU kernel; 3-D ones fall back
    # to the quadratic-memory path, about 8x slower on a 4K-token prefill.
    q = query.float().transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
    k = key.float().transpose(0, 1).unsqueeze(0)  # [1, Hkv, kv_len, D]
    v = value.float().transpose(0, 1).unsqueeze(0)
    if q_start == 0 and q_len == kv_len:
        mask, causal = None, True
    else:
        # Query i sits at position q_start + i and sees keys 0 .. q_start + i.
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(q_start)
        causal = False
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1).to(query.dtype)


def paged_decode_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence ([num_seqs, num_q_heads, head_dim]) over its whole context of
    ``seq_lens[s]`` tokens (the query's own K/V already stored)."""
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return torch.empty_like(query)
    block_size = k_cache.shape[1]
    max_len = int(seq_lens.max())
    num_pages = -(-max_len // block_size)
    # All sequences at once: gather every page up to the longest context, mask the rest (table
    # entries past a sequence's last page are clamped: they may hold anything).
    pages = block_tables[:, :num_pages].long().clamp_(0, k_cache.shape[0] - 1)
    key = k_cache[pages].flatten(1, 2)[:, :max_len]  # [num_seqs, max_len, Hkv, D]
    value = v_cache[pages].flatten(1, 2)[:, :max_len]
    positions = torch.arange(max_len, device=query.device)
    visible = positions[None, :] < seq_lens[:, None].to(positions.dtype)  # [num_seqs, max_len]
    # Masked rows may hold anything, NaN included: zero them so that 0 * NaN cannot leak in.
    key = torch.where(visible[:, :, None, None], key, 0).float()
    value = torch.where(visible[:, :, None, None], value, 0).float()
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float().unsqueeze(2),  # [num_seqs, Hq, 1, D]
        key.transpose(1, 2),  # [num_seqs, Hkv, max_len, D]
        value.transpose(1, 2),
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2).to(query.dtype)


def paged_prefill_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen prefill: sequence s has query rows ``cu_q_lens[s]:cu_q_lens[s+1]`` of ``query``
    ([num_tokens, num_q_heads, head_dim]), the last tokens of its ``seq_lens[s]``-token context.
    Each attends to the cached prefix and causally to the new tokens (all stored in pages)::

        context  | cached prefix (seq_len - q_len) | new tokens (q_len) |
        query i  | sees all                        | sees new[0..i]     |
    """
    out = torch.empty_like(query)
    cu = cu_q_lens.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q = query[cu[s] : cu[s + 1]]
        if q.shape[0] == 0:
            continue
        key = gather_pages(k_cache, block_tables[s], seq_len)
        value = gather_pages(v_cache, block_tables[s], seq_len)
        out[cu[s] : cu[s + 1]] = _attend(q, key, value, scale, q_start=seq_len - q.shape[0])
    return out


@overload
def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None
) -> torch.Tensor: ...


@overload
def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension of ``x``, scaled by ``weight``. With ``residual``:
    ``h = residual + x`` (in the dtype) first, and returns ``(rms_norm(h), h)``."""
    if residual is not None:
        h = residual + x
        return rms_norm_ref(h, weight, eps), h
    # NOTE: normalized in fp32, then scaled in the input dtype, as the reference models do.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` ([num_tokens, num_heads, head_dim]) rotated by the angles of
    ``positions`` (rows of ``cos`` / ``sin``, [max_positions, head_dim / 2]), non-interleaved
    halves, in fp32; new tensors in the input dtype."""
    cos = cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim / 2]
    sin = sin[positions].unsqueeze(1)
    rotated = []
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        rotated.append(out.to(x.dtype))
    return rotated[0], rotated[1]


# Steps of at most this many tokens multiply them by every slot's adapter (see add_lora_ref).
DENSE_TOKENS = 256


def lora_token_weight(
    slot_of_token: torch.Tensor, scaling: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[tokens, slots, 1]: each token's slot's scaling in that slot's column, 0 elsewhere
    (the base model's tokens, slot -1: 0 everywhere). One step's, for every module alike."""
    slots = torch.arange(scaling.shape[0], device=slot_of_token.device)
    weight = (slot_of_token[:, None] == slots[None, :]) * scaling[None, :]
    return weight[:, :, None].to(dtype)


def add_lora_dense(
    y: torch.Tensor,
    x: torch.Tensor,
    token_weight: torch.Tensor,
    a_flat: torch.Tensor,
    b_flat: torch.Tensor,
) -> torch.Tensor:
    """``add_lora_ref`` for a step of few tokens, every slot at once: ``a_flat`` [slots *
    rank, in] and ``b_flat`` [slots * rank, out] are ``a`` and ``b_t`` with their slots laid
    end to end, ``token_weight`` the step's ``lora_token_weight``."""
    num_tokens, num_slots = token_weight.shape[:2]
    h = (x @ a_flat.T).view(num_tokens, num_slots, -1)
    y += ((h * token_weight).flatten(1) @ b_flat).to(y.dtype)
    return y


def add_lora_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    slot_of_token: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    scaling: torch.Tensor,
) -> torch.Tensor:
    """``kernels.lora.add_lora``'s torch reference: ``y`` plus, for each token of slot ``s``
    (-1: the base model, nothing), ``scaling[s] * (a[s] @ x) @ b_t[s]``, in place (``a``
    [slots, rank, in]; ``b_t`` [slots, rank, out], B transposed).

    A step of few tokens (decodes, short prompts) multiplies them by every slot's adapter at
    once, two matmuls whatever the adapters, keeping each token's own slot's part (a one-hot
    weight per slot); a larger one takes one low-rank product per slot present, over that
    slot's tokens only, so that its work does not grow with the slots::

        h = x @ [a_0; a_1; ...]^T        [tokens, slots * rank]
        h *= scaling[s] where s is the token's slot, else 0
        y += h @ [b_t_0; b_t_1; ...]     [tokens, out]
    """
    num_tokens = x.shape[0]
    if num_tokens <= DENSE_TOKENS:
        num_slots, rank, num_in = a.shape
        weight = lora_token_weight(slot_of_token, scaling, x.dtype)
        a_flat, b_flat = a.reshape(num_slots * rank, num_in), b_t.reshape(num_slots * rank, -1)
        return add_lora_dense(y, x, weight, a_flat.to(x.dtype), b_flat.to(x.dtype))
    for slot in torch.unique(slot_of_token).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(slot_of_token == slot, as_tuple=True)[0]
        shrunk = x.index_select(0, rows) @ a[slot].T.to(x.dtype)  # [tokens of slot, rank]
        expanded = (shrunk @ b_t[slot].to(x.dtype)) * scaling[slot].to(x.dtype)
        y.index_add_(0, rows, expanded.to(y.dtype))
    return y
