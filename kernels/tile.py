"""The steps every paged-attention kernel takes over its context, a tile of tokens at a time.

``attend_range`` walks a range of context tokens: per tile it gathers the K/V rows through the
block table and ``online_softmax_step`` folds them into the running max ``m``, normalizer ``l``
and unnormalized output ``acc`` (scores in log2 units, so ``exp2`` does the exponentials); with
``MASKED`` false every row sees the whole tile and ``visible`` is not read.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(
    query,
    key,
    value,
    visible,
    qk_scale,
    m_i,
    l_i,
    acc,
    DOT_FP32: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    if DOT_FP32:
        # NOTE: also the interpreter's path: its low-precision dot is wrong.
        scores = tl.dot(query, tl.trans(key.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(query, tl.trans(key))
    scores = scores * qk_scale
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    # A row that sees nothing in this tile keeps its max; every row sees a token in its first
    # tile, so m_new is finite and no exp2(-inf - -inf) arises.
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    probs = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(probs, 1)
    if DOT_FP32:
        pv = tl.dot(probs, value.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(probs.to(value.dtype), value)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def attend_range(
    query,
    m_i,
    l_i,
    acc,
    k_head_ptr,
    v_head_ptr,
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
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    TAIL: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Fold context tokens ``[start, end)`` into the running state, ``BLOCK_N`` at a time.

    ``k_head_ptr`` / ``v_head_ptr`` point at the KV head's first element in the caches; a
    token's row is found through ``block_table`` (its page) and ``block_size`` (its slot).
    ``TAIL``: the last tile may run past ``end``, so tokens from ``end`` on are hidden.
    ``CAUSAL``: row ``r`` sees only tokens up to ``positions[r]``. Neither: every row sees every
    token of every tile, and the scores go unmasked.
    """
    for tok_start in range(start, end, BLOCK_N):
        toks = tok_start + tl.arange(0, BLOCK_N)
        tok_mask = toks < end
        # Rows past the mask read as 0, so whatever sits in unused slots never reaches the math.
        pages = tl.load(block_table + toks // block_size, mask=tok_mask, other=0).to(tl.int64)
        rows = pages * stride_cache_b + (toks % block_size) * stride_cache_s
        offsets = rows[:, None] + dims[None, :]
        kv_mask = tok_mask[:, None] & dim_mask[None, :]
        key = tl.load(k_head_ptr + offsets, mask=kv_mask, other=0.0)
        value = tl.load(v_head_ptr + offsets, mask=kv_mask, other=0.0)
        if CAUSAL:
            visible = tok_mask[None, :] & (toks[None, :] <= positions[:, None])
        else:
            visible = tok_mask[None, :]
        m_i, l_i, acc = online_softmax_step(
            query, key, value, visible, qk_scale, m_i, l_i, acc, DOT_FP32, TAIL or CAUSAL
        )
    return m_i, l_i, acc
