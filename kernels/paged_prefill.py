"""paged_prefill: a varlen batch of new tokens attending to their paged context.

A sequence's new tokens are the last ``q_len`` of its ``seq_len``-token context, and their K/V
are already stored in its pages (``store_kv`` runs first). Each query attends to the cached
prefix and causally to the new tokens, so a prefix hit and a chunk of a chunked prefill are the
same case::

    context      | cached prefix (seq_len - q_len)  | new tokens (q_len)      |
    query i      | all of it                        | new[0] .. new[i]        |

One program handles a tile of ``BLOCK_M`` queries of one sequence and one query head, and walks
the context in tiles of ``BLOCK_N`` tokens up to the causal limit of its last query; only the
tiles that reach past its first query's position apply the causal mask.

A step with few query tiles over long contexts (a short prompt tail on a long cached prefix)
would leave most multiprocessors idle, so the launcher may cut each tile's context into splits
run by programs of their own, merged afterwards as paged_decode merges its splits::

    context      | split 0     | split 1     | ... | split S-1 (also the masked tiles)   |
    program      | o_0, lse_0  | o_1, lse_1  | ... | o_S-1, lse_S-1                      |
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvswitch.kernels.layout import (
    check_index,
    check_kv_cache,
    check_rows,
    interpreting,
    next_pow2,
)
from kvswitch.kernels.paged_decode import LOG2_E, merge_splits, num_sms
from kvswitch.kernels.tile import attend_range
from kvswitch.kernels.tiles import Tiles, prefill_tiles


@triton.jit
def _paged_prefill_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_q_lens_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_o_split,
    stride_lse_t,
    stride_lse_h,
    stride_cache_b,
    stride_cache_s,
    stride_cache_h,
    stride_bt_s,
    block_size,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # NOTE: the heaviest query tiles (last in their sequence, longest causal span) start first
    # and the query heads of one KV head run side by side, sharing its K/V through L2.
    q_head = tl.program_id(0)
    seq = tl.program_id(1)
    q_tile = tl.num_programs(2) // NUM_SPLITS - 1 - tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    kv_head = q_head // GROUP
    q_first = tl.load(cu_q_lens_ptr + seq)
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q_first
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < q_len
    dim_mask = dims < head_dim
    q_offsets = (q_first + rows).to(tl.int64)[:, None] * stride_q_t + q_head * stride_q_h
    query = tl.load(
        query_ptr + q_offsets + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        query = query.to(tl.float32)
    positions = prefix_len + rows  # where each query sits in the context

    # Context tiles that end before the tile's first query position are seen whole by every row
    # and need no causal mask; the rest, up to the last row's position, do. A tile past q_len
    # sees nothing. Splits share out the unmasked tiles, whole tiles each; the last one also
    # takes the masked ones.
    has_rows = q_tile * BLOCK_M < q_len
    first_position = prefix_len + q_tile * BLOCK_M
    full_end = tl.where(has_rows, first_position // BLOCK_N * BLOCK_N, 0)
    kv_end = tl.where(has_rows, tl.minimum(seq_len, first_position + BLOCK_M), 0)
    tokens_per_split = tl.cdiv(tl.cdiv(full_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = tl.minimum(split * tokens_per_split, full_end)
    end = tl.minimum(start + tokens_per_split, full_end)
    kv_end = tl.where(split == NUM_SPLITS - 1, kv_end, end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
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
        positions,
        qk_scale,
        BLOCK_N,
        DOT_FP32,
        TAIL=False,
        CAUSAL=False,
    )
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
        end,
        kv_end,
        positions,
        qk_scale,
        BLOCK_N,
        DOT_FP32,
        TAIL=True,
        CAUSAL=True,
    )

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    token = (q_first + rows).to(tl.int64)
    o_offsets = token[:, None] * stride_o_t + q_head * stride_o_h + dims[None, :]
    o_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS > 1:
        # NOTE: a split with no tile (a context shorter than the splits) weighs nothing: l = 0.
        tl.store(out_ptr + o_offsets + split * stride_o_split, out, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        lse_offsets = token * stride_lse_t + q_head * stride_lse_h + split
        tl.store(lse_ptr + lse_offsets, lse, mask=row_mask)
    else:
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=o_mask)


def paged_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_q_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    tiles: Tiles | None = None,
    out: torch.Tensor | None = None,
    splits: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch of new tokens over their paged contexts.

    ``query`` is [num_tokens, num_q_heads, head_dim]; sequence s owns rows
    ``cu_q_lens[s]:cu_q_lens[s+1]`` (int32, ``num_seqs + 1`` entries) and has ``seq_lens[s]``
    context tokens in all, the new ones included and already stored. ``max_q_len`` and
    ``max_seq_len`` spare device syncs when the caller knows them. ``num_splits`` cuts each query
    tile's context into that many programs; by default (None) as many as fill the device when
    the query tiles alone would not.

    ``splits``: the caller's ``(partial, lse)`` buffers, fp32 ``[rows, num_q_heads, num_splits,
    head_dim]`` and ``[rows, num_q_heads, num_splits]`` (rows at least the query's): the kernel
    leaves its splits there and ``out`` is not written; the caller merges them
    (``paged_decode.merge_splits``), perhaps from a CUDA graph.
    """
    check_kv_cache(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_q_heads = query.shape[1] if query.dim() == 3 else 0
    check_rows("query", query, num_q_heads, head_dim, k_cache.dtype)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group over {num_kv_heads} KV heads")
    check_index("block_tables", block_tables, 2, k_cache.device)
    check_index("cu_q_lens", cu_q_lens, 1, k_cache.device)
    check_index("seq_lens", seq_lens, 1, k_cache.device)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or cu_q_lens.shape[0] != num_seqs + 1:
        raise ValueError(
            f"seq_lens has {num_seqs} sequences, block_tables {block_tables.shape[0]}, "
            f"cu_q_lens {cu_q_lens.shape[0]} entries (want {num_seqs + 1})"
        )
    if out is None:
        out = torch.empty_like(query)
    else:
        check_rows("out", out, num_q_heads, head_dim, query.dtype)
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max().item())
    tiles = tiles or prefill_tiles(max_q_len, block_size, k_cache.dtype)
    if tiles.block_m == 0:
        raise ValueError("paged_prefill needs tiles with block_m set")
    num_q_tiles = math.ceil(max_q_len / tiles.block_m)
    if splits is not None:
        partial, lse = splits
        num_splits = check_splits(partial, lse, query.shape[0], num_q_heads, head_dim)
    else:
        if num_splits is None:
            num_programs = num_q_heads * num_seqs * num_q_tiles
            num_splits = _default_splits(num_programs, seq_lens, max_q_len, max_seq_len, tiles)
        elif num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        if num_splits > 1:
            partial = query.new_empty(
                (query.shape[0], num_q_heads, num_splits, head_dim), dtype=torch.float32
            )
            lse = query.new_empty((query.shape[0], num_q_heads, num_splits), dtype=torch.float32)
    if num_splits > 1:
        target, o_split, lse_strides = partial, partial.stride(2), (lse.stride(0), lse.stride(1))
        o_strides = (partial.stride(0), partial.stride(1))
    else:
        target, lse, o_split, lse_strides = out, out, 0, (0, 0)
        o_strides = (out.stride(0), out.stride(1))
    grid = (num_q_heads, num_seqs, num_q_tiles * num_splits)
    _paged_prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        cu_q_lens,
        seq_lens,
        target,
        lse,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        *o_strides,
        o_split,
        *lse_strides,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        block_size,
        head_dim,
        GROUP=num_q_heads // num_kv_heads,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_D=next_pow2(head_dim),
        NUM_SPLITS=num_splits,
        DOT_FP32=interpreting() or k_cache.dtype == torch.float32,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_splits > 1 and splits is None:
        merge_splits(partial, lse, out)
    return out


def _default_splits(
    num_programs: int,
    seq_lens: torch.Tensor,
    max_q_len: int,
    max_seq_len: int | None,
    tiles: Tiles,
) -> int:
    """``choose_prefill_splits`` for this launch; 1, with no sync, when the query tiles alone
    fill the device."""
    device_sms = num_sms(seq_lens.device)
    if num_programs >= device_sms:
        return 1
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    return choose_prefill_splits(num_programs, max_seq_len - max_q_len, tiles.block_n, device_sms)


def check_splits(
    partial: torch.Tensor, lse: torch.Tensor, num_rows: int, num_q_heads: int, head_dim: int
) -> int:
    """The number of splits that caller-owned split buffers hold (at least 2), or ValueError."""
    num_splits = partial.shape[2] if partial.dim() == 4 else 0
    if (
        num_splits < 2
        or partial.shape[0] < num_rows
        or partial.shape[1:] != (num_q_heads, num_splits, head_dim)
        or lse.shape != partial.shape[:3]
        or partial.dtype != torch.float32
        or lse.dtype != torch.float32
        or partial.stride(-1) != 1
        or lse.stride(-1) != 1
    ):
        raise ValueError(
            f"splits must be fp32 [rows, {num_q_heads}, S, {head_dim}] and [rows, {num_q_heads}, "
            f"S], S >= 2, rows >= {num_rows}; got {tuple(partial.shape)} {partial.dtype} and "
            f"{tuple(lse.shape)} {lse.dtype}"
        )
    return num_splits


def choose_prefill_splits(
    num_programs: int, max_prefix_len: int, block_n: int, num_sms: int
) -> int:
    """Splits enough for ``num_programs`` query tiles to cover the multiprocessors once (a
    prefill program fills one), and no more than the longest cached prefix has whole tiles."""
    return max(1, min(num_sms // max(num_programs, 1), max_prefix_len // block_n))
