"""store_kv: write new K/V rows into their pages through a slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvswitch.kernels.layout import check_index, check_kv_cache, check_rows, next_pow2


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_b,
    stride_cache_s,
    stride_cache_h,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # Slot -1 marks a padding token: everything is masked off. (The slot is broadcast first:
    # the interpreter mistypes a scalar-and-tile mask.)
    slots = slot + tl.zeros([BLOCK_H, BLOCK_D], tl.int64)
    mask = (slots >= 0) & (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    dst = (
        (slot // block_size) * stride_cache_b
        + (slot % block_size) * stride_cache_s
        + heads[:, None] * stride_cache_h
        + dims[None, :]
    )
    row = token.to(tl.int64)
    key = tl.load(
        key_ptr + row * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=mask
    )
    tl.store(k_cache_ptr + dst, key, mask=mask)
    value = tl.load(
        value_ptr + row * stride_value_t + heads[:, None] * stride_value_h + dims[None, :],
        mask=mask,
    )
    tl.store(v_cache_ptr + dst, value, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key[i]`` / ``value[i]`` ([num_tokens, num_kv_heads, head_dim]) to slot
    ``slot_mapping[i]`` (int32) of the caches; slot -1 is padding and is skipped."""
    check_kv_cache(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check_rows("key", key, num_kv_heads, head_dim, k_cache.dtype)
    check_rows("value", value, num_kv_heads, head_dim, k_cache.dtype)
    check_index("slot_mapping", slot_mapping, 1, k_cache.device)
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"key, value and slot_mapping disagree on num_tokens: {num_tokens}, "
            f"{value.shape[0]}, {slot_mapping.shape[0]}"
        )
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_size,
        num_kv_heads,
        head_dim,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
    )
