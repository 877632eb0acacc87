"""``kvswitch bench score``: prompt scoring (the prompt's logprobs, as ``echo`` with ``logprobs``
asks) and embeddings of a prompt whose leading blocks are cached, against the same length cold,
on the worker engine.

Warm prompts share their first ``num_cached_tokens`` with a prompt run just before (which cached
its blocks and, with the hidden-state cache, their final hidden states). The same warm prompts
also run on an engine without the hidden-state cache, which must compute the cached prefix again
(its KV hit is not enough: the prompt's logprobs need every position's hidden state). Each trial
uses fresh random tokens, so a cold prompt never hits.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvswitch.benchmarks.engine import check_cached_prompt, make_engine, time_first_output
from kvswitch.benchmarks.timing import machine_info
from kvswitch.worker.request import MAX_LOGPROBS

if TYPE_CHECKING:
    from kvswitch.worker.engine import LLMEngine


@dataclass(frozen=True)
class ScoreBenchConfig:
    model: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    num_prompt_tokens: int = 4096
    num_cached_tokens: int = 3968
    logprobs: int = 5
    num_trials: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        check_cached_prompt(self.num_prompt_tokens, self.num_cached_tokens, self.num_trials)
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")


def _engine(config: ScoreBenchConfig, *, cache_hidden_states: bool) -> LLMEngine:
    return make_engine(
        config.model,
        config.device,
        config.dtype,
        config.num_prompt_tokens,
        cuda_graphs=False,
        cache_hidden_states=cache_hidden_states,
    )


def _time_request(engine: LLMEngine, request_id: str, prompt: np.ndarray, **asks) -> float:
    """Seconds from adding a one-token request to its output, which carries what it asked."""
    elapsed_s, output = time_first_output(engine, request_id, prompt, **asks)
    assert output.prompt_logprobs is not None or output.embedding is not None
    return elapsed_s


def run(config: ScoreBenchConfig) -> dict:
    cached = _engine(config, cache_hidden_states=True)
    uncached = _engine(config, cache_hidden_states=False)
    vocab = cached.model_config.vocab_size
    rng = np.random.default_rng(config.seed)

    def tokens(n: int, prefix: np.ndarray | None = None) -> np.ndarray:
        new = rng.integers(0, vocab, n, dtype=np.int64)
        return new if prefix is None else np.concatenate([prefix, new])

    num_new = config.num_prompt_tokens - config.num_cached_tokens
    scoring = {"prompt_logprobs": config.logprobs}
    figures: dict[str, float] = {}
    for name, asks in (("score", scoring), ("embed", {"pooling": "last"})):
        for engine in (cached, uncached):
            _time_request(engine, "warmup", tokens(config.num_prompt_tokens), **asks)
        cold, warm, recomputed = [], [], []
        for trial in range(config.num_trials):
            prompt = tokens(config.num_prompt_tokens)
            cold.append(_time_request(cached, f"{name}-cold-{trial}", prompt, **asks))
            prefix = tokens(config.num_cached_tokens)
            for engine in (cached, uncached):
                # A plain request caches the prefix (and its rows, where the cache is).
                time_first_output(engine, f"{name}-prime-{trial}", tokens(num_new, prefix))
            prompt = tokens(num_new, prefix)
            warm.append(_time_request(cached, f"{name}-warm-{trial}", prompt, **asks))
            recomputed.append(_time_request(uncached, f"{name}-again-{trial}", prompt, **asks))
            print(
                f"  {name} trial {trial + 1}: cold {cold[-1]:.3f}s  warm {warm[-1]:.3f}s  "
                f"warm without the hidden-state cache {recomputed[-1]:.3f}s",
                file=sys.stderr,
            )
        cold_s, warm_s = statistics.median(cold), statistics.median(warm)
        figures |= {
            f"{name}_cold_s": cold_s,
            f"{name}_warm_s": warm_s,
            f"{name}_speedup": cold_s / warm_s,
            f"{name}_warm_without_hidden_cache_s": statistics.median(recomputed),
        }
    assert cached.hidden_cache is not None
    return {
        **figures,
        "hidden_bytes_per_block": cached.hidden_cache.bytes_per_block,
        "kv_bytes_per_block": cached.kv_layout.bytes_per_block,
        "num_prompt_tokens": config.num_prompt_tokens,
        "num_cached_tokens": config.num_cached_tokens,
        "logprobs": config.logprobs,
        "model": config.model or cached.model_config.name,
        "device": config.device,
        "dtype": config.dtype,
        "machine": machine_info(),
    }
