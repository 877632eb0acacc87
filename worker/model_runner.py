"""Runs the model for one scheduled step: packs the batch, owns the paged KV cache."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvswitch.worker.attention import AttentionMetadata
from kvswitch.worker.cuda_graphs import DecodeGraphs, PrefillGraphs, SequenceGraphs
from kvswitch.worker.hidden_cache import HiddenStateCache
from kvswitch.worker.kv_transfer import allocate_shared_caches
from kvswitch.worker.lora import LoraSlots
from kvswitch.worker.model import CausalLM
from kvswitch.worker.step_inputs import InputStager


@dataclass(slots=True)
class StepBatch:
    """A step's sequences as arrays: sequence ``s`` computes ``num_new[s]`` tokens from
    position ``start_pos[s]``, and its pages are ``block_tables[s]``."""

    input_ids: np.ndarray  # int64 [num_new.sum()], the sequences' new tokens back to back
    start_pos: np.ndarray  # int64 [num_seqs]
    num_new: np.ndarray  # int64 [num_seqs], each >= 1
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks]
    # int64 [num_new.sum()]: each token's adapter slot (-1: the base model); None: no adapter
    lora_slots: np.ndarray | None = None


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
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        *,
        kv_cache_file: str | None = None,
        cuda_graphs: bool = False,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
    ) -> None:
        """``kv_cache_file``: put the KV cache in this new file of the host's shared memory
        (CPU only), where same-host peers copy blocks straight out of it. ``cuda_graphs``: run
        decode steps of up to ``max_num_seqs`` sequences from captured CUDA graphs; steps
        of up to ``max_num_batched_tokens`` tokens (at most 512) whole from graphs if they are
        one sequence's, else with all but attention replayed from graphs
        (worker/cuda_graphs.py)."""
        config = model.config
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._stager = InputStager(self.device)
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        if kv_cache_file is not None:
            self.kv_caches = allocate_shared_caches(
                kv_cache_file, config.num_layers, shape, param.dtype
            )
        else:
            self.kv_caches = [
                (
                    torch.zeros(shape, dtype=param.dtype, device=self.device),
                    torch.zeros(shape, dtype=param.dtype, device=self.device),
                )
                for _ in range(config.num_layers)
            ]
        self.graphs: DecodeGraphs | None = None
        # Every step's final hidden states are written here at their KV slots, when set.
        self.hidden_cache: HiddenStateCache | None = None
        self.loras: LoraSlots | None = None
        self._lora_tokens: torch.Tensor | None = None  # the running step's, while it has any
        self.prefill_graphs: PrefillGraphs | None = None
        self.sequence_graphs: SequenceGraphs | None = None
        if cuda_graphs:
            max_model_len = min(config.max_position_embeddings, num_blocks * block_size)
            self.graphs = DecodeGraphs(
                model,
                self.kv_caches,
                block_size=block_size,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
            )
            self.sequence_graphs = SequenceGraphs(
                model,
                self.kv_caches,
                block_size=block_size,
                max_model_len=max_model_len,
                max_num_tokens=max_num_batched_tokens,
            )
            self.prefill_graphs = PrefillGraphs(
                model, self.kv_caches, max_num_tokens=max_num_batched_tokens
            )

    def execute(self, seqs: Sequence[ScheduledSeq], *, every_token: bool = False) -> torch.Tensor:
        """Logits [num_seqs, vocab] (fp32) after each sequence's last new token; with
        ``every_token``, [num_new_tokens, vocab] after every new token (teacher forcing)."""
        if not seqs:
            raise ValueError("nothing to run")
        for seq in seqs:
            if not seq.token_ids:
                raise ValueError("a scheduled sequence must compute at least one token")
            end = seq.start_pos + len(seq.token_ids)
            if -(-end // self.block_size) > len(seq.block_ids):
                raise ValueError(f"{end} tokens need more than {len(seq.block_ids)} blocks")
        block_tables = np.zeros((len(seqs), max(len(s.block_ids) for s in seqs)), np.int32)
        for row, seq in enumerate(seqs):
            block_tables[row, : len(seq.block_ids)] = seq.block_ids
        batch = StepBatch(
            input_ids=np.fromiter(
                itertools.chain.from_iterable(s.token_ids for s in seqs), np.int64
            ),
            start_pos=np.array([s.start_pos for s in seqs], np.int64),
            num_new=np.array([len(s.token_ids) for s in seqs], np.int64),
            block_tables=block_tables,
        )
        return self.execute_batch(batch, every_token=every_token)

    def execute_batch(self, batch: StepBatch, *, every_token: bool = False) -> torch.Tensor:
        """``execute`` for a batch already in arrays (the engine's path): positions and slots
        are computed with numpy, and all inputs reach the device in one copy (``InputStager``).
        With ``cuda_graphs`` a decode step replays a graph instead (``DecodeGraphs``), one
        sequence's step of few enough tokens too (``SequenceGraphs``), and another such step
        replays all but attention (``PrefillGraphs``)."""
        return self._execute(batch, every_token, with_hidden=False)[0]

    def execute_batch_hidden(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``execute_batch``'s logits, and the step's final hidden states (after the last norm)
        of every token [num_tokens, hidden_size], on the device; never from CUDA graphs."""
        logits, hidden = self._execute(batch, False, with_hidden=True)
        assert hidden is not None
        return logits, hidden

    @torch.inference_mode()
    def _execute(
        self, batch: StepBatch, every_token: bool, with_hidden: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        num_new, start_pos = batch.num_new, batch.start_pos
        num_seqs = len(num_new)
        if num_seqs == 0:
            raise ValueError("nothing to run")
        if batch.lora_slots is not None:
            return self._execute_with_loras(batch, every_token, with_hidden)
        hidden_cache = self.hidden_cache
        with_hidden = with_hidden or hidden_cache is not None
        num_tokens = len(batch.input_ids)
        if num_tokens == num_seqs:  # all decodes: one token per sequence, at its start position
            # NOTE: the steady state; every numpy call here costs the step a few microseconds.
            token_seq = logit_rows = np.arange(num_seqs)
            positions = start_pos
            cu_q_lens = np.arange(num_seqs + 1, dtype=np.int32)
            max_q_len = 1
        else:
            cu_q_lens = np.zeros(num_seqs + 1, np.int64)
            np.cumsum(num_new, out=cu_q_lens[1:])
            token_seq = np.repeat(np.arange(num_seqs), num_new)
            positions = np.arange(num_tokens) + np.repeat(start_pos - cu_q_lens[:-1], num_new)
            logit_rows = cu_q_lens[1:] - 1
            max_q_len = int(num_new.max())
        if every_token:
            logit_rows = np.arange(num_tokens)
        seq_lens = (start_pos + num_new).astype(np.int32)
        pages, offsets = np.divmod(positions, self.block_size)
        slots = (batch.block_tables[token_seq, pages] * self.block_size + offsets).astype(np.int32)
        # NOTE: the graphs give logits only; a step that keeps hidden states runs plain.
        plain = every_token or with_hidden or self._lora_tokens is not None
        graphs = self.graphs
        if (
            max_q_len == 1
            and not plain
            and graphs is not None
            and graphs.can_run(num_seqs, batch.block_tables.shape[1])
        ):
            return graphs.run(batch.input_ids, positions, slots, seq_lens, batch.block_tables), None
        sequence_graphs = self.sequence_graphs
        if (
            not plain
            and num_seqs == 1
            and sequence_graphs is not None
            and sequence_graphs.can_run(num_tokens, batch.block_tables.shape[1])
        ):
            return sequence_graphs.run(
                batch.input_ids, positions, slots, int(seq_lens[0]), batch.block_tables[0]
            ), None
        host_slots = slots

        arrays = (
            batch.input_ids,
            np.asarray(positions, np.int64),
            slots,
            np.asarray(batch.block_tables, np.int32),
            cu_q_lens.astype(np.int32, copy=False),
            seq_lens,
            np.asarray(logit_rows, np.int64),
        )
        input_ids, positions, slots, block_tables, cu_q_lens, seq_lens_t, logit_rows = (
            self._stager.stage(arrays)
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=block_tables,
            cu_q_lens=cu_q_lens,
            seq_lens=seq_lens_t,
            max_q_len=max_q_len,
            max_seq_len=int(seq_lens.max()),
        )
        prefill_graphs = self.prefill_graphs
        if not plain and prefill_graphs is not None and prefill_graphs.can_run(num_tokens):
            return prefill_graphs.run(input_ids, positions, meta, logit_rows), None
        if not with_hidden:
            return self.model(input_ids, positions, self.kv_caches, meta, logit_rows), None
        hidden = self.model.model(input_ids, positions, self.kv_caches, meta)
        if hidden_cache is not None:
            hidden_cache.write(host_slots, hidden)
        return self.model.logits(hidden, logit_rows), hidden

    def attach_loras(self, slots: LoraSlots) -> None:
        """Serve adapters from ``slots``: a step whose batch names them adds each token's."""
        self.loras = slots
        self.model.attach_loras(slots)

    def _execute_with_loras(
        self, batch: StepBatch, every_token: bool, with_hidden: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step with adapters, on the plain path (the graphs are captured without them)."""
        if self.loras is None:
            raise ValueError("this runner serves no adapters")
        slots = batch.lora_slots
        if slots is None or len(slots) != len(batch.input_ids):
            raise ValueError("a step's lora_slots must give one slot per token")
        if (slots < 0).all():  # the base model alone: the usual paths
            return self._execute(_without_loras(batch), every_token, with_hidden)
        self._lora_tokens = torch.from_numpy(np.ascontiguousarray(slots, np.int64)).to(self.device)
        self.loras.begin_step(self._lora_tokens)
        try:
            return self._execute(_without_loras(batch), every_token, with_hidden)
        finally:
            self._lora_tokens = None
            self.loras.begin_step(None)


def _without_loras(batch: StepBatch) -> StepBatch:
    return StepBatch(batch.input_ids, batch.start_pos, batch.num_new, batch.block_tables)
