"""Where a prefix hit's time to first token goes on a GPU: the figures behind docs/BENCHMARKS.md's
"gpu-h200, 2026-11-28" section (a CUDA GPU is needed).

    python -m kvswitch.benchmarks.ttft_breakdown OUT.json [MODEL]     (MODEL: random:llama-1b)

- ``ab``: on one engine, 15 rounds of a cold 4,096-token prompt and two warm ones (3,968 cached),
  one with the one-sequence CUDA graphs and one with them off (the piecewise graphs), medians;
- ``host_us``: a warm request's host phases (perf_counter around each: admission, scheduling, the
  step's arrays, ``execute_batch`` up to the replay's launch, and the upload within it);
- ``replay_ms``: the 128-token graph replayed alone over a 4,096-token context (CUDA events), and
  with attention's tiles and splits varied (each captured again).
"""

from __future__ import annotations

import functools
import importlib
import json
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import torch

from kvswitch.benchmarks.engine import _engine, _time_to_first_token
from kvswitch.worker.cuda_graphs import SequenceGraphs
from kvswitch.worker.step_inputs import UploadBuffer

PROMPT, CACHED = 4096, 3968
# (block_m, block_n, num_warps), splits: paged_prefill's choices tried inside the graph.
VARIANTS = [
    ((128, 128, 8), 4),
    ((128, 128, 8), 8),
    ((64, 64, 4), 4),
    ((64, 64, 4), 8),
    ((64, 64, 4), 16),
    ((128, 64, 8), 8),
    ((128, 64, 8), 16),
]


def run(model: str) -> dict:
    engine = _engine(model, "cuda", "bfloat16", PROMPT)
    graphs = engine.runner.sequence_graphs
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size

    def tokens(n: int, prefix: np.ndarray | None = None) -> np.ndarray:
        new = rng.integers(0, vocab, n, dtype=np.int64)
        return new if prefix is None else np.concatenate([prefix, new])

    def warm(request_id: str, before_warm=lambda: None) -> float:
        """A prompt whose first CACHED tokens another request just computed."""
        prefix = tokens(CACHED)
        _time_to_first_token(engine, f"prime-{request_id}", tokens(PROMPT - CACHED, prefix))
        before_warm()
        return _time_to_first_token(engine, request_id, tokens(PROMPT - CACHED, prefix))

    _time_to_first_token(engine, "warmup", tokens(PROMPT))
    times: dict[str, list[float]] = {"cold": [], "whole": [], "piecewise": []}
    for i in range(15):
        times["cold"].append(_time_to_first_token(engine, f"cold-{i}", tokens(PROMPT)))
        for mode in ("whole", "piecewise"):
            engine.runner.sequence_graphs = graphs if mode == "whole" else None
            times[mode].append(warm(f"{mode}-{i}"))
        print(f"  round {i + 1} of 15", file=sys.stderr)
    engine.runner.sequence_graphs = graphs
    ab = {f"{name}_ms": statistics.median(values) * 1e3 for name, values in times.items()}
    ab["speedup_whole"] = ab["cold_ms"] / ab["whole_ms"]
    ab["speedup_piecewise"] = ab["cold_ms"] / ab["piecewise_ms"]
    return {
        "ab": ab,
        "host_us": _host_phases(engine, warm),
        "replay_ms": _replays(engine, graphs),
        "model": model,
        "device": torch.cuda.get_device_name(),
    }


def _host_phases(engine, warm) -> dict[str, float]:
    phases: dict[str, list[float]] = defaultdict(list)
    spent: dict[str, float] = defaultdict(float)

    def timed(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start

        setattr(owner, name, wrapper)

    timed(engine, "add_request", "add_request")
    timed(engine.scheduler, "schedule", "schedule")
    timed(engine, "_batch", "step_arrays")
    timed(engine.runner, "execute_batch", "execute_batch")
    timed(UploadBuffer, "upload", "upload")
    for i in range(20):
        warm(f"phases-{i}", before_warm=spent.clear)  # the priming request's phases dropped
        for label, seconds in spent.items():
            phases[label].append(seconds * 1e6)
    return {label: statistics.median(values) for label, values in phases.items()}


def _replays(engine, graphs: SequenceGraphs) -> dict[str, float]:
    new = PROMPT - CACHED
    blocks = np.arange(1, PROMPT // 16 + 1, dtype=np.int32)
    slots = (blocks[CACHED // 16 + np.arange(new) // 16] * 16 + np.arange(new) % 16).astype(
        np.int32
    )

    def replay_ms(sequence_graphs: SequenceGraphs) -> float:
        sequence_graphs.run(np.arange(new), np.arange(CACHED, PROMPT), slots, PROMPT, blocks)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        elapsed = []
        for _ in range(50):
            start.record()
            sequence_graphs._graphs[new].replay()
            end.record()
            end.synchronize()
            elapsed.append(start.elapsed_time(end))
        return statistics.median(elapsed)

    results = {"default": replay_ms(graphs)}
    prefill = importlib.import_module("kvswitch.kernels.paged_prefill")
    tiles_module = importlib.import_module("kvswitch.kernels.tiles")
    saved = prefill.prefill_tiles, prefill.choose_prefill_splits
    try:
        for (block_m, block_n, num_warps), splits in VARIANTS:
            tiles = tiles_module.Tiles(
                block_n=block_n, block_m=block_m, num_warps=num_warps, num_stages=2
            )
            prefill.prefill_tiles = lambda *args, tiles=tiles: tiles
            prefill.choose_prefill_splits = lambda *args, splits=splits: splits
            variant = SequenceGraphs(
                engine.model,
                engine.runner.kv_caches,
                block_size=16,
                max_model_len=graphs.max_model_len,
                max_num_tokens=new,
            )
            results[f"{block_m}x{block_n}x{num_warps}w_{splits}_splits"] = replay_ms(variant)
    finally:
        prefill.prefill_tiles, prefill.choose_prefill_splits = saved
    return results


def main(argv: list[str]) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("ttft_breakdown needs a CUDA GPU")
    results = run(argv[1] if len(argv) > 1 else "random:llama-1b")
    print(json.dumps(results, indent=1))
    with open(argv[0], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
