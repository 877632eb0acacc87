"""Runs the model for one scheduled step: packs the batch, owns the paged KV cache."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvswitch.worker.attention import AttentionMetadata
from kvswitch.worker.model import CausalLM


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: compute ``token_ids``, which sit at positions
    ``start_pos ..`` of a context whose pages are ``block_ids``."""

    token_ids: Sequence[int]
    start_pos: int
    block_ids: Sequence[int]


def kv_cache_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return model.config.kv_bytes_per_token * block_size * element_size


def num_blocks_for_budget(
    model: CausalLM, block_size: int, dtype: torch.dtype, kv_cache_bytes: int
) -> int:
    """How many KV blocks fit in ``kv_cache_bytes``; at least one, or a clear error."""
    per_block = kv_cache_bytes_per_block(model, block_size, dtype)
    num_blocks = kv_cache_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"a KV cache budget of {kv_cache_bytes:,} bytes holds no block of {per_block:,} bytes"
        )
    return num_blocks


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int) -> None:
        config = model.config
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=param.dtype, device=self.device),
                torch.zeros(shape, dtype=param.dtype, device=self.device),
            )
            for _ in range(config.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, seqs: Sequence[ScheduledSeq], *, every_token: bool = False) -> torch.Tensor:
        """Logits [num_seqs, vocab] (fp32) after each sequence's last new token; with
        ``every_token``, [num_new_tokens, vocab] after every new token (teacher forcing)."""
        if not seqs:
            raise ValueError("nothing to run")
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_q_lens = [0]
        seq_lens = []
        for seq in seqs:
            num_new = len(seq.token_ids)
            if num_new == 0:
                raise ValueError("a scheduled sequence must compute at least one token")
            end = seq.start_pos + num_new
            if -(-end // block_size) > len(seq.block_ids):
                raise ValueError(f"{end} tokens need more than {len(seq.block_ids)} blocks")
            input_ids.extend(seq.token_ids)
            for pos in range(seq.start_pos, end):
                positions.append(pos)
                slots.append(seq.block_ids[pos // block_size] * block_size + pos % block_size)
            cu_q_lens.append(cu_q_lens[-1] + num_new)
            seq_lens.append(end)
        max_blocks = max(len(seq.block_ids) for seq in seqs)
        block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            block_tables[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)

        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device),
            cu_q_lens=torch.tensor(cu_q_lens, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            max_q_len=max(b - a for a, b in itertools.pairwise(cu_q_lens)),
            max_seq_len=max(seq_lens),
        )
        if every_token:
            logit_rows = torch.arange(len(input_ids), device=device)
        else:
            logit_rows = torch.tensor(cu_q_lens[1:], device=device) - 1
        return self.model(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            self.kv_caches,
            meta,
            logit_rows,
        )
