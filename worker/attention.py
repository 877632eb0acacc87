"""Paged attention for the model: one switch between the Triton kernels and the torch references.

The model calls ``PagedAttention.forward`` per layer; the step's ``AttentionMetadata`` says where
each new token's K/V goes and which pages each sequence reads. The kernels run on CUDA tensors;
everything else (CPU) takes the pure-torch references, with identical semantics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvswitch.kernels import reference


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch, as attention sees it::

    query rows   | seq 0 new tokens | seq 1 new tokens | ...   (cu_q_lens marks the boundaries)
    context      | seq s: seq_lens[s] tokens, the last q_len of them new; pages in block_tables[s]
    """

    slot_mapping: torch.Tensor  # int32 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    cu_q_lens: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    max_q_len: int
    max_seq_len: int

    @property
    def is_decode_only(self) -> bool:
        return self.max_q_len == 1


def use_triton(device: torch.device) -> bool:
    return device.type == "cuda"


class PagedAttention:
    """Stores a layer's new K/V into its pages, then attends over each sequence's pages."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [num_tokens, num_q_heads, head_dim], key/value [num_tokens, num_kv_heads,
        head_dim] -> [num_tokens, num_q_heads, head_dim], written into ``out`` if given."""
        store(key, value, k_cache, v_cache, meta.slot_mapping)
        return self.attend(query, k_cache, v_cache, meta, out)

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
        splits: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``forward`` once the step's K/V are stored. ``splits``: ``(partial, lse)`` buffers
        (``kernels.paged_prefill``'s): on CUDA the kernel leaves each query's context splits
        there and ``out`` is written later, by ``merge_splits`` (from a CUDA graph); elsewhere
        ``out`` is written at once."""
        tables, seq_lens = meta.block_tables, meta.seq_lens
        if use_triton(query.device):
            from kvswitch.kernels import paged_decode, paged_prefill

            # NOTE: with splits even decodes take the prefill kernel (a query of one token):
            # the merge that finishes them is already captured.
            if meta.is_decode_only and splits is None:
                return paged_decode(
                    query,
                    k_cache,
                    v_cache,
                    tables,
                    seq_lens,
                    self.scale,
                    max_seq_len=meta.max_seq_len,
                    out=out,
                )
            return paged_prefill(
                query,
                k_cache,
                v_cache,
                tables,
                meta.cu_q_lens,
                seq_lens,
                self.scale,
                max_q_len=meta.max_q_len,
                max_seq_len=meta.max_seq_len,
                out=out,
                splits=splits,
            )
        if meta.is_decode_only:
            result = reference.paged_decode_ref(
                query, k_cache, v_cache, tables, seq_lens, self.scale
            )
        else:
            result = reference.paged_prefill_ref(
                query, k_cache, v_cache, tables, meta.cu_q_lens, seq_lens, self.scale
            )
        return result if out is None else out.copy_(result)


def store(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each row's K/V into its slot of the caches; rows with slot -1 write nothing."""
    if use_triton(key.device):
        from kvswitch.kernels import store_kv

        store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def merge_splits(out: torch.Tensor, splits: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Finish into ``out`` an ``attend`` given ``splits``: on CUDA merge them; elsewhere
    ``attend`` wrote ``out`` itself."""
    if use_triton(out.device):
        from kvswitch.kernels.paged_decode import merge_splits as merge

        merge(*splits, out)
