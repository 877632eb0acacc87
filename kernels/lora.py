"""add_lora: each token's LoRA adapter added to a projection's output, adapters mixed in a batch.

A token of slot ``s`` (-1: the base model, nothing added) gets ``scaling[s] * B_s @ (A_s @ x)``
on its row of ``y``, in two launches, neither of which depends on how the tokens fall into
slots (so a CUDA graph can hold them)::

    shrink   one program per token: h[t] = scaling[s] * a[s] @ x[t]           ([rank], fp32)
    expand   one program per token and block of outputs: y[t, n:n+N] += h[t] @ b_t[s, :, n:n+N]

Every program reads its token's slot and loads that adapter's rows: tokens of one adapter in a
step read the same weights, which the L2 cache serves after the first. ``a`` is [slots, rank,
in] (A) and ``b_t`` [slots, rank, out] (B transposed, so that a slot's rows of B are
contiguous for the CPU's one matmul over every slot), lower ranks zero-padded
(``worker.lora.LoraSlots``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvswitch.kernels.layout import next_pow2


@triton.jit
def _shrink_kernel(
    x_ptr,
    slot_ptr,
    a_ptr,
    scaling_ptr,
    h_ptr,
    stride_x_t,
    stride_a_s,
    stride_a_r,
    num_in,
    rank,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], tl.float32)
    if slot >= 0:
        a_rows = a_ptr + slot.to(tl.int64) * stride_a_s + ranks[:, None] * stride_a_r
        x_row = x_ptr + token.to(tl.int64) * stride_x_t
        for start in range(0, num_in, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + cols, mask=cols < num_in, other=0.0).to(tl.float32)
            a = tl.load(
                a_rows + cols[None, :],
                mask=(ranks[:, None] < rank) & (cols[None, :] < num_in),
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        acc *= tl.load(scaling_ptr + slot)
    tl.store(h_ptr + token * BLOCK_R + ranks, acc)


@triton.jit
def _expand_kernel(
    y_ptr,
    slot_ptr,
    b_ptr,
    h_ptr,
    stride_y_t,
    stride_b_s,
    stride_b_r,
    num_out,
    rank,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        ranks = tl.arange(0, BLOCK_R)
        outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        h = tl.load(h_ptr + token * BLOCK_R + ranks)
        b = tl.load(
            b_ptr + slot.to(tl.int64) * stride_b_s + ranks[:, None] * stride_b_r + outs[None, :],
            mask=(ranks[:, None] < rank) & (outs[None, :] < num_out),
            other=0.0,
        ).to(tl.float32)
        delta = tl.sum(b * h[:, None], axis=0)
        y_row = y_ptr + token.to(tl.int64) * stride_y_t + outs
        mask = outs < num_out
        y = tl.load(y_row, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    slot_of_token: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    scaling: torch.Tensor,
) -> torch.Tensor:
    """``y`` [tokens, out] plus each token's adapter on ``x`` [tokens, in], in place (rows of
    ``y`` and ``x`` may be strided; their last dimension must be contiguous); ``slot_of_token``
    int64 [tokens], ``a`` [slots, rank, in], ``b_t`` [slots, rank, out], ``scaling`` fp32
    [slots]. ``kernels.reference.add_lora_ref`` computes the same."""
    num_tokens, num_out = y.shape
    num_slots, rank, num_in = a.shape
    if (
        x.shape != (num_tokens, num_in)
        or b_t.shape != (num_slots, rank, num_out)
        or slot_of_token.shape != (num_tokens,)
        or scaling.shape != (num_slots,)
    ):
        raise ValueError(
            f"add_lora: y {tuple(y.shape)}, x {tuple(x.shape)}, slot_of_token "
            f"{tuple(slot_of_token.shape)}, a {tuple(a.shape)}, b_t {tuple(b_t.shape)}, scaling "
            f"{tuple(scaling.shape)} do not agree"
        )
    if num_tokens == 0:
        return y
    if x.stride(1) != 1 or y.stride(1) != 1 or not a.is_contiguous() or not b_t.is_contiguous():
        raise ValueError("add_lora: x's and y's rows, a and b_t must be contiguous")
    block_r = max(next_pow2(rank), 16)
    shrunk = torch.empty((num_tokens, block_r), dtype=torch.float32, device=y.device)
    _shrink_kernel[(num_tokens,)](
        x,
        slot_of_token,
        a,
        scaling,
        shrunk,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        num_in,
        rank,
        BLOCK_R=block_r,
        BLOCK_K=min(next_pow2(num_in), 128),
    )
    block_n = min(next_pow2(num_out), 128)
    _expand_kernel[(num_tokens, triton.cdiv(num_out, block_n))](
        y,
        slot_of_token,
        b_t,
        shrunk,
        y.stride(0),
        b_t.stride(0),
        b_t.stride(1),
        num_out,
        rank,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
    )
    return y
