"""Tile choices: checked on construction, and the launchers refuse ones they cannot use."""

from __future__ import annotations

import pytest
import torch

from kvswitch.kernels import paged_prefill
from kvswitch.kernels.layout import interpreting
from kvswitch.kernels.tiles import Tiles, decode_tiles, prefill_tiles
from tests.kernels.paged_case import DEVICE, make_case


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"block_n": 24}, "block_n must be a power of two"),
        ({"block_n": 0}, "block_n must be positive"),
        ({"block_n": 16, "block_m": 48}, "block_m must be a power of two"),
        ({"block_n": 16, "num_warps": 3}, "num_warps"),
        ({"block_n": 16, "num_stages": 0}, "num_stages"),
    ],
)
def test_bad_tiles_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tiles(**kwargs)


@pytest.mark.skipif(not interpreting(), reason="compiled kernels get tensor-core tiles")
def test_interpreter_tiles_follow_the_page_and_the_chunk() -> None:
    # Under the interpreter nothing is rounded up to tensor-core sizes.
    assert decode_tiles(block_size=4) == Tiles(block_n=4)
    assert prefill_tiles(max_q_len=9, block_size=4, dtype=torch.float16) == Tiles(
        block_n=4, block_m=16
    )
    assert prefill_tiles(max_q_len=1000, block_size=16, dtype=torch.float16).block_m == 64


def test_prefill_refuses_tiles_without_query_rows() -> None:
    case = make_case([3], block_size=4, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    query = torch.zeros(3, 1, 16, device=DEVICE)
    cu_q_lens = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    args = (query, case.k_cache, case.v_cache, case.block_tables, cu_q_lens, case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="block_m"):
        paged_prefill(*args, tiles=Tiles(block_n=16))
