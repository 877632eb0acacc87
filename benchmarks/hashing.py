"""``kvswitch bench hash``: block-hashing throughput on one long prompt, on one core."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvswitch.benchmarks.timing import machine_info, rate_per_s
from kvswitch.cache_index.hashing import hash_prompt_blocks


@dataclass(frozen=True)
class HashBenchConfig:
    num_tokens: int = 8192
    block_size: int = 16
    duration_s: float = 3.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens < self.block_size:
            raise ValueError("num_tokens must hold at least one full block")
        if self.duration_s <= 0:
            raise ValueError("duration_s must be positive")


def run(config: HashBenchConfig) -> dict[str, float | int]:
    rng = np.random.default_rng(config.seed)
    tokens = rng.integers(0, 152_000, config.num_tokens, dtype=np.uint32)
    token_list = tokens.tolist()

    def hash_array() -> int:
        hash_prompt_blocks(tokens, config.block_size, "bench-model")
        return config.num_tokens

    def hash_list() -> int:
        hash_prompt_blocks(token_list, config.block_size, "bench-model")
        return config.num_tokens

    from_array = rate_per_s(hash_array, duration_s=config.duration_s, label="numpy uint32 input")
    from_list = rate_per_s(hash_list, duration_s=config.duration_s, label="list input")
    return {
        "tokens_per_s": from_array["median_per_s"],
        "tokens_per_s_list_input": from_list["median_per_s"],
        "num_tokens": config.num_tokens,
        "machine": machine_info(),
        "block_size": config.block_size,
    }
