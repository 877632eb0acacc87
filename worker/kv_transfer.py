"""Cached KV blocks as bytes: read out of one engine's paged cache, written into another's.

A block travels as raw bytes, no per-element encoding: for each layer, its key block then its
value block, each ``[block_size, num_kv_heads, head_dim]`` in C order, in the cache's dtype::

    block 0: | layer 0 key | layer 0 value | layer 1 key | ... | layer L-1 value |
    block 1: | ...

``KVLayout`` (``kv_layout``) names that shape; two engines exchange blocks only when their
layouts are equal (same model, block size and dtype), which the receiver checks before it writes
anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvswitch.worker.kv_layout import KVLayout

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer: key, value [blocks, ...]


def layout_of(kv_caches: KVCaches) -> KVLayout:
    key = kv_caches[0][0]
    _, block_size, num_kv_heads, head_dim = key.shape
    dtype = str(key.dtype).removeprefix("torch.")
    return KVLayout(len(kv_caches), block_size, num_kv_heads, head_dim, dtype)


def read_blocks(kv_caches: KVCaches, block_ids: Sequence[int]) -> bytes:
    """The KV of ``block_ids``, in that order, as bytes (layout above)."""
    if not block_ids:
        return b""
    device = kv_caches[0][0].device
    index = torch.tensor(block_ids, device=device)
    # [blocks, layers, 2, block_size, heads, dim], gathered on the device, then one copy out.
    blocks = torch.stack(
        [torch.stack((key[index], value[index]), dim=1) for key, value in kv_caches], dim=1
    )
    return blocks.cpu().view(torch.uint8).numpy().tobytes()


def write_blocks(kv_caches: KVCaches, block_ids: Sequence[int], data: bytes) -> None:
    """Write bytes from ``read_blocks`` (of the same layout) into ``block_ids``."""
    layout = layout_of(kv_caches)
    if len(data) != len(block_ids) * layout.bytes_per_block:
        raise ValueError(
            f"{len(data):,} bytes for {len(block_ids)} blocks of {layout.bytes_per_block:,} bytes"
        )
    if not block_ids:
        return
    key = kv_caches[0][0]
    shape = (len(block_ids), layout.num_layers, 2, *key.shape[1:])
    # NOTE: bytearray, so that torch gets a writable buffer it may view without a copy.
    blocks = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(key.dtype).view(shape)
    blocks = blocks.to(key.device)
    index = torch.tensor(block_ids, device=key.device)
    for layer, (key_cache, value_cache) in enumerate(kv_caches):
        key_cache.index_copy_(0, index, blocks[:, layer, 0])
        value_cache.index_copy_(0, index, blocks[:, layer, 1])
