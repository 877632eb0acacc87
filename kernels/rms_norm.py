"""rms_norm: RMSNorm of each row, optionally after adding the residual stream (one launch).

One program normalizes one row (token); the whole hidden dimension sits in one block. With a
residual it is a decoder layer's "add, then norm"::

    h   = x + residual                        (rounded to the dtype, as torch's add)
    out = weight * (h * rsqrt(mean(h^2) + eps))  (normalized in fp32, rounded to the dtype,
                                                   then scaled: one more rounding)

and both ``out`` and ``h`` come back, so the next layer adds its own output to ``h``.
"""

from __future__ import annotations

from typing import overload

import torch
import triton
import triton.language as tl

from kvswitch.kernels.layout import next_pow2

NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# One row lives in registers: past this the block no longer fits 32 warps' worth of them.
MAX_HIDDEN_SIZE = 32768


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # NOTE: summed in fp32 and rounded once, which is what torch's add in the dtype gives.
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    # Masked columns load as 0: they add nothing to the sum, and the mean divides by the real size.
    mean_square = tl.sum(x32 * x32, axis=0) / hidden_size
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    # NOTE: the product of the two dtype-rounded values, rounded once: torch's multiply in the
    # dtype (the reference scales after casting the normalized row back).
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None
) -> torch.Tensor: ...


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row of ``x`` ([num_tokens, hidden_size]) scaled by ``weight``
    ([hidden_size], the dtype of ``x``), into a new tensor. With ``residual`` (the shape and
    dtype of ``x``): ``h = x + residual`` first, and returns ``(rms_norm(h), h)``, both new
    tensors; the inputs are not modified. Rows may have any stride; columns are contiguous."""
    _check_rows("x", x)
    num_tokens, hidden_size = x.shape
    if hidden_size > MAX_HIDDEN_SIZE:
        raise ValueError(f"hidden_size {hidden_size} exceeds the kernel's {MAX_HIDDEN_SIZE}")
    if weight.shape != (hidden_size,) or weight.stride(0) != 1:
        raise ValueError(
            f"weight must be a contiguous [{hidden_size}] tensor, got shape "
            f"{tuple(weight.shape)} stride {weight.stride()}"
        )
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(
            f"weight is {weight.dtype} on {weight.device}, x is {x.dtype} on {x.device}: "
            "they must match"
        )
    if residual is not None:
        _check_rows("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(
                f"residual is {tuple(residual.shape)} {residual.dtype} on {residual.device}, "
                f"x is {tuple(x.shape)} {x.dtype} on {x.device}: they must match"
            )
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    residual_out = None if residual is None else torch.empty_like(out)
    if num_tokens > 0:
        block = next_pow2(hidden_size)
        _rms_norm_kernel[(num_tokens,)](
            x,
            residual,
            weight,
            out,
            residual_out,
            x.stride(0),
            0 if residual is None else residual.stride(0),
            out.stride(0),
            0 if residual_out is None else residual_out.stride(0),
            hidden_size,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            # NOTE: about 16 elements per thread: a whole row stays in registers without spills.
            num_warps=min(max(block // 512, 1), 32),
        )
    if residual_out is None:
        return out
    return out, residual_out


def _check_rows(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 2:
        raise ValueError(
            f"{name} must be [num_tokens, hidden_size], got shape {tuple(tensor.shape)}"
        )
    if tensor.dtype not in NORM_DTYPES:
        raise ValueError(f"{name} dtype must be one of {NORM_DTYPES}, got {tensor.dtype}")
    if tensor.stride(1) != 1:
        raise ValueError(f"{name} hidden dimension must be contiguous (stride 1)")
