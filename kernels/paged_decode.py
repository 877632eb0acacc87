"""paged_decode: one query token per sequence over its paged context.

One program handles one (sequence, KV head, split): the query heads that share the KV head are
packed into the rows of one tile, so each K/V row is read from memory once for the whole group.
Long contexts are cut into splits that run in parallel; each writes its partial output and
log-sum-exp, and a second kernel merges them::

    context  | split 0          | split 1          | split 2    |   (tokens_per_split each)
    program  | o_0, lse_0       | o_1, lse_1       | o_2, lse_2 |
    merge    | out = sum_i exp2(lse_i - max) * o_i / sum_i exp2(lse_i - max)

Each sequence cuts its own context: ``tokens_per_split`` is its length over the number of splits,
rounded up to whole tiles. A short sequence beside a long one (or under a launch sized for the
longest context the model takes, as a CUDA graph's is) still spreads over the splits, and the
splits past its last tile are empty.

Loads past a sequence's length are masked, so the tail of its last page may hold anything.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kvswitch.kernels.layout import (
    check_index,
    check_kv_cache,
    check_rows,
    interpreting,
    min_dot_size,
    next_pow2,
)
from kvswitch.kernels.tile import attend_range
from kvswitch.kernels.tiles import Tiles, decode_tiles

LOG2_E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    stride_q_s,
    stride_q_h,
    stride_cache_b,
    stride_cache_s,
    stride_cache_h,
    stride_bt_s,
    stride_o_s,
    stride_o_h,
    stride_o_split,
    stride_lse_s,
    stride_lse_h,
    block_size,
    head_dim,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Splits start on tile boundaries so that no tile straddles two programs.
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, BLOCK_D)
    q_heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dim_mask = dims < head_dim
    query = tl.load(
        query_ptr + seq * stride_q_s + q_heads[:, None] * stride_q_h + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        query = query.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    k_head = k_cache_ptr + kv_head * stride_cache_h
    v_head = v_cache_ptr + kv_head * stride_cache_h
    m_i, l_i, acc = attend_range(
        query,
        m_i,
        l_i,
        acc,
        k_head,
        v_head,
        block_table,
        block_size,
        stride_cache_b,
        stride_cache_s,
        dims,
        dim_mask,
        start,
        end,
        None,
        qk_scale,
        BLOCK_N,
        DOT_FP32,
        TAIL=True,
        CAUSAL=False,
    )

    # NOTE: an empty split (start >= seq_len) leaves l_i = 0: it writes 0 and lse = -inf, which
    # the merge weighs as nothing.
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    out_offsets = seq * stride_o_s + q_heads[:, None] * stride_o_h + dims[None, :]
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        tl.store(out_ptr + out_offsets + split * stride_o_split, out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(lse_ptr + seq * stride_lse_s + q_heads * stride_lse_h + split, lse, mask=row_mask)
    else:
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    head_dim,
    stride_p_s,
    stride_p_h,
    stride_p_split,
    stride_lse_s,
    stride_lse_h,
    stride_o_s,
    stride_o_h,
    SPLIT_CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # NOTE: the splits are taken SPLIT_CHUNK at a time, first for the largest log-sum-exp,
    # then weighted: a decode graph's hundreds of splits held at once would spill registers.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    lse_row = lse_ptr + seq * stride_lse_s + head * stride_lse_h
    part_row = part_ptr + seq * stride_p_s + head * stride_p_h
    lse_max = tl.full([SPLIT_CHUNK], float("-inf"), tl.float32)
    for first in range(0, num_splits, SPLIT_CHUNK):
        splits = first + tl.arange(0, SPLIT_CHUNK)
        lse = tl.load(lse_row + splits, mask=splits < num_splits, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    top = tl.max(lse_max, 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = tl.zeros([SPLIT_CHUNK], tl.float32)
    for first in range(0, num_splits, SPLIT_CHUNK):
        splits = first + tl.arange(0, SPLIT_CHUNK)
        split_mask = splits < num_splits
        lse = tl.load(lse_row + splits, mask=split_mask, other=float("-inf"))
        weights = tl.exp2(lse - top)
        part = tl.load(
            part_row + splits[:, None] * stride_p_split + dims[None, :],
            mask=split_mask[:, None] & (dims[None, :] < head_dim),
            other=0.0,
        )
        acc += tl.sum(part * weights[:, None], 0)
        total += weights
    out = acc / tl.sum(total, 0)
    tl.store(
        out_ptr + seq * stride_o_s + head * stride_o_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's multiprocessors (4 where there is none, so that the interpreter splits)."""
    if device.type != "cuda" or interpreting():
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int
) -> int:
    """Enough splits to give every multiprocessor a few programs, and no more than the longest
    context has tiles (each sequence then cuts its own context into that many)."""
    wanted = math.ceil(4 * num_sms / max(num_seqs * num_kv_heads, 1))
    return max(1, min(wanted, math.ceil(max_seq_len / block_n)))


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    tiles: Tiles | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its whole context, read from pages.

    ``query`` is [num_seqs, num_q_heads, head_dim]; ``seq_lens`` (int32, each >= 1) counts the
    context tokens including the query's own, whose K/V must already be stored. ``max_seq_len``
    spares a device sync when the caller knows it.
    """
    check_kv_cache(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_seqs, num_q_heads = query.shape[0], query.shape[1]
    check_rows("query", query, num_q_heads, head_dim, k_cache.dtype)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group over {num_kv_heads} KV heads")
    check_index("block_tables", block_tables, 2, k_cache.device)
    check_index("seq_lens", seq_lens, 1, k_cache.device)
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"query has {num_seqs} sequences, block_tables {block_tables.shape[0]}, "
            f"seq_lens {seq_lens.shape[0]}"
        )
    if out is None:
        out = torch.empty_like(query)
    else:
        check_rows("out", out, num_q_heads, head_dim, query.dtype)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    group = num_q_heads // num_kv_heads
    tiles = tiles or decode_tiles(block_size)
    block_n = tiles.block_n
    if num_splits is None:
        num_splits = choose_num_splits(
            num_seqs, num_kv_heads, max_seq_len, block_n, num_sms(query.device)
        )
    split = num_splits > 1
    if split:
        partial = torch.empty(
            num_seqs, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        lse = torch.empty(
            num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=query.device
        )
        target, o_strides = partial, (partial.stride(0), partial.stride(1), partial.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    else:
        target, lse, o_strides, lse_strides = out, out, (out.stride(0), out.stride(1), 0), (0, 0)

    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        target,
        lse,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        *o_strides,
        *lse_strides,
        block_size,
        head_dim,
        GROUP=group,
        GROUP_PAD=max(min_dot_size(), next_pow2(group)),
        BLOCK_N=block_n,
        BLOCK_D=next_pow2(head_dim),
        SPLIT=split,
        DOT_FP32=interpreting() or k_cache.dtype == torch.float32,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if split:
        merge_splits(partial, lse, out)
    return out


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """Write into ``out`` [num_rows, num_heads, head_dim] the merge of each row's and head's
    splits: ``partial`` [num_rows, num_heads, num_splits, head_dim] (fp32) and their log2-sum-exps
    ``lse`` [num_rows, num_heads, num_splits]."""
    num_rows, num_heads, num_splits, head_dim = partial.shape
    _merge_splits_kernel[(num_rows, num_heads)](
        partial,
        lse,
        out,
        num_splits,
        head_dim,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        SPLIT_CHUNK=min(16, next_pow2(num_splits)),
        BLOCK_D=next_pow2(head_dim),
    )
