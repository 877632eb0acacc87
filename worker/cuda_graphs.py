"""Steps replayed from CUDA graphs: decode steps and one sequence's steps whole, other steps
piecewise around attention.

A decode step launches the same few hundred kernels every time, each costing the host several
microseconds to issue; for a small model the host, not the GPU, sets how long the step takes. A
CUDA graph records the launches of one forward pass once and replays them all with one call. Its
kernels read and write fixed addresses and fixed shapes, so:

- the graph's inputs live in static buffers that each step fills (one upload and one copy of the
  block tables) before the replay;
- there is one graph per batch size in ``capture_sizes``: a step of ``n`` decodes replays the
  smallest graph of at least ``n`` rows, the rows past ``n`` padding::

      row        | 0 .. n-1: the step's decodes   | n .. size-1: padding                       |
      input id   | the sequence's last token      | 0                                          |
      position   | its context length - 1         | 0                                          |
      slot       | where its K/V goes             | -1: store_kv skips it, nothing is written  |
      seq_len    | its context length             | 1: one row of a block the stale table names |

- attention is launched for contexts up to ``max_model_len``: as many splits as the longest
  context would take. Each sequence spreads its own context over them, so a short one is still
  attended in parallel, and its splits past its last tile are empty and weigh nothing in the
  merge.

All graphs share one memory pool and write their logits into one buffer, so a replay's logits
stay valid until the next replay: the engine samples them before its next step.

A step of one sequence's new tokens (a prompt's uncached tail, a chunk) is whole too
(``SequenceGraphs``): with one sequence, attention's launch depends on the token count alone.
A step with several new tokens for some sequence among others (chunks side by side, decodes
beside a chunk) has a shape graphs cannot fix: its attention launch depends on how the tokens
fall into sequences. ``PrefillGraphs`` captures everything else, per token count in
``prefill_capture_sizes``: one graph for each stretch of the forward between two attentions
(the embedding and layer 0 up to attention; a layer's output projection, MLP and the next
layer's input up to attention; the last layer's rest and the final norm), the way vLLM's
piecewise graphs do. Attention runs eagerly between the replays on the step's first rows::

    replay 0 | attention 0 | replay 1 | attention 1 | ... | replay L | logits of the step's rows

Off CUDA (``capture=False``) the same buffers and padding run the model eagerly, so that the tests
check the padding on a CPU; the GPU check (benchmarks/gpu_check.sh) checks the graphs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from kvswitch.worker.attention import AttentionMetadata, merge_splits, store, use_triton
from kvswitch.worker.model import CausalLM
from kvswitch.worker.model_config import ModelConfig
from kvswitch.worker.step_inputs import UploadBuffer, aligned

logger = logging.getLogger(__name__)


# The largest step a prefill graph takes: past it the device's work, not the launches, sets the
# step's time (a 4,096-token prompt of a 1B model: 26 ms of device time against 5 of launches).
MAX_PREFILL_GRAPH_TOKENS = 512
# Multiprocessors the memory estimate assumes, before any device is asked: an H100's or H200's.
_NUM_SMS = 132


def prefill_capture_sizes(max_num_tokens: int) -> list[int]:
    """The token counts to capture stretches for: 16, 32, 64, ... up to ``max_num_tokens`` or
    ``MAX_PREFILL_GRAPH_TOKENS``, whichever is smaller (a step pads to the next one)."""
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
    largest = min(max_num_tokens, MAX_PREFILL_GRAPH_TOKENS)
    sizes = [size for size in (16 << i for i in range(6)) if size < largest]
    return [*sizes, largest]


def graph_memory_bytes(
    config: ModelConfig,
    element_size: int,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    block_size: int,
) -> int:
    """The device memory the graphs of ``DecodeGraphs``, ``PrefillGraphs`` and
    ``SequenceGraphs`` will hold,
    estimated before the KV cache is sized (they are captured after it): the static inputs and
    outputs each keeps, and one forward's temporaries at the largest size in their shared
    pools, plus a tenth for the allocator's rounding (random:llama-1b on an H200 took 292 MiB
    where 287 were counted without that tenth and the split buffers; 351 now). The engine logs
    it beside what capture took."""
    hidden, attention = config.hidden_size, (config.num_q_heads + 2 * config.num_kv_heads)
    per_row = (2 * hidden + attention * config.head_dim + 3 * config.intermediate_size) * (
        element_size
    )
    vocab_row = config.vocab_size * (element_size + 4)  # the head's output, then in fp32

    def forward_bytes(rows: int) -> int:
        return rows * (per_row + vocab_row)

    max_blocks = -(-max_model_len // block_size)
    decode = max_num_seqs * (24 + 8 * max_blocks + 4 * config.vocab_size)
    decode += forward_bytes(max_num_seqs)
    # Decode attention's splits: at most 4 programs per multiprocessor's worth.
    decode += 4 * _NUM_SMS * config.num_q_heads // max(config.num_kv_heads, 1) * config.head_dim * 4
    sizes = prefill_capture_sizes(max_num_batched_tokens)
    held_per_row = config.num_layers * (attention * config.head_dim + hidden) * element_size
    held_per_row += (2 * hidden + config.num_q_heads * config.head_dim) * element_size + 16
    # Attention's context splits (fp32), as many as one sequence's query heads need to fill the
    # multiprocessors.
    splits = max(1, _NUM_SMS // config.num_q_heads)
    split_bytes_per_row = config.num_q_heads * splits * (config.head_dim + 1) * 4
    held_per_row += split_bytes_per_row
    # (The head runs outside the stretches, on the step's logit rows only.)
    prefill = sum(sizes) * held_per_row + sizes[-1] * per_row
    # One sequence's whole forward: its inputs and block table, one forward's temporaries and
    # splits at the largest size (in a pool of their own), the head on one row.
    sequence = sizes[-1] * (20 + per_row + split_bytes_per_row) + 4 * max_blocks + vocab_row
    return (decode + prefill + sequence) * 11 // 10


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, then every multiple of 8, up to ``max_num_seqs``
    (always included). A step pads to the next one, at most 7 rows."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in (1, 2, 4) if s < max_num_seqs}
    sizes.update(range(8, max_num_seqs, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class DecodeGraphs:
    """Runs decode-only steps of up to ``max_num_seqs`` sequences from captured graphs."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        capture: bool = True,
    ) -> None:
        device = _graph_device(model, capture)
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.sizes = capture_sizes(max_num_seqs)
        self._padded = [next(s for s in self.sizes if s >= n) for n in range(max_num_seqs + 1)]
        rows, self.max_blocks = max_num_seqs, -(-max_model_len // block_size)
        # The per-row inputs, laid out once; each step writes them on the host side and uploads
        # them whole (24 bytes a row), with its block tables behind them.
        layout = [
            ("input_ids", np.int64, rows, 0),
            ("positions", np.int64, rows, 0),
            ("slot_mapping", np.int32, rows, -1),
            ("seq_lens", np.int32, rows, 1),
            ("block_tables", np.int32, rows * self.max_blocks, 0),
        ]
        self._upload, host, device_views, offsets = _static_inputs(device, layout)
        self._tables_offset = offsets["block_tables"]
        # (host view, padding value) of the per-row fields
        self._fields = [(host[name], pad) for name, _, _, pad in layout[:-1]]
        self.input_ids = device_views["input_ids"]
        self.positions = device_views["positions"]
        self.slot_mapping = device_views["slot_mapping"]
        self.seq_lens = device_views["seq_lens"]
        self.block_tables = torch.zeros((rows, self.max_blocks), dtype=torch.int32, device=device)
        self.cu_q_lens = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.logit_rows = torch.arange(rows, dtype=torch.int64, device=device)
        self.logits = torch.zeros(
            (rows, model.config.vocab_size), dtype=torch.float32, device=device
        )
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture()

    def can_run(self, num_seqs: int, num_blocks: int) -> bool:
        """Whether a step of ``num_seqs`` decodes, the longest with ``num_blocks`` blocks, fits
        the graphs."""
        return 0 < num_seqs <= self.max_num_seqs and num_blocks <= self.max_blocks

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> torch.Tensor:
        """Logits [num_seqs, vocab] (fp32) of one decode step: sequence ``s`` has token
        ``input_ids[s]`` at ``positions[s]``, its K/V goes to ``slot_mapping[s]``, and its
        ``seq_lens[s]``-token context is in the pages ``block_tables[s]``. The tensor is the
        graph's own output: valid until the next ``run``."""
        num_seqs = len(input_ids)
        num_rows, width = block_tables.shape
        if num_rows != num_seqs or not self.can_run(num_seqs, width):
            raise ValueError(
                f"{num_seqs} sequences of {num_rows} x {width} block tables: the graphs take 1 "
                f"to {self.max_num_seqs} sequences of at most {self.max_blocks} blocks"
            )
        size = self._padded[num_seqs]
        upload = self._upload
        upload.wait_writable()
        for (host, pad), values in zip(
            self._fields, (input_ids, positions, slot_mapping, seq_lens), strict=True
        ):
            host[:num_seqs] = values
            host[num_seqs:size] = pad
        tables = upload.host_view(self._tables_offset, np.int32, (num_rows, width))
        tables[...] = block_tables
        upload.upload(self._tables_offset + tables.nbytes)
        # NOTE: rows past num_seqs keep whatever ids they held: valid blocks, which the padding
        # rows' one-token contexts may read and nothing else does.
        self.block_tables[:num_rows, :width].copy_(
            upload.device_view(self._tables_offset, np.int32, (num_rows, width))
        )
        return self.replay(size)[:num_seqs]

    def replay(self, size: int) -> torch.Tensor:
        """Run the forward of ``size`` rows on the static inputs: the graph's replay, or the
        model itself where nothing was captured."""
        graph = self._graphs.get(size)
        if graph is None:
            self._forward(size)
        else:
            graph.replay()
        return self.logits[:size]

    @torch.inference_mode()
    def _forward(self, size: int) -> None:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            cu_q_lens=self.cu_q_lens[: size + 1],
            seq_lens=self.seq_lens[:size],
            max_q_len=1,
            max_seq_len=self.max_model_len,
        )
        # NOTE: copied into the one buffer, so that the logits of every size, fp32 and
        # vocabulary-wide (2 GiB in all at 256 sequences and 128K tokens), are not each kept.
        self.logits[:size].copy_(
            self.model(
                self.input_ids[:size],
                self.positions[:size],
                self.kv_caches,
                meta,
                self.logit_rows[:size],
            )
        )

    def _capture(self) -> None:
        """Capture every size, largest first (the pool then fits the smaller ones). The inputs
        are all padding meanwhile: nothing is written to the KV cache."""
        start = time.perf_counter()
        # NOTE: on the model's device, whichever is current: Triton launches on the current one.
        with torch.cuda.device(self.block_tables.device):
            self._capture_all()
        logger.info(
            "captured %d decode graphs (batch %d to %d) in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._graphs[size] = capture_graph(functools.partial(self._forward, size), pool)
        torch.cuda.synchronize()


def _static_inputs(
    device: torch.device, layout: list[tuple[str, type, int, int]]
) -> tuple[UploadBuffer, dict[str, np.ndarray], dict[str, torch.Tensor], dict[str, int]]:
    """One upload buffer holding the graphs' static inputs, ``layout`` being (name, dtype,
    entries, padding) each, back to back: the buffer, each input's host and device views
    (filled with its padding and uploaded once), and each one's offset."""
    upload = UploadBuffer(device, sum(aligned(n * np.dtype(t).itemsize) for _, t, n, _ in layout))
    host, device_views, offsets, offset = {}, {}, {}, 0
    for name, dtype, entries, pad in layout:
        offsets[name] = offset
        host[name] = upload.host_view(offset, dtype, (entries,))
        host[name][...] = pad
        device_views[name] = upload.device_view(offset, dtype, (entries,))
        offset += aligned(entries * np.dtype(dtype).itemsize)
    upload.upload(offset)
    return upload, host, device_views, offsets


def _graph_device(model: CausalLM, capture: bool) -> torch.device:
    device = next(model.parameters()).device
    if capture and device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device; the model is on {device}")
    return device


def capture_graph(run: Callable[[], object], pool: tuple[int, int]) -> torch.cuda.CUDAGraph:
    """``run``'s launches as a graph in ``pool``, after one run outside any capture: Triton
    compiles a kernel on its first launch, and cuBLAS sets up its workspace, neither of which a
    capture may do."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph


class _Stretches:
    """The stretches of one token count's forward, between attentions, each with the static
    tensors it reads and writes: stretch ``i`` (layer ``i`` up to attention) stores the rows' K/V
    at ``slot_mapping`` (-1 for padding rows: nothing) and leaves ``qkv[i]`` and ``residual[i]``;
    ``attended`` is read by the next, ``hidden`` comes out of the last."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        size: int,
        num_splits: int,
        device: torch.device,
    ) -> None:
        config = model.config
        self.model = model
        self.kv_caches = kv_caches
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int32, device=device)
        self.num_slots_set = 0  # leading rows of slot_mapping that may not be -1
        dtype = next(model.parameters()).dtype
        self.attended = torch.zeros(
            (size, config.num_q_heads, config.head_dim), dtype=dtype, device=device
        )
        # Attention's context splits, merged into ``attended`` at the start of the next stretch.
        self.splits: tuple[torch.Tensor, torch.Tensor] | None = None
        if num_splits > 1:
            rows = (size, config.num_q_heads, num_splits)
            self.splits = (
                torch.zeros((*rows, config.head_dim), dtype=torch.float32, device=device),
                torch.zeros(rows, dtype=torch.float32, device=device),
            )
        num_layers = len(model.model.layers)
        self.qkv: list[tuple[torch.Tensor, ...]] = [()] * num_layers
        self.residual: list[torch.Tensor] = [self.attended] * num_layers
        self.hidden = self.attended
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def run(self, index: int) -> None:
        """Stretch ``index`` (0 .. num_layers) eagerly, or as captured when there are graphs."""
        if self.graphs:
            self.graphs[index].replay()
            return
        decoder = self.model.model
        layers = decoder.layers
        if index > 0 and self.splits is not None:
            merge_splits(self.attended, self.splits)
        if index == 0:
            x, residual = decoder.embed_tokens(self.input_ids), None
        else:
            x, residual = layers[index - 1].attention_output(
                self.attended, self.residual[index - 1]
            )
        if index == len(layers):
            self.hidden = decoder.final_norm(x, residual)
            return
        q, k, v, residual = layers[index].attention_inputs(
            x, residual, self.positions, decoder.rotary
        )
        store(k, v, *self.kv_caches[index], self.slot_mapping)
        self.qkv[index], self.residual[index] = (q, k, v), residual

    def capture(self, pool: tuple[int, int]) -> None:
        # NOTE: each stretch's first run reads the outputs of the one captured before it,
        # which hold nothing yet: it writes only its own outputs, which its capture replaces.
        self.graphs = [
            capture_graph(functools.partial(self.run, index), pool)
            for index in range(len(self.model.model.layers) + 1)
        ]


def _one_sequence_splits(
    model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], size: int
) -> int:
    """paged_prefill's splits for one sequence of ``size`` new tokens over the longest context
    the cache holds; 1 off CUDA (the torch reference does not split)."""
    k_cache = kv_caches[0][0] if kv_caches else None
    if k_cache is None or not use_triton(k_cache.device):
        return 1
    from kvswitch.kernels.paged_decode import num_sms
    from kvswitch.kernels.paged_prefill import choose_prefill_splits
    from kvswitch.kernels.tiles import prefill_tiles

    num_blocks, block_size = k_cache.shape[:2]
    tiles = prefill_tiles(size, block_size, k_cache.dtype)
    num_programs = model.config.num_q_heads * -(-size // tiles.block_m)
    max_prefix = num_blocks * block_size - size
    return choose_prefill_splits(num_programs, max_prefix, tiles.block_n, num_sms(k_cache.device))


class PrefillGraphs:
    """Runs steps of up to ``max_num_tokens`` new tokens with every part of the forward but
    attention replayed from graphs (see the module's doc)."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_num_tokens: int,
        capture: bool = True,
        num_splits: int | None = None,
    ) -> None:
        """``num_splits``: how many programs attention cuts each query tile's context into, the
        same for every step of a token count (the merge is captured); by default as many as
        fill the device when the step is one sequence (``kernels.paged_prefill``'s choice)."""
        device = _graph_device(model, capture)
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = prefill_capture_sizes(max_num_tokens)
        self._stretches = {
            size: _Stretches(
                model,
                kv_caches,
                size,
                num_splits or _one_sequence_splits(model, kv_caches, size),
                device,
            )
            for size in self.sizes
        }
        if capture:
            start = time.perf_counter()
            with torch.cuda.device(device), torch.inference_mode():
                pool = torch.cuda.graph_pool_handle()
                for size in reversed(self.sizes):
                    self._stretches[size].capture(pool)
                torch.cuda.synchronize()
            logger.info(
                "captured prefill graphs for %d to %d tokens (%d stretches each) in %.1f s",
                self.sizes[0],
                self.sizes[-1],
                len(model.model.layers) + 1,
                time.perf_counter() - start,
            )

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.sizes[-1]

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """The model's forward of one step (its inputs already on the device): logits [rows,
        vocab] (fp32) of ``logit_rows``."""
        num_tokens = input_ids.shape[0]
        if not self.can_run(num_tokens):
            raise ValueError(
                f"a step of {num_tokens} tokens: the graphs take 1 to {self.sizes[-1]}"
            )
        size = next(s for s in self.sizes if s >= num_tokens)
        stretches = self._stretches[size]
        # NOTE: rows past num_tokens keep the ids and positions of an earlier step: they are
        # computed and thrown away (their slot is -1), and attention, which alone mixes rows,
        # never sees them.
        stretches.input_ids[:num_tokens].copy_(input_ids)
        stretches.positions[:num_tokens].copy_(positions)
        stretches.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        if stretches.num_slots_set > num_tokens:
            stretches.slot_mapping[num_tokens : stretches.num_slots_set] = -1
        stretches.num_slots_set = num_tokens
        layers = self.model.model.layers
        attended = stretches.attended[:num_tokens]
        splits = stretches.splits
        if splits is not None:
            splits = (splits[0][:num_tokens], splits[1][:num_tokens])
        for index, (layer, (k_cache, v_cache)) in enumerate(
            zip(layers, self.kv_caches, strict=True)
        ):
            stretches.run(index)
            query = stretches.qkv[index][0][:num_tokens]
            layer.self_attn.attn.attend(query, k_cache, v_cache, meta, attended, splits)
        stretches.run(len(layers))
        return self.model.logits(stretches.hidden, logit_rows)


class SequenceGraphs:
    """Runs steps of one sequence's new tokens (a prompt, a prompt's uncached tail, a chunk of
    one) whole from graphs, attention included, per token count in ``prefill_capture_sizes``.

    With one sequence the attention launch no longer depends on how the tokens fall into
    sequences: its grid is fixed by the token count (query tiles of ``size`` rows, one
    sequence) and by ``max_model_len`` (the context splits), and the kernel reads where the
    sequence's rows end and how long its context is from the static inputs. So the whole
    forward, the LM head on the sequence's last row included, is one replay::

        row        | 0 .. n-1: the step's tokens     | n .. size-1: padding                  |
        slot       | where each one's K/V goes       | -1: nothing written                   |
        query      | attends its context causally    | in no sequence: attends nothing, and  |
                   |                                 | its row is thrown away                |

    Each step's inputs reach the device in one upload (the block table with them). Off CUDA
    (``capture=False``) the same buffers and padding run the model eagerly.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        block_size: int,
        max_model_len: int,
        max_num_tokens: int,
        capture: bool = True,
    ) -> None:
        device = _graph_device(model, capture)
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = prefill_capture_sizes(max_num_tokens)
        rows, self.max_blocks = self.sizes[-1], -(-max_model_len // block_size)
        # (name, dtype, entries, padding): the per-row inputs, then the sequence's, then its
        # block table, which is uploaded only as far as the step's is wide.
        layout = [
            ("input_ids", np.int64, rows, 0),
            ("positions", np.int64, rows, 0),
            ("slot_mapping", np.int32, rows, -1),
            ("cu_q_lens", np.int32, 2, 0),
            ("seq_lens", np.int32, 1, 1),
            ("logit_rows", np.int64, 1, 0),
            ("block_tables", np.int32, self.max_blocks, 0),
        ]
        self._upload, self._host, self.static, offsets = _static_inputs(device, layout)
        self._tables_offset = offsets["block_tables"]
        self.logits = torch.zeros((1, model.config.vocab_size), dtype=torch.float32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            start = time.perf_counter()
            with torch.cuda.device(device):
                pool = torch.cuda.graph_pool_handle()
                for size in reversed(self.sizes):
                    self._graphs[size] = capture_graph(functools.partial(self._forward, size), pool)
                torch.cuda.synchronize()
            logger.info(
                "captured one-sequence graphs for %d to %d tokens in %.1f s",
                self.sizes[0],
                self.sizes[-1],
                time.perf_counter() - start,
            )

    def can_run(self, num_tokens: int, num_blocks: int) -> bool:
        """Whether one sequence's step of ``num_tokens`` over ``num_blocks`` pages fits."""
        return 0 < num_tokens <= self.sizes[-1] and num_blocks <= self.max_blocks

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_len: int,
        block_table: np.ndarray,
    ) -> torch.Tensor:
        """Logits [1, vocab] (fp32) after the last of ``input_ids``, the tokens at
        ``positions`` of a ``seq_len``-token context in the pages ``block_table``, their K/V
        going to ``slot_mapping``. The tensor is the graphs' own output: valid until the next
        ``run``."""
        num_tokens, width = len(input_ids), len(block_table)
        if not self.can_run(num_tokens, width):
            raise ValueError(
                f"{num_tokens} tokens over {width} blocks: the graphs take 1 to "
                f"{self.sizes[-1]} tokens over at most {self.max_blocks} blocks"
            )
        size = next(s for s in self.sizes if s >= num_tokens)
        host = self._host
        self._upload.wait_writable()
        # NOTE: padding rows keep the ids and positions of an earlier step (valid ones); their
        # slot alone must be reset, so that they write nothing.
        host["input_ids"][:num_tokens] = input_ids
        host["positions"][:num_tokens] = positions
        host["slot_mapping"][:num_tokens] = slot_mapping
        host["slot_mapping"][num_tokens:size] = -1
        host["cu_q_lens"][1] = num_tokens
        host["seq_lens"][0] = seq_len
        host["logit_rows"][0] = num_tokens - 1
        host["block_tables"][:width] = block_table
        self._upload.upload(self._tables_offset + 4 * width)
        graph = self._graphs.get(size)
        if graph is None:
            self._forward(size)
        else:
            graph.replay()
        return self.logits

    @torch.inference_mode()
    def _forward(self, size: int) -> None:
        static = self.static
        meta = AttentionMetadata(
            slot_mapping=static["slot_mapping"][:size],
            block_tables=static["block_tables"].view(1, self.max_blocks),
            cu_q_lens=static["cu_q_lens"],
            seq_lens=static["seq_lens"],
            max_q_len=size,
            max_seq_len=self.max_model_len,
        )
        self.logits.copy_(
            self.model(
                static["input_ids"][:size],
                static["positions"][:size],
                self.kv_caches,
                meta,
                static["logit_rows"],
            )
        )
