"""``kvswitch bench admission``: what a very long prompt's arrival costs the requests decoding.

A worker's engine core (in its own process, as ``kvswitch worker`` runs it) decodes
``num_decodes`` requests. Then a prompt of ``prompt_len`` tokens arrives through the same path a
gRPC request takes: the token-id bytes taken as an array (a view, no copy), checked, hashed into
its block chain, and sent to the core. Figures:

- ``max_step_gap_ms``: the longest the core went between two steps while the long prompt
  arrived and began its prefill (receiving it, admitting it, sending outputs), against
  ``baseline_max_step_gap_ms`` over as many steps before it. The arrival should add nothing a
  decoding request can feel.
- ``admit_core_ms``: of that, the longest the core spent running the commands that had arrived:
  receiving and admitting the prompt (it copies one byte string; the hashing was done).
- ``arrival_delay_ms``: ``max_step_gap_ms`` less the median gap before it: what the arrival
  added to the most delayed step. On 2 cores the gaps also hold time the core waited for a CPU
  (the serving process, its receiver thread and torch's threads share them), before the arrival
  as after it.
- ``admit_ms``: the serving process's own time for that prompt (array, check, hash, send); it
  runs beside the core, not between its steps.

The model is the built-in tiny one with a long context (``random:tiny-long``), so that only the
host work is measured; the long prompt is aborted after ``steps_after`` steps (its prefill of a
128K-token prompt would take minutes on a CPU, and is the model's work, not admission's).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from kvswitch.benchmarks.timing import machine_info
from kvswitch.worker.engine_config import EngineConfig


@dataclass(frozen=True)
class AdmissionBenchConfig:
    num_decodes: int = 64
    prompt_len: int = 131072
    steps_before: int = 50
    steps_after: int = 20
    seed: int = 0
    cpu_threads: int = 0  # the engine core's torch threads; 0 = one per core

    def __post_init__(self) -> None:
        if self.num_decodes <= 0 or self.steps_before <= 0 or self.steps_after <= 0:
            raise ValueError("num_decodes, steps_before and steps_after must be positive")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0, got {self.cpu_threads}")
        if not 0 < self.prompt_len < 262144:
            raise ValueError(f"prompt_len must be in [1, 262144), got {self.prompt_len}")


def run(config: AdmissionBenchConfig) -> dict:
    return asyncio.run(_run(config))


def engine_config(config: AdmissionBenchConfig) -> EngineConfig:
    """The engine core the benchmark runs: room for the decodes' contexts and the long prompt."""
    kv_bytes_per_token = 2 * 2 * 2 * 64 * 4  # tiny-long: 2 layers, K and V, 2 heads of 64, fp32
    num_tokens = config.prompt_len + config.num_decodes * 4096
    return EngineConfig(
        model="random:tiny-long",
        block_size=16,
        kv_cache_bytes=num_tokens * kv_bytes_per_token,
        max_num_seqs=config.num_decodes + 1,
        cpu_threads=config.cpu_threads,
    )


async def _run(config: AdmissionBenchConfig) -> dict:
    from kvswitch.cache_index.hashing import tokens_to_bytes
    from kvswitch.v1 import worker_pb2
    from kvswitch.worker.engine_client import EngineClient
    from kvswitch.worker.request import SamplingParams
    from kvswitch.worker.servicer import prompt_from_proto

    engine = await asyncio.to_thread(EngineClient.start, engine_config(config))
    try:
        rng = np.random.default_rng(config.seed)
        vocab = engine.facts.vocab_size
        print(f"  {config.num_decodes} requests decoding ...", file=sys.stderr)
        queues = [
            await engine.submit(
                f"decode-{i}", rng.integers(0, vocab, 64), SamplingParams(max_tokens=100_000)
            )
            for i in range(config.num_decodes)
        ]
        await _steps(engine, 10)  # every request is decoding now
        engine.take_max_step_gap()
        gaps_before = await _steps(engine, config.steps_before)

        # The long prompt, as the worker's servicer receives it from the router.
        message = worker_pb2.WorkerGenerateRequest(
            prompt_token_ids_u32le=tokens_to_bytes(rng.integers(0, vocab, config.prompt_len))
        )
        print(f"  a {config.prompt_len:,}-token prompt arrives ...", file=sys.stderr)
        start = time.perf_counter()
        prompt = prompt_from_proto(message)
        await engine.submit("long", prompt, SamplingParams(max_tokens=1))
        admit_s = time.perf_counter() - start
        gaps_after = await _steps(engine, config.steps_after)
        engine.abort("long")
        for queue in queues:
            if not queue.empty() and isinstance(queue.get_nowait(), Exception):
                raise RuntimeError("a decoding request failed")
        if engine.load.num_running_requests < config.num_decodes:
            raise RuntimeError(f"only {engine.load.num_running_requests} requests ran")
    finally:
        await asyncio.to_thread(engine.stop)
    median_before = statistics.median(g.gap_s for g in gaps_before)
    result = {
        "machine": machine_info(),
        "num_decodes": config.num_decodes,
        "prompt_len": config.prompt_len,
        "cpu_threads": config.cpu_threads,
        "admit_ms": admit_s * 1000,
        # The core's own work for the arrival: receiving and admitting the prompt.
        "admit_core_ms": max(g.commands_s for g in gaps_after) * 1000,
        # What the arrival added to the slowest step: its gap less the usual one.
        "arrival_delay_ms": (max(g.gap_s for g in gaps_after) - median_before) * 1000,
        "max_step_gap_ms": max(g.gap_s for g in gaps_after) * 1000,
        "baseline_max_step_gap_ms": max(g.gap_s for g in gaps_before) * 1000,
        "baseline_median_step_gap_ms": median_before * 1000,
    }
    print(
        f"  the core admitted it in {result['admit_core_ms']:.3f} ms; largest gap between steps "
        f"{result['max_step_gap_ms']:.3f} ms as it arrived, "
        f"{result['baseline_max_step_gap_ms']:.3f} ms before; the serving process took "
        f"{result['admit_ms']:.1f} ms to admit it",
        file=sys.stderr,
    )
    return result


async def _steps(engine, num_steps: int) -> list:
    """The largest gap between steps (``StepGap``) in each of the next ``num_steps`` steps'
    reports."""
    gaps = []
    last = engine.counters.num_steps
    while len(gaps) < num_steps:
        await asyncio.sleep(0)
        steps = engine.counters.num_steps
        if steps != last:
            gaps.append(engine.take_max_step_gap())
            last = steps
        else:
            await asyncio.sleep(0.0005)
    return gaps
