"""Random paged-KV test cases: scattered pages, poisoned unused slots, and dense copies."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvswitch.kernels.layout import interpreting
from kvswitch.kernels.reference import store_kv_ref

ON_GPU = torch.cuda.is_available() and not interpreting()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
gpu_only = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs CUDA")]

TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1.5e-2, "rtol": 1e-2},
}
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=gpu_only, id="bfloat16"),
]


@dataclass
class PagedCase:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    keys: list[torch.Tensor]  # per sequence, dense [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]


def make_case(
    seq_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_spare_blocks: int = 3,
    seed: int = 0,
) -> PagedCase:
    """Sequences whose pages are a random permutation of the pool; every unused slot is NaN."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages_per_seq) + num_spare_blocks
    max_pages = max(max(pages_per_seq), 1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    order = torch.randperm(num_blocks, generator=gen)
    # Unused table entries point at a real block too: the kernels must not read past seq_len.
    block_tables = torch.full((len(seq_lens), max_pages), int(order[-1]), dtype=torch.int32)
    keys, values, slots = [], [], []
    next_page = 0
    for s, (seq_len, num_pages) in enumerate(zip(seq_lens, pages_per_seq, strict=True)):
        pages = order[next_page : next_page + num_pages]
        next_page += num_pages
        block_tables[s, :num_pages] = pages.int()
        positions = torch.arange(seq_len)
        slots.append(pages[positions // block_size] * block_size + positions % block_size)
        keys.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype))
        values.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype))
    store_kv_ref(
        torch.cat(keys).to(DEVICE),
        torch.cat(values).to(DEVICE),
        k_cache,
        v_cache,
        torch.cat(slots).to(DEVICE),
    )
    return PagedCase(
        k_cache,
        v_cache,
        block_tables.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        [k.to(DEVICE) for k in keys],
        [v.to(DEVICE) for v in values],
    )


def dense_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last ``len(query)`` positions, written out in fp32 math."""
    q_len, kv_len = query.shape[0], key.shape[0]
    group = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
    k_pos = torch.arange(kv_len, device=query.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)


def gpu_test(test):
    """Mark a test as GPU-only: compiled kernels on CUDA, skipped elsewhere."""
    return pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason="needs CUDA")(test))
