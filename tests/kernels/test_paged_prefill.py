"""paged_prefill against its reference and against dense causal attention."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvswitch.kernels import paged_prefill, paged_prefill_ref
from kvswitch.kernels.layout import interpreting
from kvswitch.kernels.tiles import Tiles
from tests.kernels.paged_case import (
    DEVICE,
    DTYPES,
    TOLERANCES,
    dense_attention,
    gpu_test,
    make_case,
)

# (seq_len, q_len) per sequence: a whole prompt (empty prefix), a prefix hit ending on a page
# boundary, a chunk of a chunked prefill starting and ending mid-page, one new token, a sequence
# with no new tokens in this batch, and a prompt filling its pages exactly (full prefix of 0).
MIXED = [(7, 7), (13, 5), (22, 9), (6, 1), (5, 0), (8, 8)]


def run_case(
    seqs: list[tuple[int, int]],
    *,
    group: int,
    dtype: torch.dtype,
    block_size: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_m: int = 0,
    block_n: int = 0,
    num_splits: int | None = None,
) -> None:
    seq_lens = [seq_len for seq_len, _ in seqs]
    q_lens = [q_len for _, q_len in seqs]
    case = make_case(
        seq_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
    query = query.to(dtype).to(DEVICE)
    cu_q_lens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_q_lens = cu_q_lens.to(DEVICE)
    scale = head_dim**-0.5
    args = (query, case.k_cache, case.v_cache, case.block_tables, cu_q_lens, case.seq_lens, scale)
    tiles = Tiles(block_m=block_m, block_n=block_n) if block_m else None
    out = paged_prefill(*args, tiles=tiles, num_splits=num_splits)
    ref = paged_prefill_ref(*args)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])
    cu = cu_q_lens.tolist()
    for s, q_len in enumerate(q_lens):
        if q_len:
            dense = dense_attention(query[cu[s] : cu[s + 1]], case.keys[s], case.values[s], scale)
            torch.testing.assert_close(ref[cu[s] : cu[s + 1]], dense, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_mixed_batch(dtype: torch.dtype, group: int) -> None:
    run_case(MIXED, group=group, dtype=dtype)


interpreter_tiles = pytest.mark.skipif(
    not interpreting(), reason="compiled, tl.dot takes no tile side under 16"
)


@pytest.mark.parametrize(
    "block_m,block_n",
    [
        pytest.param(2, 4, marks=interpreter_tiles),
        pytest.param(4, 2, marks=interpreter_tiles),
        (16, 16),
    ],
)
def test_prefill_tile_sizes(block_m: int, block_n: int) -> None:
    """Query tiles smaller than a sequence's new tokens, key tiles smaller than a page."""
    run_case(MIXED, group=2, dtype=torch.float32, block_m=block_m, block_n=block_n)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_prefill_split_context(num_splits: int) -> None:
    """Each query tile's context cut across programs and merged: splits of several tiles, of
    one, and more splits than a short context has tiles (empty ones weigh nothing)."""
    run_case([*MIXED, (40, 3)], group=2, dtype=torch.float32, num_splits=num_splits)


@pytest.mark.skipif(not interpreting(), reason="counts the interpreter's 4 multiprocessors")
def test_prefill_splits_a_long_prefix_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few new tokens on a long cached prefix make too few programs to fill the device: the
    launcher splits their context (the interpreter counts 4 multiprocessors) and merges."""
    prefill_module = importlib.import_module("kvswitch.kernels.paged_prefill")
    merged = []
    merge = prefill_module.merge_splits

    def spy(partial: torch.Tensor, *args: torch.Tensor) -> None:
        merged.append(partial.shape[2])
        merge(partial, *args)

    monkeypatch.setattr(prefill_module, "merge_splits", spy)
    run_case([(37, 3)], group=1, dtype=torch.float32, num_kv_heads=1)
    assert merged == [4]


def test_prefill_leaves_its_splits_to_the_caller_when_given_their_buffers() -> None:
    """With the caller's split buffers the kernel writes the splits there and not ``out``;
    merged afterwards (as a CUDA graph does later) they are the attention. Rows past the query
    are the caller's: they stay as they were. Buffers of the wrong shape are refused."""
    merge_splits = importlib.import_module("kvswitch.kernels.paged_decode").merge_splits
    seqs = [(13, 5), (22, 9), (6, 1)]
    case = make_case(
        [n for n, _ in seqs], block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32
    )
    q_lens = [q for _, q in seqs]
    query = torch.randn(sum(q_lens), 4, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    cu_q_lens = torch.tensor([0, 5, 14, 15], dtype=torch.int32, device=DEVICE)
    args = (query, case.k_cache, case.v_cache, case.block_tables, cu_q_lens, case.seq_lens, 0.25)
    partial = torch.full((20, 4, 3, 16), 7.0, device=DEVICE)
    lse = torch.full((20, 4, 3), 7.0, device=DEVICE)
    out = torch.full_like(query, 5.0)
    paged_prefill(*args, out=out, splits=(partial, lse))
    assert bool((out == 5.0).all())
    assert bool((partial[15:] == 7.0).all()) and bool((lse[15:] == 7.0).all())
    merge_splits(partial[:15], lse[:15], out)
    torch.testing.assert_close(out, paged_prefill_ref(*args), **TOLERANCES[torch.float32])
    with pytest.raises(ValueError, match="splits must be fp32"):
        paged_prefill(*args, splits=(partial[:10], lse[:10]))  # fewer rows than the query
    with pytest.raises(ValueError, match="S >= 2"):
        paged_prefill(*args, splits=(partial[:, :, :1], lse[:, :, :1]))


def test_prefill_split_choice() -> None:
    from kvswitch.kernels.paged_prefill import choose_prefill_splits

    # 32 heads x one tile on 132 multiprocessors: 4 splits; already full: none; a short prefix
    # has at most one split per whole tile.
    assert choose_prefill_splits(32, 3968, 128, 132) == 4
    assert choose_prefill_splits(256, 3968, 128, 132) == 1
    assert choose_prefill_splits(8, 200, 64, 132) == 3
    assert choose_prefill_splits(8, 10, 64, 132) == 1


def test_prefill_full_prefix_single_token_matches_decode() -> None:
    """Prefill of one token on top of a cached prefix is a decode step."""
    from kvswitch.kernels import paged_decode

    case = make_case([11, 16], block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    query = torch.randn(2, 4, 16, device=DEVICE)
    cu_q_lens = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    args = (case.k_cache, case.v_cache, case.block_tables)
    prefill = paged_prefill(query, *args, cu_q_lens, case.seq_lens, 0.25)
    decode = paged_decode(query, *args, case.seq_lens, 0.25)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


def test_prefill_rejects_bad_cu_q_lens() -> None:
    case = make_case([3, 4], block_size=4, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    query = torch.zeros(7, 1, 16, device=DEVICE)
    cu_q_lens = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="want 3"):
        paged_prefill(
            query, case.k_cache, case.v_cache, case.block_tables, cu_q_lens, case.seq_lens, 1.0
        )


@gpu_test
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_gpu_shapes(group: int) -> None:
    run_case(
        [(300, 300), (1000, 200), (777, 129), (64, 1)],
        group=group,
        dtype=torch.bfloat16,
        block_size=16,
        num_kv_heads=2,
        head_dim=128,
    )


@gpu_test
def test_prefill_gpu_split_prefix_hit() -> None:
    """The warm step of a prefix hit: 128 new tokens over 3,968 cached, 32 query heads, split
    by the launcher's default."""
    run_case(
        [(4096, 128)], group=4, dtype=torch.bfloat16, block_size=16, num_kv_heads=8, head_dim=128
    )
