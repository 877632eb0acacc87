"""``kvswitch bench ttft`` and ``kvswitch bench decode``: the worker engine on its default model.

ttft: time to first token of a prompt whose leading blocks are already cached, against the same
length cold. Each trial uses fresh random tokens, so a cold prompt never hits. Prompts reach the
engine as int arrays, as the worker's gRPC service hands them over (a Python list of 4,096 ids
would cost the conversion about 0.3 ms more).

decode: output tokens per second of batches of requests that all decode at once (prefill time
excluded).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvswitch.benchmarks.timing import machine_info

if TYPE_CHECKING:
    from kvswitch.worker.engine import LLMEngine


@dataclass(frozen=True)
class TTFTBenchConfig:
    model: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    num_prompt_tokens: int = 4096
    num_cached_tokens: int = 3968
    num_trials: int = 5
    profile: bool = False
    cuda_graphs: bool | None = None
    cache_hidden_states: bool = False
    # GiB of host tier (--offload-gb): the prefix is also measured loaded back from it, on a
    # device cache of room for two prompts (one more evicts it).
    offload_gb: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_cached_prompt(self.num_prompt_tokens, self.num_cached_tokens, self.num_trials)
        check_cuda_graphs(self.cuda_graphs, self.device)


@dataclass(frozen=True)
class DecodeBenchConfig:
    model: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    batch_sizes: str = "1,32"
    num_prompt_tokens: int = 128
    num_output_tokens: int = 64
    cuda_graphs: bool | None = None
    # Each batch again spread over this many LoRA adapters of random weights (rank lora_rank,
    # every module), beside the base alone; 0: the base alone.
    loras: int = 0
    lora_rank: int = 16
    cache_hidden_states: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check_cuda_graphs(self.cuda_graphs, self.device)
        if self.loras < 0 or self.lora_rank <= 0:
            raise ValueError(
                f"loras must be >= 0 and lora_rank positive, got {self.loras}, {self.lora_rank}"
            )


def check_cached_prompt(num_prompt_tokens: int, num_cached_tokens: int, num_trials: int) -> None:
    """ValueError unless a prompt of which ``num_cached_tokens`` are cached can be measured
    ``num_trials`` times."""
    if not 0 < num_cached_tokens < num_prompt_tokens:
        raise ValueError("num_cached_tokens must be positive and below num_prompt_tokens")
    if num_trials <= 0:
        raise ValueError("num_trials must be positive")


def check_cuda_graphs(cuda_graphs: bool | None, device: str) -> None:
    if cuda_graphs and not device.startswith("cuda"):
        raise ValueError("cuda_graphs replays steps on a GPU: use it with a cuda device")


def make_engine(
    model: str,
    device: str,
    dtype: str,
    num_tokens: int,
    *,
    cuda_graphs: bool | None = None,
    lora: tuple[str, ...] = (),
    cache_hidden_states: bool = False,
    offload_gb: float = 0.0,
    kv_cache_bytes: int = 1 << 30,
) -> LLMEngine:
    # NOTE: imported here so that `kvswitch --help` does not load torch.
    from kvswitch.worker.engine import EngineConfig, LLMEngine

    return LLMEngine(
        EngineConfig(
            model=model or None,
            device=device,
            dtype=dtype,
            kv_cache_bytes=kv_cache_bytes,
            max_num_batched_tokens=max(num_tokens, 2048),
            cuda_graphs=cuda_graphs,
            lora=lora,
            max_loras=max(len(lora), 1),
            cache_hidden_states=cache_hidden_states,
            offload_gb=offload_gb,
        )
    )


def _time_to_first_token(engine: LLMEngine, request_id: str, prompt: np.ndarray) -> float:
    return time_first_output(engine, request_id, prompt)[0]


def time_first_output(
    engine: LLMEngine, request_id: str, prompt: np.ndarray, **options: Any
) -> tuple[float, Any]:
    """Seconds from adding a one-token request to its first output, and that output;
    ``options``: the request's ``SamplingParams`` fields, and ``pooling``."""
    from kvswitch.worker.request import SamplingParams

    pooling = options.pop("pooling", None)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, **options), pooling=pooling)
    elapsed_s, first = None, None
    while engine.has_unfinished():
        for output in engine.step():
            if elapsed_s is None and output.request_id == request_id:
                if engine.runner.device.type == "cuda":
                    import torch

                    torch.cuda.synchronize()
                # NOTE: the first token, not the end of the loop: a host tier's copies of the
                # blocks it freed go on after it.
                elapsed_s, first = time.perf_counter() - start, output
    assert elapsed_s is not None
    return elapsed_s, first


def run_ttft(config: TTFTBenchConfig) -> dict:
    kv_cache_bytes = 1 << 30
    if config.offload_gb:
        kv_cache_bytes = _two_prompts_bytes(config)
    engine = make_engine(
        config.model,
        config.device,
        config.dtype,
        config.num_prompt_tokens,
        cuda_graphs=config.cuda_graphs,
        cache_hidden_states=config.cache_hidden_states,
        offload_gb=config.offload_gb,
        kv_cache_bytes=kv_cache_bytes,
    )
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(config.seed)

    def tokens(n: int, prefix: np.ndarray | None = None) -> np.ndarray:
        new = rng.integers(0, vocab, n, dtype=np.int64)
        return new if prefix is None else np.concatenate([prefix, new])

    _time_to_first_token(engine, "warmup", tokens(config.num_prompt_tokens))
    cold, warm, reloaded = [], [], []
    num_new = config.num_prompt_tokens - config.num_cached_tokens
    for trial in range(config.num_trials):
        cold.append(_time_to_first_token(engine, f"cold-{trial}", tokens(config.num_prompt_tokens)))
        prefix = tokens(config.num_cached_tokens)
        _time_to_first_token(engine, f"prime-{trial}", tokens(num_new, prefix))
        warm.append(_time_to_first_token(engine, f"warm-{trial}", tokens(num_new, prefix)))
        line = f"  trial {trial + 1}: cold {cold[-1]:.3f}s  warm {warm[-1]:.3f}s"
        if engine.offload is not None:
            for filler in range(2):  # the prefix leaves the device for the host tier
                prompt = tokens(config.num_prompt_tokens)
                _time_to_first_token(engine, f"fill-{trial}-{filler}", prompt)
            engine.offload.flush()
            reloaded.append(
                _time_to_first_token(engine, f"reloaded-{trial}", tokens(num_new, prefix))
            )
            line += f"  loaded back {reloaded[-1]:.3f}s"
        print(line, file=sys.stderr)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    profiles = {}
    if config.profile:
        prefix = tokens(config.num_cached_tokens)
        _time_to_first_token(engine, "prime-profile", tokens(num_new, prefix))
        for name, prompt in (
            ("warm", tokens(num_new, prefix)),
            ("cold", tokens(len(prefix) + num_new)),
        ):
            profiles[name] = _profile(engine, f"profile-{name}", prompt)
    return {
        **({"profile": profiles} if profiles else {}),
        "cold_ttft_s": cold_s,
        "warm_ttft_s": warm_s,
        "speedup": cold_s / warm_s,
        "num_prompt_tokens": config.num_prompt_tokens,
        "num_cached_tokens": config.num_cached_tokens,
        "model": config.model or engine.model_config.name,
        "device": config.device,
        "dtype": config.dtype,
        "cuda_graphs": engine.config.cuda_graphs,
        "cache_hidden_states": config.cache_hidden_states,
        **_host_tier_figures(engine, reloaded, cold_s),
        **graph_memory(engine),
        "machine": machine_info(),
    }


def _two_prompts_bytes(config: TTFTBenchConfig) -> int:
    """A device cache with room for two prompts (and a block): a third evicts the oldest."""
    from kvswitch.worker.weights import model_config

    shape = model_config(config.model or None)
    block_size = 16
    num_blocks = 2 * -(-config.num_prompt_tokens // block_size) + 1
    itemsize = 4 if config.dtype == "float32" else 2
    return num_blocks * shape.kv_bytes_per_token * block_size * itemsize


def _host_tier_figures(engine: LLMEngine, reloaded: list[float], cold_s: float) -> dict:
    """With a host tier: the prefix loaded back from it against cold, and the load's speed
    against this machine's plain copy."""
    tier = engine.offload
    if tier is None or not reloaded:
        return {}
    reloaded_s = statistics.median(reloaded)
    stats = tier.stats
    return {
        "reloaded_ttft_s": reloaded_s,
        "reloaded_speedup": cold_s / reloaded_s,
        "num_loaded_blocks": stats.num_loaded,
        "load_gb_per_s": stats.load_bytes / stats.load_s / 1e9 if stats.load_s else 0.0,
        "copy_gb_per_s": _copy_gb_per_s(engine.runner.device),
    }


def _copy_gb_per_s(device) -> float:
    """This machine's plain copy of 256 MiB, host memory to ``device``: the bound of a load."""
    import torch

    source = torch.empty(64 << 20, dtype=torch.float32, pin_memory=device.type == "cuda")
    target = torch.empty_like(source, device=device)
    target.copy_(source)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return source.numel() * 4 / best / 1e9


def graph_memory(engine: LLMEngine) -> dict[str, float]:
    """What the engine set aside for its CUDA graphs and what capturing them took, in MiB."""
    if engine.graph_memory_bytes is None:
        return {}
    set_aside, taken = engine.graph_memory_bytes
    return {
        "graph_memory_set_aside_mib": set_aside / 2**20,
        "graph_memory_taken_mib": taken / 2**20,
    }


def _profile(engine: LLMEngine, request_id: str, prompt: np.ndarray) -> dict:
    """One time-to-first-token under torch's profiler: how much of it the host spends issuing
    work and how much the device spends running it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if engine.runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        wall_s = _time_to_first_token(engine, request_id, prompt)
    events = prof.key_averages()
    # NOTE: a torch op and the kernels it launches both report device time; the kernels alone
    # (events on the device) add up to what the device ran.
    kernels = sorted(
        (e for e in events if e.device_type != DeviceType.CPU),
        key=lambda e: -e.self_device_time_total,
    )
    return {
        "wall_ms": wall_s * 1e3,
        "host_ms": events.self_cpu_time_total / 1e3,
        "device_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
        "num_torch_ops": sum(e.count for e in events if e.key.startswith("aten::")),
        "num_kernels": sum(e.count for e in kernels),
        "top_kernels_ms": {e.key[:60]: e.self_device_time_total / 1e3 for e in kernels[:8]},
    }


def run_decode(config: DecodeBenchConfig) -> dict:
    batch_sizes = [int(b) for b in config.batch_sizes.split(",") if b.strip()]
    if not batch_sizes or min(batch_sizes) <= 0:
        raise ValueError(f"batch_sizes must list positive integers, got {config.batch_sizes!r}")
    results: dict = {
        "machine": machine_info(),
        "device": config.device,
        "dtype": config.dtype,
        "cuda_graphs": config.cuda_graphs is not False and config.device.startswith("cuda"),
        "cache_hidden_states": config.cache_hidden_states,
    }
    rng = np.random.default_rng(config.seed)
    with tempfile.TemporaryDirectory(prefix="kvswitch-bench-loras-") as folder:
        loras = _random_adapters(config, Path(folder))
        for batch in batch_sizes:
            prompts = [rng.integers(0, 1 << 30, config.num_prompt_tokens) for _ in range(batch)]
            tokens_per_s, engine_figures = _decode(config, batch, prompts, ())
            results[f"decode_tokens_per_s_batch_{batch}"] = tokens_per_s
            for key, value in engine_figures.items():
                results[f"{key}_batch_{batch}"] = value
            print(f"  batch {batch}: {tokens_per_s:,.0f} tokens/s", file=sys.stderr)
            if not loras:
                continue
            with_loras, lora_figures = _decode(config, batch, prompts, loras)
            results[f"decode_tokens_per_s_batch_{batch}_loras"] = with_loras
            results[f"loras_vs_base_batch_{batch}"] = with_loras / tokens_per_s
            results.update(lora_figures)
            print(
                f"  batch {batch} over {len(loras)} adapters: {with_loras:,.0f} tokens/s "
                f"({with_loras / tokens_per_s:.2f}x the base alone)",
                file=sys.stderr,
            )
    if loras:
        results.update(num_loras=config.loras, lora_rank=config.lora_rank)
    return results


def _decode(
    config: DecodeBenchConfig, batch: int, prompts: list[np.ndarray], loras: tuple[str, ...]
) -> tuple[float, dict[str, float]]:
    """Output tokens per second of ``batch`` requests decoding together (their prefill step
    excluded), and the engine's other figures: its graphs' memory, or with ``loras`` (request
    i names adapter i mod their number) how long an adapter takes to load."""
    from kvswitch.worker.request import SamplingParams

    engine = make_engine(
        config.model,
        config.device,
        config.dtype,
        batch * config.num_prompt_tokens,
        cuda_graphs=config.cuda_graphs,
        lora=loras,
        cache_hidden_states=config.cache_hidden_states,
    )
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=config.num_output_tokens)
    names = [spec.partition("=")[0] for spec in loras]
    for i, prompt in enumerate(prompts):
        lora = names[i % len(names)] if names else None
        engine.add_request(f"r{i}", prompt % vocab, params, lora=lora)
    engine.step()  # every prompt prefills in this one step
    num_tokens, start = 0, time.perf_counter()
    while engine.has_unfinished():
        num_tokens += len(engine.step())
    tokens_per_s = num_tokens / (time.perf_counter() - start)
    figures = _lora_load_ms(engine, names[0]) if names else graph_memory(engine)
    # NOTE: the next engine measures what capturing its graphs takes from the memory the
    # allocator holds: this one's must be handed back first (a later batch size's figure
    # came out negative while it was kept).
    engine.close()
    del engine
    _release_device_memory(config.device)
    return tokens_per_s, figures


def _lora_load_ms(engine: LLMEngine, name: str) -> dict[str, float]:
    """Milliseconds to put adapter ``name`` into a slot: read from its folder, and from the
    copy in host memory (medians of 5)."""
    from kvswitch.worker.lora import load_lora_adapter

    manager = engine.loras
    path = manager.paths[name]

    def timed(load: Callable[[], object]) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            load()
            _synchronize(engine)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    slot = manager.slots_for({name})[name]
    from_disk = timed(
        lambda: manager.slots.load(
            slot, load_lora_adapter(name, path, max_rank=manager.slots.max_rank)
        )
    )
    adapter = load_lora_adapter(name, path, max_rank=manager.slots.max_rank)
    from_host = timed(lambda: manager.slots.load(slot, adapter))
    return {"lora_load_from_disk_ms": from_disk, "lora_load_from_host_ms": from_host}


def _synchronize(engine: LLMEngine) -> None:
    if engine.runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def _random_adapters(config: DecodeBenchConfig, folder: Path) -> tuple[str, ...]:
    """``config.loras`` adapters of random weights for the model, rank ``config.lora_rank`` on
    every module, written as PEFT writes them; their ``NAME=PATH`` specs."""
    if not config.loras:
        return ()
    import torch
    from safetensors.torch import save_file

    from kvswitch.worker.lora import MODULES, module_shapes
    from kvswitch.worker.weights import model_config

    shapes = module_shapes(model_config(config.model or None))
    num_layers = model_config(config.model or None).num_layers
    generator = torch.Generator().manual_seed(config.seed)
    specs = []
    for i in range(config.loras):
        weights = {}
        for layer in range(num_layers):
            for module, (fan_in, fan_out) in shapes.items():
                part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
                shape_a, shape_b = (config.lora_rank, fan_in), (fan_out, config.lora_rank)
                weights[f"{prefix}.lora_A.weight"] = torch.randn(shape_a, generator=generator)
                weights[f"{prefix}.lora_B.weight"] = 0.01 * torch.randn(
                    shape_b, generator=generator
                )
        path = folder / f"adapter-{i}"
        path.mkdir()
        settings = {"peft_type": "LORA", "r": config.lora_rank, "lora_alpha": 2 * config.lora_rank}
        settings["target_modules"] = list(MODULES)
        (path / "adapter_config.json").write_text(json.dumps(settings))
        save_file(weights, str(path / "adapter_model.safetensors"))
        specs.append(f"adapter-{i}={path}")
    return tuple(specs)


def _release_device_memory(device: str) -> None:
    if device.startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
