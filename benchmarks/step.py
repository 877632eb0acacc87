"""``kvswitch bench step``: the host work of one engine step, everything but the model's forward.

``num_seqs`` requests decode together at a context of about ``context_len`` tokens each. They
share every block but their last, so setting them up prefills one prompt; their block tables are
still ``context_len / block_size`` entries long each. Every timed step schedules, builds the
batch (block tables, positions, slot mapping), moves it to the device, runs the forward (timed on
its own and taken out), samples and updates the requests: ``host_step_ms`` is the median of a
step's time less its forward's. With ``parts``, each part of the host work is timed on its own
as well (``parts_ms``, medians; the timers themselves add a little to ``host_step_ms``):
``schedule``, ``batch`` (the step's arrays), ``runner_inputs`` (positions, slots, moving them to
the device), ``sample`` and ``hand_out`` (updating the requests with their tokens).

Then the sampler alone, on ``num_seqs`` rows of a 32,000-token vocabulary (a Llama's), every row
sampled at temperature 0.8: ``sample_ms`` with top_p 1 and ``sample_top_p_ms`` with top_p 0.95.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvswitch.benchmarks.engine import check_cuda_graphs
from kvswitch.benchmarks.timing import machine_info


@dataclass(frozen=True)
class StepBenchConfig:
    model: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    num_seqs: int = 256
    context_len: int = 4096
    num_steps: int = 20
    cuda_graphs: bool | None = None
    parts: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_seqs <= 0 or self.num_steps <= 0:
            raise ValueError("num_seqs and num_steps must be positive")
        if self.context_len < 64:
            raise ValueError(f"context_len must be at least 64, got {self.context_len}")
        check_cuda_graphs(self.cuda_graphs, self.device)


class _TimedForward:
    """Stands in for the runner's model (or the graphs' replay): calls it, and adds up the time
    its calls take."""

    def __init__(self, model: Any, synchronize: Any) -> None:
        self.model = model
        self.synchronize = synchronize
        self.seconds = 0.0

    def __call__(self, *args: Any) -> Any:
        self.synchronize()  # what the step queued before the forward is the step's
        start = time.perf_counter()
        logits = self.model(*args)
        self.synchronize()
        self.seconds += time.perf_counter() - start
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class _TimedCalls:
    """Stands in for a method: calls it, and keeps each call's time."""

    def __init__(self, method: Any) -> None:
        self.method = method
        self.seconds: list[float] = []

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        result = self.method(*args)
        self.seconds.append(time.perf_counter() - start)
        return result


def run(config: StepBenchConfig) -> dict:
    # NOTE: imported here so that `kvswitch --help` does not load torch.
    import torch

    from kvswitch.worker.engine import EngineConfig, LLMEngine
    from kvswitch.worker.request import SamplingParams
    from kvswitch.worker.weights import model_config

    block_size = 16
    # Blocks in use: the shared prefix, and each request's own last blocks as it decodes.
    num_blocks = config.context_len // block_size + config.num_seqs * (
        2 + (config.num_steps + 8) // block_size
    )
    element_size = torch.empty((), dtype=getattr(torch, config.dtype)).element_size()
    bytes_per_block = model_config(config.model or None).kv_bytes_per_token * block_size
    engine = LLMEngine(
        EngineConfig(
            model=config.model or None,
            device=config.device,
            dtype=config.dtype,
            block_size=block_size,
            kv_cache_bytes=num_blocks * bytes_per_block * element_size,
            max_num_seqs=config.num_seqs,
            max_num_batched_tokens=max(config.context_len, config.num_seqs * block_size),
            cuda_graphs=config.cuda_graphs,
        )
    )
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(config.seed)
    prefix_len = (config.context_len // block_size - 1) * block_size
    prefix = rng.integers(0, vocab, prefix_len).tolist()
    params = SamplingParams(max_tokens=config.num_steps + 8)
    print(
        f"  {config.num_seqs} requests at {config.context_len} tokens of context ...",
        file=sys.stderr,
    )
    for i in range(config.num_seqs):
        tail = rng.integers(0, vocab, block_size - 1).tolist()
        engine.add_request(f"r{i}", prefix + tail, params)
        if i == 0:
            engine.step()  # the shared prefix, once; the others find it cached
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # warm up: every request is decoding now
        engine.step()
    if len(engine.scheduler.running) != config.num_seqs:
        raise RuntimeError(f"only {len(engine.scheduler.running)} requests run at once")

    cuda = engine.runner.device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else lambda: None
    graphs = engine.runner.graphs
    if graphs is None:
        timed = engine.runner.model = _TimedForward(engine.runner.model, synchronize)
    else:  # the forward is the graph's replay
        timed = graphs.replay = _TimedForward(graphs.replay, synchronize)
    if config.parts:
        parts = {
            "schedule": _TimedCalls(engine.scheduler.schedule),
            "batch": _TimedCalls(engine._batch),
            "execute": _TimedCalls(engine.runner.execute_batch),
            "sample": _TimedCalls(engine.sampler.sample),
            "postprocess": _TimedCalls(engine._postprocess),
        }
        engine.scheduler.schedule = parts["schedule"]
        engine._batch = parts["batch"]
        engine.runner.execute_batch = parts["execute"]
        engine.sampler.sample = parts["sample"]
        engine._postprocess = parts["postprocess"]
    step_s, forward_s = [], []
    for _ in range(config.num_steps):
        before = timed.seconds
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = engine.step()
        if cuda:
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - start)
        forward_s.append(timed.seconds - before)
        if len(outputs) != config.num_seqs:
            raise RuntimeError(f"a step decoded {len(outputs)} of {config.num_seqs} requests")
    host_ms = [(s - f) * 1000 for s, f in zip(step_s, forward_s, strict=True)]
    sample_ms = {
        top_p: _sample_ms(config.num_seqs, config.device, top_p, rng) for top_p in (1.0, 0.95)
    }
    context = statistics.mean(r.num_tokens for r in engine.scheduler.running)
    print(
        f"  host {statistics.median(host_ms):.2f} ms of a {statistics.median(step_s) * 1000:.1f} "
        f"ms step ({config.num_seqs} decodes at {context:,.0f} tokens)",
        file=sys.stderr,
    )
    result = {
        "machine": machine_info(),
        "device": config.device,
        "dtype": config.dtype,
        "cuda_graphs": engine.config.cuda_graphs,
        "num_seqs": config.num_seqs,
        "context_len": config.context_len,
        "num_steps": config.num_steps,
        "host_step_ms": statistics.median(host_ms),
        "host_step_ms_min": min(host_ms),
        "step_ms": statistics.median(step_s) * 1000,
        "forward_ms": statistics.median(forward_s) * 1000,
        "sample_ms": sample_ms[1.0],
        "sample_top_p_ms": sample_ms[0.95],
    }
    if config.parts:
        ms = {name: np.array(timed.seconds) * 1000 for name, timed in parts.items()}
        result["parts_ms"] = {
            "schedule": float(np.median(ms["schedule"])),
            "batch": float(np.median(ms["batch"])),
            "runner_inputs": float(np.median(ms["execute"] - np.array(forward_s) * 1000)),
            "sample": float(np.median(ms["sample"])),
            "hand_out": float(np.median(ms["postprocess"] - ms["sample"])),
        }
        print(
            "  parts: " + ", ".join(f"{k} {v:.3f} ms" for k, v in result["parts_ms"].items()),
            file=sys.stderr,
        )
    return result


def _sample_ms(num_seqs: int, device: str, top_p: float, rng: np.random.Generator) -> float:
    import torch

    from kvswitch.worker.request import SamplingParams
    from kvswitch.worker.sampler import Sampler

    logits = torch.from_numpy(rng.standard_normal((num_seqs, 32_000), np.float32)).to(device)
    params = [SamplingParams(temperature=0.8, top_p=top_p, seed=i) for i in range(num_seqs // 2)]
    params += [SamplingParams(temperature=0.8, top_p=top_p)] * (num_seqs - len(params))
    generators = [
        torch.Generator(device=device).manual_seed(p.seed) if p.seed is not None else None
        for p in params
    ]
    sampler, times = Sampler(), []
    for _ in range(10):
        start = time.perf_counter()
        sampler.sample(logits, params, generators).tolist()  # .tolist() waits for the device
        times.append((time.perf_counter() - start) * 1000)
    print(f"  sampling at top_p {top_p}: {statistics.median(times):.2f} ms", file=sys.stderr)
    return statistics.median(times)
