"""``kvswitch bench hash``: block-hashing throughput on one long prompt, on one core, for each
way to name blocks: xxh3 (unkeyed) and blake2b-keyed (a fleet with a fleet token)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvswitch.benchmarks.timing import machine_info, rate_per_s
from kvswitch.cache_index.hashing import XXH3_NAMING, BlockNaming, hash_prompt_blocks

# NOTE: any key will do: BLAKE2b's speed does not depend on the key's bytes.
BENCH_NAMING = {
    "xxh3": XXH3_NAMING,
    "blake2b_keyed": BlockNaming.from_fleet_token("bench-fleet-token"),
}


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


def run(config: HashBenchConfig) -> dict[str, float | int | dict]:
    rng = np.random.default_rng(config.seed)
    tokens = rng.integers(0, 152_000, config.num_tokens, dtype=np.uint32)
    token_list = tokens.tolist()
    figures: dict[str, float | int | dict] = {}
    for name, naming in BENCH_NAMING.items():

        def hash_array(naming: BlockNaming = naming) -> int:
            hash_prompt_blocks(tokens, config.block_size, "bench-model", naming=naming)
            return config.num_tokens

        def hash_list(naming: BlockNaming = naming) -> int:
            hash_prompt_blocks(token_list, config.block_size, "bench-model", naming=naming)
            return config.num_tokens

        from_array = rate_per_s(
            hash_array, duration_s=config.duration_s, label=f"{name}, numpy uint32 input"
        )
        from_list = rate_per_s(hash_list, duration_s=config.duration_s, label=f"{name}, list input")
        # NOTE: xxh3's figures keep their first names (tokens_per_s), as recorded before.
        suffix = "" if name == "xxh3" else f"_{name}"
        figures[f"tokens_per_s{suffix}"] = from_array["median_per_s"]
        figures[f"tokens_per_s{suffix}_list_input"] = from_list["median_per_s"]
        figures[f"blocks_per_s_{name}"] = from_array["median_per_s"] / config.block_size
    return {
        **figures,
        "num_tokens": config.num_tokens,
        "machine": machine_info(),
        "block_size": config.block_size,
    }
