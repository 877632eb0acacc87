"""A process holding a KV cache of known bytes behind a NIXL agent, for tests that read it from
another process. Run as ``python tests/worker/nixl_holder.py NAME SEED LAYOUT_JSON NUM_BLOCKS``:
it prints its peer info (one line of JSON) and holds the cache until its stdin closes."""

from __future__ import annotations

import json
import sys

import torch

from kvswitch.worker.kv_layout import KVLayout
from kvswitch.worker.nixl_kv import NixlKVAgent


def filled_caches(layout: KVLayout, num_blocks: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (key, value), random bits from ``seed``: the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    dtype = getattr(torch, layout.dtype)
    assert torch.empty((), dtype=dtype).element_size() == 2, "16-bit dtypes only"

    def tensor() -> torch.Tensor:
        bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator)
        return bits.view(dtype)

    return [(tensor(), tensor()) for _ in range(layout.num_layers)]


def main() -> None:
    name, seed, layout_json, num_blocks = sys.argv[1:]
    caches = filled_caches(KVLayout(**json.loads(layout_json)), int(num_blocks), int(seed))
    with NixlKVAgent(caches, name=name) as agent:
        print(agent.peer_info().to_bytes().decode(), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
