"""What one engine step of a worker costs: the simulator's model of a worker's speed.

A step computes some prompt tokens (chunks of prefills, under a token budget) and one token for
each decoding request, as the worker's scheduler batches them. Its time is a sum::

    step time = step_s
              + prefill_s_per_token      x prompt tokens computed
              + attention_s_per_pair     x (new token, earlier token) pairs those tokens attend
              + decode_s_per_seq         x decoding requests
              + decode_s_per_context_token x tokens of context those requests read

A prefill chunk of n new tokens after c tokens already in the cache (cached or computed in earlier
chunks) attends ``n c + n (n + 1) / 2`` pairs. The sum ignores overlap (a small decode batch is
bound by reading the weights, which ``step_s`` counts, not by its arithmetic).

Two profiles ship, each figure's source beside it: ``cpu``, fitted to this repository's own
``kvswitch bench ttft`` / ``kvswitch bench decode`` on the built-in model, and ``gpu``, an
estimate for a Llama-3-8B-class model in bf16 on one H100 SXM from public specifications and this
repository's H100 kernel figures (docs/BENCHMARKS.md). Neither is a measurement of a fleet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerProfile:
    name: str
    step_s: float  # fixed cost of every step
    prefill_s_per_token: float
    attention_s_per_pair: float
    decode_s_per_seq: float
    decode_s_per_context_token: float
    max_num_batched_tokens: int  # token budget of one step; longer prompts prefill in chunks
    max_num_seqs: int  # most requests running at once
    source: str = ""

    def __post_init__(self) -> None:
        for name in (
            "step_s",
            "prefill_s_per_token",
            "attention_s_per_pair",
            "decode_s_per_seq",
            "decode_s_per_context_token",
        ):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.step_s + self.prefill_s_per_token <= 0:
            raise ValueError("a step must cost something: step_s or prefill_s_per_token > 0")
        if not 1 <= self.max_num_seqs <= self.max_num_batched_tokens:
            # NOTE: so that every running request decodes in every step, as the simulator has it.
            raise ValueError(
                f"max_num_seqs must be in [1, max_num_batched_tokens], got {self.max_num_seqs}"
            )

    def step_time_s(
        self,
        num_prefill_tokens: int,
        num_attention_pairs: float,
        num_decodes: int,
        num_context_tokens: int,
    ) -> float:
        """One step: the prompt tokens it computes and their attention pairs, the requests it
        decodes and the context those read."""
        return (
            self.step_s
            + self.prefill_s_per_token * num_prefill_tokens
            + self.attention_s_per_pair * num_attention_pairs
            + self.decode_s_per_seq * num_decodes
            + self.decode_s_per_context_token * num_context_tokens
        )

    def prefill_time_s(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> float:
        """Time to first token of a prompt on an idle worker: its uncached tokens in chunks of
        the token budget, one step each."""
        total_s = 0.0
        done = num_cached_tokens
        while done < num_prompt_tokens:
            n = min(num_prompt_tokens - done, self.max_num_batched_tokens)
            total_s += self.step_time_s(n, attention_pairs(n, done), 0, 0)
            done += n
        return total_s


def attention_pairs(num_new_tokens: int, num_context_tokens: int) -> float:
    """(query, key) pairs of a causal chunk of ``num_new_tokens`` after ``num_context_tokens``."""
    return num_new_tokens * num_context_tokens + num_new_tokens * (num_new_tokens + 1) / 2


# The built-in model (kvswitch-tiny, 2 layers, hidden 256, fp32), torch reference attention,
# measured on cpu-2c-x on 2026-11-24 (docs/BENCHMARKS.md, "Fleet simulator"):
#   kvswitch bench ttft --num-prompt-tokens N --num-cached-tokens C    (median of 5 trials)
#     cold TTFT: 1,024 -> 0.033-0.037 s; 2,048 -> 0.081 s; 4,096 -> 0.127-0.169 s;
#       8,192 -> 0.388 s
#     warm TTFT, 128 new tokens after 896 / 1,920 / 3,968 / 8,064 cached: 5.2 / 7.6 / 13.9 /
#       22.4 ms; 512 after 512: 13.2 ms; 2,048 after 2,048: 135 ms
#   kvswitch bench decode --batch-sizes 1,8,32,64    (128-token prompts, 64 output tokens)
#     915 / 4,611 / 7,622 / 9,239 tokens/s; and --num-prompt-tokens 2048 --batch-sizes 1: 487
#     (batch 32 there: 250 tokens/s, 3.7 times slower than the fit; left out, see SIMULATOR.md)
# step_s, decode_s_per_seq and decode_s_per_context_token: least squares (relative error) over
# the five decode step times (batch / tokens per second; context ~160 and ~2,080 tokens).
# prefill_s_per_token, attention_s_per_pair: least squares over the twelve TTFTs with step_s
# fixed; the fit is within 40 % of every point (runs on this shared host differ by up to 30 %).
CPU = WorkerProfile(
    name="cpu",
    step_s=1.0e-3,
    prefill_s_per_token=22e-6,
    attention_s_per_pair=9.6e-9,
    decode_s_per_seq=15e-6,
    decode_s_per_context_token=0.50e-6,
    # The worker's defaults (worker/scheduler.py SchedulerConfig).
    max_num_batched_tokens=2048,
    max_num_seqs=64,
    source="kvswitch bench ttft / bench decode, built-in model on cpu-2c-x (2026-11-24)",
)

# Llama-3-8B (32 layers, 32 query / 8 KV heads of 128, 8.03 B parameters) in bf16 on one H100
# SXM. Estimates, not measurements:
#   step_s: the weights (16.06 GB) read once a step at 3.02 TB/s, the device copy rate measured
#     on gpu-h100 (docs/BENCHMARKS.md), 5.3 ms, plus ~0.7 ms of host work per step -> 6.0 ms.
#   prefill_s_per_token: 2 x 8.03 G = 16.1 GFLOP of matmuls per token at half the H100's dense
#     bf16 peak (989 TFLOP/s, NVIDIA H100 datasheet) -> 32 us (31 K tokens/s before attention).
#   attention_s_per_pair: 4 x 32 layers x 32 heads x 128 = 0.52 MFLOP per (query, key) pair at
#     307 TFLOP/s, this repository's paged_prefill kernel on gpu-h100 for this very head shape
#     (docs/BENCHMARKS.md, GPU figures) -> 1.7 ns.
#   decode_s_per_seq: one token's matmuls at the same rate as prefill -> 32 us.
#   decode_s_per_context_token: 128 KiB of K and V per token (2 x 32 x 8 x 128 x 2 bytes) read
#     at 2.81 TB/s, this repository's paged_decode kernel on gpu-h100 -> 47 ns.
#   max_num_batched_tokens 8,192 and max_num_seqs 256: a typical chunked-prefill budget and
#     batch limit for an 8B model on an 80 GB GPU (chosen, not measured).
GPU = WorkerProfile(
    name="gpu",
    step_s=6.0e-3,
    prefill_s_per_token=32e-6,
    attention_s_per_pair=1.7e-9,
    decode_s_per_seq=32e-6,
    decode_s_per_context_token=47e-9,
    max_num_batched_tokens=8192,
    max_num_seqs=256,
    source="estimate: Llama-3-8B bf16 on one H100 SXM from public specifications and this "
    "repository's H100 kernel figures",
)

PROFILES = {profile.name: profile for profile in (CPU, GPU)}


def get_profile(name: str) -> WorkerProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}") from None
