"""store_kv against its reference: slots scattered over pages, padding skipped."""

from __future__ import annotations

import pytest
import torch

from kvswitch.kernels import store_kv, store_kv_ref
from tests.kernels.paged_case import DEVICE, DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (3, 24), (8, 128)])
def test_store_kv_matches_reference(dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size = 6, 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:9].int()
    slots[[2, 5]] = -1  # padding tokens
    key = torch.randn(9, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(9, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = slots.to(DEVICE)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    # Exactly the 7 real tokens changed the cache.
    flat = k_cache.view(-1, num_kv_heads, head_dim)
    written = slots[slots >= 0].long()
    assert torch.equal(flat[written], key[slots >= 0])


def test_store_kv_strided_rows() -> None:
    """K and V may be views into a fused QKV projection (row stride larger than heads x dim)."""
    qkv = torch.randn(5, 3, 2, 16, device=DEVICE)  # [tokens, q/k/v, heads, dim]
    key, value = qkv[:, 1], qkv[:, 2]
    k_cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([7, 0, -1, 3, 4], dtype=torch.int32, device=DEVICE)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 16)[7], key[0])
    assert torch.equal(v_cache.view(-1, 2, 16)[4], value[4])
    assert k_cache.view(-1, 2, 16)[[1, 2, 5, 6]].abs().sum() == 0


def test_store_kv_rejects_bad_input() -> None:
    k_cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    key = torch.zeros(3, 2, 16, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        store_kv(key.half(), key.half(), k_cache, k_cache.clone(), slots)
    with pytest.raises(ValueError, match=r"\[num_rows, 2, 16\]"):
        store_kv(key[:, :1], key[:, :1], k_cache, k_cache.clone(), slots)
    with pytest.raises(ValueError, match="int32"):
        store_kv(key, key, k_cache, k_cache.clone(), slots.long())
    with pytest.raises(ValueError, match="num_tokens"):
        store_kv(key, key, k_cache, k_cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="K and V caches differ"):
        store_kv(key, key, k_cache, k_cache[:1].clone(), slots)
