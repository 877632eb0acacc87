"""Decode steps replayed from CUDA graphs.

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

All graphs share one memory pool, so a replay's logits stay valid until the next replay: the
engine samples them before its next step.

Off CUDA (``capture=False``) the same buffers and padding run the model eagerly, so that the tests
check the padding on a CPU; the GPU check (benchmarks/gpu_check.sh) checks the graphs.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvswitch.worker.attention import AttentionMetadata
from kvswitch.worker.model import CausalLM
from kvswitch.worker.step_inputs import UploadBuffer, aligned

logger = logging.getLogger(__name__)


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
        device = next(model.parameters()).device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {device}")
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
            ("input_ids", np.int64, 0),
            ("positions", np.int64, 0),
            ("slot_mapping", np.int32, -1),
            ("seq_lens", np.int32, 1),
        ]
        offsets, offset = [], 0
        for _, dtype, _ in layout:
            offsets.append(offset)
            offset += aligned(rows * np.dtype(dtype).itemsize)
        self._tables_offset = offset
        self._upload = UploadBuffer(device, offset + 4 * rows * self.max_blocks)
        self._fields: list[tuple[np.ndarray, int]] = []  # (host view, padding value)
        device_views = {}
        for (name, dtype, pad), offset in zip(layout, offsets, strict=True):
            host = self._upload.host_view(offset, dtype, (rows,))
            host[...] = pad
            self._fields.append((host, pad))
            device_views[name] = self._upload.device_view(offset, dtype, (rows,))
        self._upload.upload(self._tables_offset)
        self.input_ids = device_views["input_ids"]
        self.positions = device_views["positions"]
        self.slot_mapping = device_views["slot_mapping"]
        self.seq_lens = device_views["seq_lens"]
        self.block_tables = torch.zeros((rows, self.max_blocks), dtype=torch.int32, device=device)
        self.cu_q_lens = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.logit_rows = torch.arange(rows, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
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
            return self._forward(size)
        graph.replay()
        return self._logits[size]

    @torch.inference_mode()
    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            cu_q_lens=self.cu_q_lens[: size + 1],
            seq_lens=self.seq_lens[:size],
            max_q_len=1,
            max_seq_len=self.max_model_len,
        )
        return self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_caches,
            meta,
            self.logit_rows[:size],
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
            # NOTE: a run first, outside any capture: Triton compiles a kernel on its first
            # launch, and cuBLAS sets up its workspace, neither of which a capture may do.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize()
