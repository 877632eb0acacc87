"""Shape, dtype and stride checks shared by the kernel launchers, and launch-time switches."""

from __future__ import annotations

import os

import torch

KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def min_dot_size() -> int:
    """Smallest tile side ``tl.dot`` accepts: 16 when compiled, anything in the interpreter."""
    return 1 if interpreting() else 16


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            "KV cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"K and V caches differ: {tuple(k_cache.shape)} {k_cache.dtype} vs "
            f"{tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"K and V caches have different strides: {k_cache.stride()} vs {v_cache.stride()}"
        )
    if k_cache.dtype not in KV_DTYPES:
        raise ValueError(f"KV cache dtype must be one of {KV_DTYPES}, got {k_cache.dtype}")
    if k_cache.stride(-1) != 1:
        raise ValueError("KV cache head_dim must be contiguous (stride 1)")
    if k_cache.device != v_cache.device:
        raise ValueError("K and V caches are on different devices")


def check_rows(
    name: str, tensor: torch.Tensor, num_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """``tensor`` is [num_rows, num_heads, head_dim] with a contiguous last dimension."""
    if tensor.dim() != 3 or tensor.shape[1:] != (num_heads, head_dim):
        raise ValueError(
            f"{name} must be [num_rows, {num_heads}, {head_dim}], got {tuple(tensor.shape)}"
        )
    if tensor.dtype != dtype:
        raise ValueError(f"{name} dtype {tensor.dtype} differs from the KV cache's {dtype}")
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} head_dim must be contiguous (stride 1)")


def check_index(name: str, tensor: torch.Tensor, dim: int, device: torch.device) -> None:
    if tensor.dim() != dim or tensor.dtype != torch.int32:
        raise ValueError(
            f"{name} must be a {dim}-D int32 tensor, got {tensor.dim()}-D {tensor.dtype}"
        )
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the KV cache on {device}")
    if dim == 1 and tensor.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")
    if dim == 2 and tensor.stride(1) != 1:
        raise ValueError(f"{name} rows must be contiguous")
