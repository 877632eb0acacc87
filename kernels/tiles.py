"""How the attention kernels cut their work, and the defaults the launchers pick.

A program walks its context ``block_n`` tokens at a time; a prefill program owns ``block_m``
query rows (a decode program owns the query heads of one KV head instead). ``num_warps`` and
``num_stages`` (how many K/V tiles the loop keeps in flight) go to the compiler.

Under Triton's CPU interpreter tiles stay small, since every element costs Python time there.
Compiled, every default must pass ``kvswitch kernels compile`` (no spills, 16-byte K/V copies,
tensor-core dots); ``kvswitch bench kernels --sweep`` times the alternatives on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvswitch.kernels.layout import interpreting, min_dot_size, next_pow2


@dataclass(frozen=True, slots=True)
class Tiles:
    block_n: int
    block_m: int = 0  # prefill only
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_m"):
            value = getattr(self, name)
            if value < 0 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.block_n == 0:
            raise ValueError("block_n must be positive")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(
                f"num_warps must be a power of two up to 16 and num_stages >= 1, got "
                f"{self.num_warps} and {self.num_stages}"
            )


def decode_tiles(block_size: int) -> Tiles:
    """paged_decode's tiles for this page size (every dtype alike)."""
    if interpreting():
        return Tiles(block_n=max(min_dot_size(), min(64, next_pow2(block_size))))
    # Measured on an H100 (docs/BENCHMARKS.md, `bench kernels --sweep`): 64-token tiles (several
    # pages each) in two stages read K/V at 2.8 TB/s; one page per tile in three stages, 2.1.
    return Tiles(block_n=64, num_stages=2)


def prefill_tiles(max_q_len: int, block_size: int, dtype: torch.dtype) -> Tiles:
    """paged_prefill's tiles for a batch whose longest sequence has ``max_q_len`` new tokens."""
    block_m = min(64, next_pow2(max_q_len))
    if interpreting() or dtype == torch.float32:
        # NOTE: fp32 dots run on FMA units, not tensor cores; larger tiles only add registers.
        return Tiles(
            block_n=max(min_dot_size(), min(64, next_pow2(block_size))),
            block_m=max(min_dot_size(), block_m),
        )
    # Wide key tiles feed the tensor cores wide dots and rescale the accumulator once per tile; a
    # long prompt gets 128-query tiles over two warp groups (8 warps). Measured on an H100
    # (`bench kernels --sweep`): 128x128 tiles 305 TFLOP/s, 128x64 265, 64x64 294 (two stages).
    if max_q_len >= 128:
        return Tiles(block_n=128, block_m=128, num_warps=8, num_stages=2)
    return Tiles(block_n=64, block_m=max(min_dot_size(), block_m), num_stages=2)
