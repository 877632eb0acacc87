"""``kvswitch bench serve``: the whole serving path on one device, its greedy output checked.

Starts a local cluster (``kvswitch up``: a router and ``--workers`` workers on ``--device``) and
sends ``--num-prompts`` prompts through the client SDK, greedy, twice: once cold and once again,
when most of each prompt is in the worker's prefix cache. Every prompt shares its first
``--num-shared-tokens`` tokens with the others, so even the first pass hits the cache after its
first request. Then each served output is teacher-forced through the same model in this process,
with its attention, norms and rotary embedding on the pure-torch references
(``kernels/reference.py``) instead of the Triton kernels: at every output position, given the
same tokens before it, the served token must be the reference's greedy choice, or within
``--max-logit-gap`` of its logit (16-bit numbers round differently in the kernels and the
references, and a random model has many near-ties; a wrong token from a broken kernel or a stale
cache block sits several units below).

On ``--device cpu`` both sides take the torch references, so the check covers the serving path
(router, worker, prefix cache) but not the kernels; on ``cuda`` it covers the kernels too.
Exits 1 if a served token is further from the reference's choice than the tolerance.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np

from kvswitch.benchmarks.timing import machine_info


@dataclass(frozen=True)
class ServeBenchConfig:
    model: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    workers: int = 1
    num_prompts: int = 8
    num_prompt_tokens: int = 256
    num_shared_tokens: int = 128
    max_tokens: int = 32
    kv_cache_bytes: int = 1 << 30
    max_logit_gap: float = -1.0  # < 0: 1e-3 for float32, 0.25 for 16-bit dtypes
    cuda_graphs: bool | None = None  # the workers' (None: their default, on for cuda)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.num_shared_tokens < self.num_prompt_tokens:
            raise ValueError("num_shared_tokens must be in [0, num_prompt_tokens)")
        for name in ("workers", "num_prompts", "max_tokens", "kv_cache_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")

    @property
    def logit_tolerance(self) -> float:
        if self.max_logit_gap >= 0:
            return self.max_logit_gap
        return 1e-3 if self.dtype == "float32" else 0.25


# Every module that binds ``use_triton``, the switch between the Triton kernels and the torch
# references: worker.attention defines it, the others import it by name, so each holds a binding
# of its own that a patch of attention's leaves on the kernels.
USE_TRITON_MODULES = (
    "kvswitch.worker.attention",
    "kvswitch.worker.cuda_graphs",
    "kvswitch.worker.lora",
    "kvswitch.worker.model",
)


@contextmanager
def torch_references() -> Iterator[None]:
    """Within the block, the model in this process runs every layer on the torch references
    (``kernels/reference.py``): attention, RMSNorm and the rotary embedding alike."""
    with ExitStack() as stack:
        for module in USE_TRITON_MODULES:
            stack.enter_context(mock.patch(f"{module}.use_triton", return_value=False))
        yield


def _prompts(config: ServeBenchConfig, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(config.seed)
    shared = rng.integers(0, vocab_size, config.num_shared_tokens).tolist()
    num_own = config.num_prompt_tokens - config.num_shared_tokens
    return [
        shared + rng.integers(0, vocab_size, num_own).tolist() for _ in range(config.num_prompts)
    ]


def _serve(config: ServeBenchConfig, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Each prompt through a live cluster, cold then again: one record per request."""
    from kvswitch.client import Client
    from kvswitch.deploy.local import ClusterConfig, LocalCluster

    cluster_config = ClusterConfig(
        workers=config.workers,
        port=0,
        model=config.model,
        device=config.device,
        dtype=config.dtype,
        kv_cache_bytes=config.kv_cache_bytes,
        cuda_graphs=config.cuda_graphs,
    )
    records = []
    with LocalCluster(cluster_config) as cluster:
        cluster.wait_for_registration()
        with Client(cluster.address, timeout_s=300) as client:
            for pass_name in ("cold", "cached"):
                for i, prompt in enumerate(prompts):
                    result = client.generate(
                        prompt_token_ids=prompt, max_tokens=config.max_tokens, temperature=0.0
                    )
                    stats = result.stats
                    records.append(
                        {
                            "prompt": i,
                            "pass": pass_name,
                            "token_ids": list(result.token_ids),
                            "worker_id": stats.worker_id,
                            "num_cached_tokens": stats.num_cached_tokens,
                            "ttft_s": stats.ttft_s,
                        }
                    )
                    print(
                        f"  {pass_name} prompt {i}: {stats.num_cached_tokens} cached, "
                        f"ttft {stats.ttft_s * 1e3:.1f} ms",
                        file=sys.stderr,
                    )
    return records


def _reference_gaps(config: ServeBenchConfig, records: list[dict[str, Any]], prompts) -> None:
    """Teacher-forces each served output through the model on the torch references and
    stores, per output token, how far its logit is below the reference's best
    (``record["gaps"]``; 0.0 where the served token is the reference's greedy choice)."""
    import torch

    from kvswitch.worker.model_runner import ModelRunner, ScheduledSeq
    from kvswitch.worker.weights import load_model

    # NOTE: only this process's model is made to take the references; the served side is left
    # as it is.
    with torch_references():
        model = load_model(
            config.model or None, device=config.device, dtype=getattr(torch, config.dtype)
        )
        block_size = 16
        longest = config.num_prompt_tokens + config.max_tokens
        runner = ModelRunner(model, -(-longest // block_size), block_size)
        for record in records:
            prompt, output = prompts[record["prompt"]], record["token_ids"]
            tokens = prompt + output[:-1]
            seq = ScheduledSeq(tokens, 0, range(-(-len(tokens) // block_size)))
            logits = runner.execute([seq], every_token=True)[len(prompt) - 1 :]
            served = torch.tensor(output, device=logits.device)
            gaps = logits.max(dim=-1).values - logits.gather(1, served[:, None])[:, 0]
            record["gaps"] = gaps.tolist()


def run(config: ServeBenchConfig) -> dict[str, Any]:
    from kvswitch.worker.weights import model_config

    prompts = _prompts(config, model_config(config.model or None).vocab_size)
    records = _serve(config, prompts)
    _reference_gaps(config, records, prompts)
    gaps = [gap for record in records for gap in record["gaps"]]
    differing = [
        {"prompt": r["prompt"], "pass": r["pass"], "first_difference": _first_positive(r["gaps"])}
        for r in records
        if max(r["gaps"]) > 0.0
    ]
    by_pass = {p: [r for r in records if r["pass"] == p] for p in ("cold", "cached")}
    return {
        "ok": max(gaps) <= config.logit_tolerance,
        "logit_tolerance": config.logit_tolerance,
        "num_requests": len(records),
        "num_outputs_equal": len(records) - len(differing),
        "num_tokens": len(gaps),
        "num_tokens_greedy": sum(gap == 0.0 for gap in gaps),
        "max_logit_gap": max(gaps),
        "differing": differing,
        "cached_tokens": {p: sum(r["num_cached_tokens"] for r in rs) for p, rs in by_pass.items()},
        "prompt_tokens": {p: len(rs) * config.num_prompt_tokens for p, rs in by_pass.items()},
        "median_ttft_ms": {
            p: statistics.median(r["ttft_s"] for r in rs) * 1e3 for p, rs in by_pass.items()
        },
        "model": config.model or "tiny",
        "device": config.device,
        "cuda_graphs": config.cuda_graphs is not False and config.device == "cuda",
        "dtype": config.dtype,
        "machine": machine_info(),
    }


def _first_positive(gaps: list[float]) -> int:
    return next(i for i, gap in enumerate(gaps) if gap > 0.0)
