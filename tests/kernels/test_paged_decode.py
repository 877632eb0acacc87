"""paged_decode against its reference and against dense attention."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvswitch.kernels import paged_decode, paged_decode_ref
from kvswitch.kernels.tiles import decode_tiles
from tests.kernels.paged_case import (
    DEVICE,
    DTYPES,
    TOLERANCES,
    dense_attention,
    gpu_test,
    make_case,
)


def run_case(
    seq_lens: list[int],
    *,
    group: int,
    dtype: torch.dtype,
    block_size: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> None:
    case = make_case(
        seq_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    query = query.to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    out = paged_decode(
        query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        scale,
        num_splits=num_splits,
        max_seq_len=max_seq_len,
    )
    ref = paged_decode_ref(
        query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])
    for s in range(len(seq_lens)):
        dense = dense_attention(query[s : s + 1], case.keys[s], case.values[s], scale)[0]
        torch.testing.assert_close(ref[s], dense, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_odd_lengths(dtype: torch.dtype, group: int, num_splits: int) -> None:
    # 1 token, a partial last page, an exactly full page run, a longer odd length.
    run_case([1, 7, 8, 13], group=group, dtype=dtype, num_splits=num_splits)


def test_decode_more_splits_than_tiles_leaves_empty_splits() -> None:
    """Short sequences in a batch with a long one get splits with no tokens at all."""
    run_case([2, 3, 29], group=2, dtype=torch.float32, num_splits=6)


def test_decode_launched_for_a_longer_context_than_any_sequence_has() -> None:
    """A decode CUDA graph is captured for the model's whole context: as many splits as that
    would take, most of them empty for short sequences, and its padding rows have one token of
    context."""
    run_case([1, 7, 13, 1], group=2, dtype=torch.float32, max_seq_len=4096)


def test_each_sequence_cuts_its_own_context_into_the_splits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Splits are sized by each sequence's length, not the launch's longest: under a launch for
    4,096 tokens a 10-tile context still spreads over all 4 splits (160 tokens in the
    interpreter's 16-token tiles, 640 in compiled 64-token ones)."""
    # NOTE: by name: the package's own paged_decode attribute is the function.
    module = importlib.import_module("kvswitch.kernels.paged_decode")
    merged = []

    class MergeSpy:
        def __getitem__(self, grid):
            def launch(partial, lse, *args, **kwargs):
                merged.append(lse.clone())
                return merge[grid](partial, lse, *args, **kwargs)

            return launch

    merge = module._merge_splits_kernel
    monkeypatch.setattr(module, "_merge_splits_kernel", MergeSpy())
    block_n = decode_tiles(16).block_n
    seq_lens = [2 * block_n, 10 * block_n]
    run_case(seq_lens, group=2, dtype=torch.float32, block_size=16, num_splits=4, max_seq_len=4096)
    (lse,) = merged  # [num_seqs, num_q_heads, num_splits]; -inf where a split had no tokens
    assert lse[1].isfinite().all()  # 10 tiles: splits of 3, 3, 3 and 1
    assert lse[0, :, :2].isfinite().all()  # two tiles, in the first two splits
    assert torch.isneginf(lse[0, :, 2:]).all()


def test_decode_block_size_larger_than_tile() -> None:
    run_case([5, 21], group=4, dtype=torch.float16, block_size=16, head_dim=32)


def test_decode_rejects_bad_group() -> None:
    case = make_case([3], block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    query = torch.zeros(1, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="do not group"):
        paged_decode(query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0)


@gpu_test
@pytest.mark.parametrize("group", [1, 4, 8, 16])
def test_decode_gpu_shapes(group: int) -> None:
    run_case(
        [1, 17, 255, 1000, 4097],
        group=group,
        dtype=torch.bfloat16,
        block_size=16,
        num_kv_heads=2,
        head_dim=128,
    )


def test_num_splits_fill_the_multiprocessors_without_empty_splits() -> None:
    from kvswitch.kernels.paged_decode import choose_num_splits

    # The benchmark's batch on an H100: 512 (sequence, KV head) programs, 4 per SM wanted.
    assert choose_num_splits(64, 8, 4096, 16, num_sms=132) == 2
    # One sequence: 8 programs need 66 splits each to fill 132 SMs four deep.
    assert choose_num_splits(1, 8, 4096, 16, num_sms=132) == 66
    # ... but never more splits than 16-token tiles.
    assert choose_num_splits(1, 8, 40, 16, num_sms=132) == 3
    assert choose_num_splits(1024, 8, 4096, 16, num_sms=132) == 1
