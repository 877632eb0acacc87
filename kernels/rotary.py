"""rotary: rotary position embedding of queries and keys, in place, in one launch.

One program takes one token: it gathers the cos/sin row of the token's position once and rotates
every query head, then every key head. The layout is the non-interleaved (GPT-NeoX) one: a head's
first half pairs with its second half::

    head    | x1 (dims 0 .. d/2)        | x2 (dims d/2 .. d)        |
    rotated | x1 * cos - x2 * sin       | x2 * cos + x1 * sin       |   (fp32, rounded once)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvswitch.kernels.layout import next_pow2

ROTARY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_h,
    num_heads,
    half_dim,
    cos,
    sin,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate the ``num_heads`` heads of one token, starting at ``x_ptr``, in place."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < half_dim)
    first = x_ptr + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half_dim, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half_dim, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_table,
    num_q_heads,
    num_kv_heads,
    half_dim,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half_dim
    table = position * stride_table + dims
    cos = tl.load(cos_ptr + table, mask=dim_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + table, mask=dim_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_q_t,
        stride_q_h,
        num_q_heads,
        half_dim,
        cos,
        sin,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr + token * stride_k_t,
        stride_k_h,
        num_kv_heads,
        half_dim,
        cos,
        sin,
        BLOCK_HK,
        BLOCK_HALF,
    )


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Rotate ``q`` [num_tokens, num_q_heads, head_dim] and ``k`` [num_tokens, num_kv_heads,
    head_dim] in place: token i by the angles of ``positions[i]`` (int64), read from ``cos`` and
    ``sin`` ([max_positions, head_dim / 2]; fp32 as ``RopeConfig.cos_sin`` makes them, or the
    model's dtype once the module is cast: the math is fp32 either way). q and k may be strided
    views (of a projection's output, say) with a contiguous last dimension; they must not overlap.
    Positions must be below ``max_positions``: they are not checked (that would wait for the
    device)."""
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 3:
            raise ValueError(
                f"{name} must be [num_tokens, num_heads, head_dim], got shape {tuple(x.shape)}"
            )
        if x.dtype not in ROTARY_DTYPES:
            raise ValueError(f"{name} dtype must be one of {ROTARY_DTYPES}, got {x.dtype}")
        if x.stride(2) != 1:
            raise ValueError(f"{name} head_dim must be contiguous (stride 1)")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or k.dtype != q.dtype:
        raise ValueError(
            f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must agree on "
            "num_tokens, head_dim and dtype"
        )
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    half_dim = head_dim // 2
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != half_dim or table.dtype not in ROTARY_DTYPES:
            raise ValueError(
                f"{name} must be a [max_positions, {half_dim}] table of one of {ROTARY_DTYPES}, "
                f"got {tuple(table.shape)} {table.dtype}"
            )
    if (
        cos.shape != sin.shape
        or cos.dtype != sin.dtype
        or cos.stride() != sin.stride()
        or cos.stride(1) != 1
    ):
        raise ValueError(
            "cos and sin must have one shape, dtype and layout, with contiguous rows; got "
            f"{tuple(cos.shape)} {cos.dtype} {cos.stride()} and {tuple(sin.shape)} {sin.dtype} "
            f"{sin.stride()}"
        )
    if positions.shape != (num_tokens,) or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be a [{num_tokens}] int64 tensor, got {tuple(positions.shape)} "
            f"{positions.dtype}"
        )
    if positions.stride(0) != 1:
        raise ValueError("positions must be contiguous")
    for name, tensor in (("k", k), ("cos", cos), ("sin", sin), ("positions", positions)):
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, q on {q.device}")
    if num_tokens == 0:
        return
    block_hq, block_half = next_pow2(num_q_heads), next_pow2(half_dim)
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        positions,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        num_q_heads,
        num_kv_heads,
        half_dim,
        BLOCK_HQ=block_hq,
        BLOCK_HK=next_pow2(num_kv_heads),
        BLOCK_HALF=block_half,
        # NOTE: 4 warps up to 32 query heads of 128 dims; more heads, more warps (no spills).
        num_warps=min(max(block_hq * block_half // 512, 4), 16),
    )
